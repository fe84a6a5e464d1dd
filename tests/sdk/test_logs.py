"""echo2.logs in a fresh interpreter each time: the root logger is the process's, not pytest's."""

from __future__ import annotations

import json
import subprocess
import sys

LOG_SOME = """
import logging, sys
from echo2 import logs
logs.configure(*sys.argv[1:])
log = logging.getLogger("echo2.test")
log.debug("hidden at INFO")
log.info("step %d done\\nsecond line", 3)
try:
    1 / 0
except ZeroDivisionError:
    log.exception("it failed")
"""


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", LOG_SOME, *args], capture_output=True, text=True, timeout=60)


def test_json_is_one_object_per_line_with_the_traceback():
    done = run("json")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    assert [(x["level"], x["logger"], x["msg"]) for x in lines] == [
        ("info", "echo2.test", "step 3 done\nsecond line"), ("error", "echo2.test", "it failed")]
    assert "ZeroDivisionError" in lines[1]["exc"] and "exc" not in lines[0]
    assert all(x["ts"].endswith("+00:00") for x in lines)


def test_text_is_the_default_layout():
    done = run("text", "DEBUG")
    first = done.stderr.splitlines()[0]
    assert first.endswith(" DEBUG echo2.test: hidden at INFO") and not first.startswith("{")


def test_an_unknown_format_is_refused_by_name():
    done = run("xml")
    assert done.returncode == 1 and "log format must be 'text' or 'json', not 'xml'" in done.stderr


def test_the_entry_point_that_configures_first_decides():
    code = ("import logging; from echo2 import logs; logs.configure('json'); logs.configure('text', 'DEBUG');"
            "logging.getLogger('x').debug('no'); logging.getLogger('x').info('yes')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert [json.loads(line)["msg"] for line in done.stderr.splitlines()] == ["yes"]
