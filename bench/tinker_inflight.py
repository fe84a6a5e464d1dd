"""In-flight sampling through Echo2's Tinker API: samples whose tokens span two (or more) checkpoints.

    python bench/tinker_inflight.py                  # echo2:tiny, 90 s of sampling while training, one worker

`echo2-server up`'s stack (server/stack.py: API, scheduler, a Tinker learner host, `--workers` local rollout
workers) and the unmodified `tinker` SDK from .venv-tinker: a LoRA training client opens an in-flight sampling
client (`save_weights_and_get_sampling_client(kind="inflight")`) and keeps sampling long completions from it
while, beside it, it trains a step and saves in flight again about every second. The model's fleet job has
partial rollouts: a worker that holds a newer version continues its samples on it between segments, and the
learner host, for what it samples itself, runs the model's training between an in-flight sample's segments.
Every sequence is looked up afterwards in `GET /v1/tinker/sequences/{id}` (the SDK's answer names no
checkpoint): who drew it, and the checkpoints of its tokens.
Reported: sequences drawn by workers and by the host, how many of each span two or more checkpoints, the fleet
groups by status (trained, or rejected and why), and the host's audits of fleet groups (in-flight groups are
audited token by token under each token's version).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TINKER_PYTHON = Path(os.environ.get("TINKER_PYTHON", REPO / ".venv-tinker" / "bin" / "python"))

FLOW = r'''
import json, os, sys, threading, time
import httpx, tinker
from tinker import types

seconds, max_tokens = float(sys.argv[1]), int(sys.argv[2])
key = os.environ["TINKER_API_KEY"].removeprefix("tml-")
service = tinker.ServiceClient()
training = service.create_lora_training_client(base_model="echo2:tiny", rank=4, seed=0).result()
tok = training.get_tokenizer()
prompt = tok.encode("12+34=")
tokens = prompt + tok.encode("46")
datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
sampler = training.save_weights_and_get_sampling_client(kind="inflight").result()
stop, saves = threading.Event(), [0]

def train():
    while not stop.is_set():
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=0.01)).result()
        training.save_weights_and_get_sampling_client(kind="inflight").result()
        saves[0] += 1
        time.sleep(1.0)

trainer = threading.Thread(target=train, daemon=True)
trainer.start()
ids, end = [], time.monotonic() + seconds
params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=[])
while time.monotonic() < end:
    futures = [sampler.sample(types.ModelInput.from_ints(prompt), 4, params) for _ in range(4)]
    ids += [s.sequence_id for f in futures for s in f.result().sequences]
stop.set()
trainer.join()
with httpx.Client(base_url=os.environ["TINKER_BASE_URL"], headers={"Authorization": f"Bearer {key}"}) as http:
    seqs = [http.get(f"/v1/tinker/sequences/{i}").json() for i in ids]
service.close("success").result()
print(json.dumps({"model_id": training.model_id, "saves": saves[0], "sequences": [
    {"by": s["drawn_by"], "runs": [[c["checkpoint"], c["tokens"]] for c in s["checkpoints"] or []]} for s in seqs]}))
'''


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=90.0, help="how long the SDK samples while it trains")
    p.add_argument("--max-tokens", type=int, default=256, help="per sample (segments of max(16, max/8) tokens)")
    p.add_argument("--workers", type=int, default=1)
    args = p.parse_args()
    from api.settings import Settings
    from server.local import free_port
    from server.stack import Stack, exit_on_sigterm

    work = Path(tempfile.mkdtemp(prefix="echo2-inflight-"))
    exit_on_sigterm()
    settings = Settings(data_dir=work / ".echo2", port=free_port())
    stack = Stack(settings, workers=args.workers, tinker_slots=1).start()
    try:
        seen = _flow(stack, args, work)
    finally:
        stack.stop()
    _report(seen, settings.database_url)


def _flow(stack, args: argparse.Namespace, work: Path) -> dict:  # type: ignore[no-untyped-def]
    env = {**os.environ, "TINKER_BASE_URL": stack.url, "TINKER_API_KEY": f"tml-{stack.admin_key}",
           "HOME": str(work)}
    out, err = work / "flow.out", work / "flow.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen([str(TINKER_PYTHON), "-c", FLOW, str(args.seconds), str(args.max_tokens)], env=env,
                                stdout=stdout, stderr=stderr)
        while proc.poll() is None:
            stack.supervise()
            time.sleep(1)
    if proc.returncode != 0:
        sys.exit(f"the SDK flow failed:\n{err.read_text()[-4000:]}")
    return json.loads(out.read_text().strip().splitlines()[-1])


def _report(seen: dict, database_url: str) -> None:
    from sqlalchemy import func, select

    from api.db import Database
    from api.models import Audit, Rollout

    seqs = seen["sequences"]
    print(f"{seen['saves']} in-flight saves while sampling; {len(seqs)} sequences")
    for who in ("worker", "learner host"):
        mine = [s for s in seqs if s["by"].startswith(who)]
        spanning = [s for s in mine if len({name for name, _ in s["runs"]}) >= 2]
        print(f"drawn by {who}: {len(mine)}, of which {len(spanning)} span two or more checkpoints"
              + (f" (e.g. {spanning[0]['runs']})" if spanning else ""))
    with Database(database_url).session() as db:
        audits = db.execute(select(Audit.passed, func.count()).group_by(Audit.passed)).all()
        groups = db.execute(select(Rollout.status, Rollout.reject_kind, func.count())
                            .group_by(Rollout.status, Rollout.reject_kind)).all()
    print(f"audits of fleet groups by the learner host: {dict((bool(k), n) for k, n in audits)}")
    print("fleet groups: " + ", ".join(f"{n} {status}" + (f" ({kind})" if kind else "") for status, kind, n in groups))


if __name__ == "__main__":
    main()
