"""A trained job's model out of Echo2 as a plain Hugging Face folder, through the whole platform: the folder
`echo2 checkpoints export` writes loads in transformers as it is, its greedy answers are the job's last held-out
evaluation's, and a LoRA job's merged export answers as its base with the exported adapter does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from echo2 import Client, errors
from echo2.prompting import encode_prompt
from transformers import AutoModelForCausalLM, AutoTokenizer

from api.settings import Settings
from learner.tasks import TaskPrompt, get_task
from learner.tiny import build_tiny_model
from server.local import free_port
from server.stack import Stack

pytestmark = pytest.mark.e2e
GRPO = {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 6}


def run_jobs(tmp_path: Path, specs: list[dict]) -> tuple[Stack, list[str]]:
    stack = Stack(Settings(data_dir=tmp_path / ".echo2", port=free_port(), log_level="WARNING"), workers=1).start()
    with Client(base_url=stack.url, api_key=stack.admin_key, timeout=60) as client:
        ids = [client.jobs.create(spec).id for spec in specs]
        deadline = time.monotonic() + 1500
        while not all(client.jobs.get(i).status.is_terminal() for i in ids):
            assert time.monotonic() < deadline, "the jobs did not finish"
            stack.supervise()
            time.sleep(1)
        for i in ids:
            job = client.jobs.get(i)
            assert job.status.value == "succeeded", job.status_reason
    return stack, ids


def cli(stack: Stack, *args: str) -> str:
    env = {**os.environ, "ECHO2_BASE_URL": stack.url, "ECHO2_API_KEY": stack.admin_key}
    done = subprocess.run([sys.executable, "-m", "echo2.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def greedy(model_dir: Path, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy answers of a folder loaded by transformers alone, one prompt at a time."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    for text in prompts:
        ids = torch.tensor([encode_prompt(tokenizer, text)])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False)
        out.append(tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    return out


def check_exported_answers(stack: Stack, job_id: str, out: Path) -> None:
    printed = cli(stack, "checkpoints", "export", job_id, "--out", str(out))
    assert f"to {out}" in printed
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= names and "adapter" not in names, names
    assert any(n.endswith(".safetensors") for n in names), names
    with Client(base_url=stack.url, api_key=stack.admin_key) as client:
        job = client.jobs.get(job_id)
        last = client.jobs.evals(job_id)[-1]
        held_out = client.jobs.prompts(job_id, held_out=True, limit=200).items
    assert last.step == job.step and last.greedy_answers is not None and len(held_out) == last.prompts
    answers = greedy(out, [p.text for p in held_out], job.spec.grpo.max_new_tokens)
    assert answers == last.greedy_answers
    task = get_task(job.spec.task.name)
    params = task.parse_params(job.spec.task.params)
    right = [task.reward(TaskPrompt(text=p.text, reference=p.reference), a, params) == 1.0
             for p, a in zip(held_out, answers, strict=True)]
    assert sum(right) / len(right) == last.greedy_accuracy


def test_exported_full_and_lora_jobs_load_in_transformers_and_answer_as_trained(tmp_path):
    # A reward some samples of the random tiny model get and others do not: its weights move.
    full = {"name": "full", "base_model": "echo2:tiny", "task": {"name": "regex", "params": {"pattern": "e"}},
            "prompts": [{"item": {"prompt": f"say {i}"}} for i in range(40)], "max_steps": 2, "staleness": 1,
            "grpo": GRPO | {"lr": 1e-2}, "eval": {"size": 8, "every": 0, "fraction": 0.2}}
    lora = full | {"name": "lora", "lora": {"rank": 4, "alpha": 8}, "grpo": GRPO | {"lr": 5e-2}}
    stack, (full_id, lora_id) = run_jobs(tmp_path, [full, lora])
    try:
        check_exported_answers(stack, full_id, tmp_path / "full")
        merged, adapter = tmp_path / "merged", tmp_path / "adapter"
        cli(stack, "checkpoints", "export", lora_id, "--out", str(merged))
        with Client(base_url=stack.url, api_key=stack.admin_key) as client:
            client.checkpoints.export(lora_id, adapter, adapter=True)
            with pytest.raises(errors.BadRequestError, match="trains every weight, not a LoRA adapter"):
                client.checkpoints.export(full_id, tmp_path / "nope", adapter=True)
    finally:
        stack.stop()
    assert {p.name for p in adapter.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    assert "adapter" not in {p.name for p in merged.iterdir()}
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "echo2:tiny" and config["r"] == 4

    from peft import PeftModel

    base = build_tiny_model(tmp_path / "base", seed=0)  # what echo2:tiny is for a job of seed 0
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    plain = AutoModelForCausalLM.from_pretrained(merged).eval()
    tokenizer = AutoTokenizer.from_pretrained(merged)
    ids = torch.tensor([encode_prompt(tokenizer, "12+30=")])
    with torch.no_grad():
        a, b = with_adapter(ids).logits, plain(ids).logits
        unchanged = AutoModelForCausalLM.from_pretrained(base)(ids).logits
    assert (a - unchanged).abs().max() > 1e-3  # the adapter learnt something
    assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
    gen_a = with_adapter.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    gen_b = plain.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    assert gen_a.tolist() == gen_b.tolist()


@pytest.mark.slow
def test_an_exported_smollm2_job_answers_its_held_out_problems_as_its_last_evaluation(tmp_path):
    spec = {"name": "smollm2-export", "base_model": "echo2:smollm2", "task": {"name": "arithmetic",
            "params": {"min_operand": 10, "max_operand": 99, "style": "question"}}, "max_steps": 1, "staleness": 1,
            "weights": {"dtype": "float32"}, "grpo": GRPO | {"max_new_tokens": 8, "lr": 3e-5},
            "eval": {"size": 20, "every": 0}}
    stack, (job_id,) = run_jobs(tmp_path, [spec])
    try:
        check_exported_answers(stack, job_id, tmp_path / "smollm2")
    finally:
        stack.stop()
