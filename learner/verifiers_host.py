"""Serve a `verifiers` environment (Prime Intellect's library) to Echo2 as an `http_env` environment.

    pip install 'verifiers>=0.3,<0.4' <your environment package>      # its own venv: scripts/setup_verifiers_venv.sh
    python -m learner.verifiers_host --env-id my_env --export-prompts prompts.jsonl   # the job's dataset
    python -m learner.verifiers_host --env-id my_env --port 8765                      # then serve it

and create a job with task `http_env`, `url` http://host:8765/step, the exported prompts as its dataset,
and `max_turns` the environment's. Why a process of its own: a verifiers `Environment` installs
SIGINT/SIGTERM handlers when it is built (so it cannot be built in a request thread of the control
plane, and would replace the server's own), its methods are async, and it is the user's code with
its own 700 MB of dependencies (openai, datasets, ...). This module imports only the standard library
and verifiers; it runs from a checkout with `python -m`, in the environment's venv.

Each request {prompt, reference, actions} rebuilds the episode from the dataset row named by
`reference` (its index), replays the earlier actions and plays the last one, through the hooks
`MultiTurnEnv.rollout` itself calls (add_model_response, is_completed, get_prompt_messages, which runs
`env_response`; at the end cleanup and the rubric's score_rollout). So the environment must be a
deterministic function of its row and the actions, as every Echo2 environment (tasks/base.py).
The model call is Echo2's workers'; verifiers' own model client is never used.

What works: the classic API of verifiers 0.3 (0.4 dropped it for `verifiers.v1`, where an environment
calls the model itself), a text `MultiTurnEnv` or `SingleTurnEnv` whose rubric scores one rollout at
a time. Refused at start, with the reason: tool environments (ToolEnv and its kind need the model's
tool calls parsed from its text), sandbox environments (a replay would create a new sandbox each
turn) and rubrics with group reward functions (Echo2 scores an episode on its own).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

log = logging.getLogger("echo2.verifiers_host")
REFUSED = ("ToolEnv", "StatefulToolEnv", "MCPEnv", "SandboxEnv", "PythonEnv", "CliAgentEnv", "EnvGroup")
MAX_BODY = 1 << 20


class Episode:
    """One episode of `env` on dataset row `row`, driven turn by turn from outside its rollout loop."""

    def __init__(self, env: Any, row: dict[str, Any]) -> None:
        self.env, self.row = env, row

    async def reset(self) -> None:
        from verifiers.legacy.clients import OpenAIChatCompletionsClient

        r = self.row
        start = {"prompt": r["prompt"], "example_id": r["example_id"], "answer": r.get("answer", ""),
                 "info": r.get("info") or {}}
        # init_state wants a client object; nothing calls it, the model's turns come from Echo2's workers.
        self.state = await self.env.init_state(start, client=OpenAIChatCompletionsClient(None), model="echo2")
        self.state = (await self.env.setup_state(self.state)) or self.state
        self.messages = await self.env.get_prompt_messages(self.state)

    async def step(self, text: str) -> tuple[str | None, bool, float | None]:
        """(the environment's reply, done, reward when done) for the model's turn `text`."""
        import verifiers as vf
        from verifiers.legacy.types import Response, ResponseMessage

        env, state, prompt = self.env, self.state, self.messages
        await env.add_model_response(state, prompt, Response(
            id=f"echo2-{len(state['trajectory'])}", created=0, model="echo2",
            message=ResponseMessage(content=text, finish_reason="stop", is_truncated=False)))
        if await env.is_completed(state):
            return None, True, await self._score()
        try:
            self.messages = await env.get_prompt_messages(state)  # runs env_response
        except vf.Error as exc:  # as rollout() treats it: the episode ends in error
            state["error"] = exc
            return None, True, await self._score()
        reply = "\n".join(str(m.content or "") for m in self.messages[len(prompt) + 1:])
        if await env.is_completed(state):  # e.g. the environment's final_env_response
            return None, True, await self._score()
        return reply, False, None

    async def _score(self) -> float:
        await self.env.cleanup(self.state)
        await self.env.rubric.score_rollout(self.state)
        await self.env.rubric.cleanup(self.state)
        return float(self.state["reward"])


class Host:
    def __init__(self, env: Any, rows: list[dict[str, Any]]) -> None:
        self.env, self.rows = env, rows
        self.loop = asyncio.new_event_loop()  # one loop for the environment's whole life, as verifiers expects

    def turn(self, body: dict[str, Any]) -> dict[str, Any]:
        actions = body.get("actions")
        if not isinstance(actions, list) or not actions or not all(isinstance(a, str) for a in actions):
            raise ValueError("`actions` must be a non-empty list of strings")
        row = self.row(body.get("reference"))
        return self.loop.run_until_complete(self._play(row, actions))

    def row(self, reference: Any) -> dict[str, Any]:
        if not isinstance(reference, str) or not reference.isdigit() or int(reference) >= len(self.rows):
            raise ValueError(f"`reference` must be a row index below {len(self.rows)} (--export-prompts writes them)")
        return self.rows[int(reference)]

    async def _play(self, row: dict[str, Any], actions: list[str]) -> dict[str, Any]:
        episode = Episode(self.env, row)
        await episode.reset()
        for turn, action in enumerate(actions):
            reply, done, reward = await episode.step(action)
            if done:
                if turn != len(actions) - 1:
                    raise ValueError(f"the episode ended at turn {turn}, before the last of the {len(actions)} actions")
                return {"done": True, "reward": reward}
        return {"done": False, "observation": reply}


def load(env_id: str, env_args: dict[str, Any]) -> Any:
    import verifiers as vf

    env = vf.load_environment(env_id, **env_args)
    kinds = {cls.__name__ for cls in type(env).__mro__}
    refused = sorted(kinds & set(REFUSED))
    if refused:
        sys.exit(f"{env_id}: a {refused[0]} cannot be served: its turns need tool-call parsing or side effects "
                 "that a replay would repeat (see this module's docstring)")
    grouped = getattr(env.rubric, "has_group_rewards", False)  # a property, or a method in some releases
    if grouped() if callable(grouped) else grouped:
        sys.exit(f"{env_id}: its rubric has group reward functions; Echo2 scores each episode on its own")
    return env


def prompts(env: Any) -> list[dict[str, Any]]:
    """The environment's dataset rows as Echo2 prompt items: the last user message, and the row's index."""
    rows = [dict(r) for r in env.get_dataset()]
    items = []
    for i, row in enumerate(rows):
        users = [m for m in row["prompt"] if _role(m) == "user"]
        items.append({"prompt": str(_content(users[-1])), "reference": str(i)})
    return items


def _role(message: Any) -> str:
    return message["role"] if isinstance(message, dict) else message.role


def _content(message: Any) -> Any:
    return message["content"] if isinstance(message, dict) else message.content


def serve(host: Host, address: str, port: int) -> None:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                return self._send(413, {"detail": f"a request of {length} bytes, more than {MAX_BODY}"})
            try:
                self._send(200, host.turn(json.loads(self.rfile.read(length))))
            except (ValueError, KeyError) as exc:
                self._send(422, {"detail": str(exc)})

        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug(fmt, *args)

    # One request at a time: the environment and its event loop are not shared between threads.
    server = HTTPServer((address, port), Handler)
    log.info("serving %d rows on http://%s:%d/step", len(host.rows), address, server.server_address[1])
    sys.stdout.write(f"listening on {server.server_address[1]}\n")  # for whoever started it with --port 0
    sys.stdout.flush()
    server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m learner.verifiers_host", description=__doc__.split("\n\n")[0])
    p.add_argument("--env-id", required=True, help="an installed verifiers environment (vf.load_environment)")
    p.add_argument("--env-args", default="{}", help="JSON keyword arguments for its load_environment")
    p.add_argument("--export-prompts", help="write the dataset as Echo2 prompt items (JSONL) and exit")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8765, help="0 picks a free port (printed)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    env = load(args.env_id, json.loads(args.env_args))
    if args.export_prompts:
        with open(args.export_prompts, "w") as out:
            out.writelines(json.dumps(item) + "\n" for item in prompts(env))
        return
    serve(Host(env, [dict(r) for r in env.get_dataset()]), args.host, args.port)


if __name__ == "__main__":
    main()
