"""A tool-use environment for the `http_env` task: the model may call a calculator before it answers.
Copy it as the template for your own multi-turn environment.

    python examples/calculator_env.py --port 8090                      # serve it
    python examples/calculator_env.py --export-prompts prompts.jsonl   # write 200 prompt items
    # then submit a job with task {"name": "http_env", "params": {"url": "http://HOST:8090/step",
    #   "max_turns": 4}} and the items of prompts.jsonl as its prompts

The episode, one model turn at a time (tasks/http_env.py): the control plane POSTs
{"prompt", "reference", "actions"}, the model's turns so far, newest last. A turn that says
`calc(37*41)` gets the tool's result back as the next observation ("calc(37*41) = 1517"); a turn that
says `answer: 1522` ends the episode with reward 1.0 when that is the reference, else 0.0; a turn that
does neither, or one past MAX_CALLS tool calls, ends it with reward 0.0. The reply depends on the
request only (no state between requests), as Echo2 requires: any API process may ask for any turn,
and a retried turn asks again.

The calculator evaluates + - * / // % ** and parentheses over integers and decimals with `ast`, never
`eval`: an action is the model's text, and the worker that sampled it is not trusted. Standard library
only; GET /healthz answers {"status": "ok"}.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import random
import re
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

MAX_CALLS = 3
MAX_BODY_BYTES = 1 << 20
MAX_EXPRESSION_CHARS = 64
_CALL = re.compile(r"calc\(([^()]*(?:\([^()]*\)[^()]*)*)\)")
_ANSWER = re.compile(r"answer\s*:\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalcError(ValueError):
    pass


def calculate(expression: str) -> float | int:
    """The value of an arithmetic expression, or CalcError saying what is wrong with it."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise CalcError("not an arithmetic expression") from None
    return _value(tree.body)


def _value(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise CalcError("exponent larger than 64")  # 9**9**9 would hold the server for minutes
        try:
            return _OPS[type(node.op)](left, right)
        except (ZeroDivisionError, OverflowError) as e:
            raise CalcError(str(e)) from None
    raise CalcError("only numbers, + - * / // % ** and parentheses")


def step(prompt: str, reference: str | None, actions: list[str]) -> dict[str, Any]:
    """The environment's reply to the newest action: the whole game is this function."""
    action, calls = actions[-1], len(actions) - 1
    answer = _ANSWER.search(action)
    if answer:
        return {"done": True, "reward": float(reference is not None and _same(answer.group(1), reference))}
    call = _CALL.search(action)
    if call is None or calls >= MAX_CALLS:
        return {"done": True, "reward": 0.0}
    try:
        result = f"{_number(calculate(call.group(1)))}"
    except CalcError as e:
        result = f"error: {e}"
    return {"done": False, "observation": f"calc({call.group(1)}) = {result}"}


def _number(value: float | int) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _same(said: str, reference: str) -> bool:
    try:
        return float(said) == float(reference)
    except ValueError:
        return False


def prompts(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Two-step arithmetic a small model gets wrong without the tool, with its answer as the reference."""
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        a, b, c = rng.randint(11, 99), rng.randint(11, 99), rng.randint(2, 99)
        question = f"What is {a}*{b}+{c}?"
        items.append({"prompt": f"{question} You may write calc(EXPRESSION) to use a calculator. "
                                "End with answer: NUMBER.", "reference": str(a * b + c)})
    return items


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/healthz":
            return self._send(200, {"status": "ok"})
        self._send(404, {"error": "not found"})

    def do_POST(self):  # noqa: N802 (http.server's name)
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= MAX_BODY_BYTES:
            return self._send(400, {"error": f"a JSON body of at most {MAX_BODY_BYTES} bytes is required"})
        try:
            body = json.loads(self.rfile.read(length))
            actions, prompt, reference = body["actions"], body["prompt"], body.get("reference")
            if not (isinstance(actions, list) and actions and all(isinstance(a, str) for a in actions)):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            return self._send(400, {"error": "expected {prompt, reference, actions: [str, ...]}"})
        self._send(200, step(prompt, reference, actions))

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--export-prompts", type=Path, help="write prompt items as JSONL and exit")
    parser.add_argument("--count", type=int, default=200, help="how many prompt items to export")
    args = parser.parse_args()
    if args.export_prompts:
        args.export_prompts.write_text("".join(json.dumps(item) + "\n" for item in prompts(args.count)))
        return
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"calculator environment on http://{args.host}:{server.server_port}/step", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
