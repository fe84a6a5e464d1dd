"""Data in, as a user brings it, through the CLI against the whole platform: a chat-format dataset (a system turn
and the user's) and a Parquet dataset train jobs; a 100 MB JSONL file goes up in parts with a progress bar, and
an upload cut short resumes with the parts the control plane lacks."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

import httpx
import pytest
from sqlalchemy import select
from transformers import AutoTokenizer

from api.db import Database
from api.models import Prompt, Rollout
from api.settings import Settings
from learner.tiny import build_tiny_model
from server.local import free_port
from server.stack import Stack

pytestmark = pytest.mark.e2e
MB = 2**20


def cli(stack: Stack, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ECHO2_BASE_URL": stack.url, "ECHO2_API_KEY": stack.admin_key}
    done = subprocess.run([sys.executable, "-m", "echo2.cli", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def dataset_id(out: str) -> str:
    found = re.search(r"uploaded dataset (ds_[0-9a-f]+)", out)
    assert found, out
    return found.group(1)


def test_chat_and_parquet_datasets_train_through_the_cli_and_a_100_mb_upload_goes_in_parts(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    chat = tmp_path / "chat.jsonl"
    system = {"role": "system", "content": "You answer with the letter e."}
    chat.write_text("".join(json.dumps({"messages": [system, {"role": "user", "content": f"say {i}"}]}) + "\n"
                            for i in range(30)))
    parquet = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"prompt": [f"say {i}" for i in range(30)], "level": list(range(30))}), parquet)
    big = tmp_path / "big.jsonl"
    line = json.dumps({"prompt": "p" * 10_000, "reference": "e"}) + "\n"
    big.write_text(line * (100 * MB // len(line) + 1))
    assert big.stat().st_size >= 100 * MB

    stack = Stack(Settings(data_dir=tmp_path / ".echo2", port=free_port(), log_level="WARNING"), workers=1).start()
    try:
        chat_ds = dataset_id(cli(stack, "datasets", "upload", "chat", str(chat)).stdout)
        parquet_ds = dataset_id(cli(stack, "datasets", "upload", "plain", str(parquet)).stdout)
        jobs = []
        for ds in (chat_ds, parquet_ds):
            submitted = cli(stack, "jobs", "submit", "--model", "echo2:tiny", "--task", "regex", "--param",
                            "pattern=e", "--dataset", ds, "--steps", "2", "--staleness", "1", "--group-size", "2",
                            "--prompts-per-step", "4", "--max-new-tokens", "4", "--set", "eval.size=0").stdout
            jobs.append(re.search(r"submitted job (job_[0-9a-f]+)", submitted).group(1))
        for job in jobs:
            watched = cli(stack, "jobs", "watch", job, "--interval", "1", "--timeout", "600")
            assert f"job {job} succeeded" in watched.stdout, watched.stdout

        # An upload cut short after three parts: the CLI sends the rest, its progress starting past them.
        data = big.read_bytes()
        admin = httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {stack.admin_key}"}, timeout=120)
        upload = admin.post("/v1/datasets/uploads", json={"name": "big", "size": len(data),
                                                          "sha256": hashlib.sha256(data).hexdigest()}).json()
        size = upload["part_size"]
        for index in range(3):
            part = data[index * size:(index + 1) * size]
            assert admin.put(f"/v1/datasets/uploads/{upload['id']}/parts/{index}", content=part,
                             headers={"Content-Type": "application/octet-stream",
                                      "X-Echo2-Sha256": hashlib.sha256(part).hexdigest()}).status_code == 204
        uploaded = cli(stack, "datasets", "upload", "big", str(big))
        big_ds = admin.get(f"/v1/datasets/{dataset_id(uploaded.stdout)}").json()
        admin.close()
    finally:
        stack.stop()

    assert big_ds["num_items"] == data.count(b"\n")
    bars = [b for b in uploaded.stderr.splitlines() if b.startswith("uploading big [")]
    shown = [float(re.search(r"([\d.]+)/([\d.]+) MiB", b).group(1)) for b in bars]
    assert len(bars) >= 8 and shown[0] >= 24 and shown[-1] == pytest.approx(len(data) / MB, abs=0.1), bars
    assert bars[-1].split("] ")[1].startswith("100%")

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "tiny", seed=0))
    from echo2.prompting import encode_prompt

    with Database(f"sqlite:///{tmp_path / '.echo2' / 'echo2.db'}").session() as s:
        for job, chat_job in zip(jobs, (True, False), strict=True):
            trained = list(s.scalars(select(Rollout).where(Rollout.job_id == job, Rollout.status == "trained")))
            assert trained
            for r in trained:
                prompt = s.get(Prompt, r.prompt_id)
                assert (prompt.context == [system]) is chat_job
                assert r.prompt_token_ids == encode_prompt(tokenizer, prompt.text, prompt.context)
