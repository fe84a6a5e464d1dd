"""bench/db_size.py on a few small steps (SQLite): the code path, not the figures. The archived database and the
archive files must each take less per group than the table did."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_db_size_benchmark_archives_what_it_filled() -> None:
    proc = subprocess.run([sys.executable, "bench/db_size.py", "--db", "sqlite", "--steps", "2", "--groups", "16"],
                          cwd=ROOT, timeout=300, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("sqlite"))
    hot, hot_table, archived, archived_table, files = (
        int(x.replace(",", "")) for x in re.findall(r"[\d,]+", row.split("|")[1] + row.split("|")[2]))
    assert archived < files < hot and archived_table < hot_table
