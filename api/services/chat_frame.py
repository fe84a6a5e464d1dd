"""What a model's chat template puts around an environment's reply in a multi-turn episode, rendered once
per job in a child process with bounded CPU time and memory.

The template comes with the job's model, which the job's owner chooses: Jinja's sandbox stops attribute
access but not loops or huge strings, and a template rendered inside the control plane at every turn
could hold a request thread, the interpreter and the memory every tenant shares. So it is rendered here,
once, with a marker in place of the reply, into three strings (`Frame`); each turn then only joins them.
A template that puts a reply's text in other than verbatim (trimmed, say) is framed as if it had not.

Run as a script (by `render`): reads {"template", "specials"} as JSON on stdin, writes the frame's
strings or {"error": why} on stdout.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

CPU_S, MEMORY_BYTES, WALL_S = 5, 2**30, 15.0
MAX_CHARS = 16_384  # one frame string: far more than any real template's markup around a turn
TURN, REPLY = "\x00echo2-turn\x00", "\x00echo2-reply\x00"  # stand in for the model's turn and the reply


@dataclass(frozen=True)
class Frame:
    """After the model's turn: `closing` (the end of its turn, led by the eos token when it stopped at one),
    then `prefix` + the environment's reply + `suffix` (the user turn and the next generation prompt)."""

    closing: str
    prefix: str
    suffix: str
    eos_token: str

    def around(self, reply: str, ended_with_eos: bool) -> str:
        closing = self.closing.removeprefix(self.eos_token) if ended_with_eos else self.closing
        return closing + self.prefix + reply + self.suffix


class FrameError(Exception):
    """The template cannot frame an environment's reply; the message says why."""


def render(template: str, specials: dict[str, str]) -> Frame:
    """The frame of `template`, rendered in a child process limited to CPU_S seconds of CPU, MEMORY_BYTES of
    memory and WALL_S seconds; FrameError when it cannot be."""
    request = json.dumps({"template": template, "specials": specials})
    try:
        done = subprocess.run([sys.executable, "-I", __file__], input=request, capture_output=True, text=True,
                              timeout=WALL_S, check=False)
    except subprocess.TimeoutExpired:
        raise FrameError(f"the model's chat template did not render within {WALL_S:.0f} s") from None
    if done.returncode != 0:
        raise FrameError(f"the model's chat template did not render within {CPU_S} s of CPU and "
                         f"{MEMORY_BYTES >> 30} GiB of memory")
    result = json.loads(done.stdout)
    if "error" in result:
        raise FrameError(result["error"])
    if max(len(result[k]) for k in ("closing", "prefix", "suffix")) > MAX_CHARS:
        raise FrameError(f"the model's chat template puts more than {MAX_CHARS} characters around a turn")
    return Frame(result["closing"], result["prefix"], result["suffix"], specials.get("eos_token", ""))


def _strings(template: str, specials: dict[str, str]) -> dict[str, str]:
    """In the child: the template rendered without, then with, a reply after a model turn."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    draw = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template).render
    before: list[dict[str, Any]] = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": TURN}]
    base = draw(messages=before, add_generation_prompt=False, **specials)
    if TURN not in base:
        return {"error": "the model's chat template does not show an assistant turn's content"}
    full = draw(messages=[*before, {"role": "user", "content": REPLY}], add_generation_prompt=True, **specials)
    if not full.startswith(base):
        return {"error": "the model's chat template renders earlier turns differently once a reply follows; "
                         "episodes cannot be framed for it"}
    rest = full[len(base):]
    if rest.count(REPLY) != 1:
        return {"error": "the model's chat template does not put a user turn's text in once"}
    prefix, suffix = rest.split(REPLY)
    return {"closing": base[base.rindex(TURN) + len(TURN):], "prefix": prefix, "suffix": suffix}


def _main() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CPU, (CPU_S, CPU_S))
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    request = json.load(sys.stdin)
    try:
        result = _strings(request["template"], request["specials"])
    except Exception as exc:  # a template we cannot render this way: say so rather than guess
        result = {"error": f"the model's chat template cannot frame an environment turn: {exc}"[:1000]}
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    _main()
