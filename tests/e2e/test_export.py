"""A trained job's model out of Echo2 as a plain Hugging Face folder, through the whole platform: the folder
`echo2 checkpoints export` writes loads in transformers (and in vLLM) as it is, its greedy answers are the job's
last held-out evaluation's, and a LoRA job's merged export answers as its base with the exported adapter does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from echo2 import Client, errors
from echo2.loading import load_causal_lm
from echo2.prompting import encode_prompt
from echo2.protocol import EvalRead, JobRead, PromptRead
from transformers import AutoTokenizer

from api.settings import Settings
from learner.tiny import build_tiny_model
from server.local import free_port
from server.stack import Stack
from tasks import TaskPrompt, get_task

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("ECHO2_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
GRPO = {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 6}
# A reward some samples of the random tiny model get and others do not: its weights move.
REGEX = {"task": {"name": "regex", "params": {"pattern": "e"}},
         "prompts": [{"item": {"prompt": f"say {i}"}} for i in range(40)]}


@dataclass
class Exported:
    folder: Path
    job: JobRead
    last: EvalRead
    held_out: list[PromptRead]


@dataclass
class Exports:
    full: Exported
    merged: Path
    adapter: Path
    refusal: str


def run_jobs(stack: Stack, specs: list[dict]) -> list[str]:
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
    return ids


def cli(stack: Stack, *args: str) -> str:
    env = {**os.environ, "ECHO2_BASE_URL": stack.url, "ECHO2_API_KEY": stack.admin_key}
    done = subprocess.run([sys.executable, "-m", "echo2.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def export(stack: Stack, job_id: str, out: Path) -> Exported:
    """`echo2 checkpoints export`, with the job's last held-out evaluation and its prompts."""
    assert f"to {out}" in cli(stack, "checkpoints", "export", job_id, "--out", str(out))
    with Client(base_url=stack.url, api_key=stack.admin_key) as client:
        return Exported(out, client.jobs.get(job_id), client.jobs.evals(job_id)[-1],
                        client.jobs.prompts(job_id, held_out=True, limit=200).items)


def start(tmp_path: Path) -> Stack:
    return Stack(Settings(data_dir=tmp_path / ".echo2", port=free_port(), log_level="WARNING"), workers=1).start()


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> Exports:
    """A full fine-tune and a LoRA job on the tiny model, trained two steps each, exported."""
    tmp = tmp_path_factory.mktemp("export")
    full = {"name": "full", "base_model": "echo2:tiny", **REGEX, "max_steps": 2, "staleness": 1,
            "grpo": GRPO | {"lr": 1e-2}, "eval": {"size": 8, "every": 0, "fraction": 0.2}}
    lora = full | {"name": "lora", "lora": {"rank": 4, "alpha": 8}, "grpo": GRPO | {"lr": 5e-2}}
    stack = start(tmp)
    try:
        full_id, lora_id = run_jobs(stack, [full, lora])
        full_export = export(stack, full_id, tmp / "full")
        cli(stack, "checkpoints", "export", lora_id, "--out", str(tmp / "merged"))
        with Client(base_url=stack.url, api_key=stack.admin_key) as client:
            client.checkpoints.export(lora_id, tmp / "adapter", adapter=True)
            with pytest.raises(errors.BadRequestError) as refused:
                client.checkpoints.export(full_id, tmp / "nope", adapter=True)
    finally:
        stack.stop()
    return Exports(full_export, tmp / "merged", tmp / "adapter", str(refused.value))


def greedy(model_dir: Path, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy answers of a folder loaded by transformers alone, one prompt at a time."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_causal_lm(model_dir).eval()
    out = []
    for text in prompts:
        ids = torch.tensor([encode_prompt(tokenizer, text)])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False)
        out.append(tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    return out


def check_answers(e: Exported) -> None:
    """The folder, loaded by transformers, answers the held-out prompts as the job's last evaluation did."""
    names = {p.name for p in e.folder.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= names and "adapter" not in names, names
    assert any(n.endswith(".safetensors") for n in names), names
    assert e.last.step == e.job.step and e.last.greedy_answers is not None and len(e.held_out) == e.last.prompts
    answers = greedy(e.folder, [p.text for p in e.held_out], e.job.spec.grpo.max_new_tokens)
    assert answers == e.last.greedy_answers
    task = get_task(e.job.spec.task.name)
    params = task.parse_params(e.job.spec.task.params)
    right = [task.reward(TaskPrompt(text=p.text, reference=p.reference), a, params) == 1.0
             for p, a in zip(e.held_out, answers, strict=True)]
    assert sum(right) / len(right) == e.last.greedy_accuracy


def test_an_exported_job_loads_in_transformers_and_answers_as_its_last_evaluation(exports):
    check_answers(exports.full)
    assert "trains every weight, not a LoRA adapter" in exports.refusal


def test_a_lora_jobs_merged_export_answers_as_its_base_with_the_exported_adapter(exports, tmp_path):
    from peft import PeftModel

    assert {p.name for p in exports.adapter.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    config = json.loads((exports.adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "echo2:tiny" and config["r"] == 4
    base = build_tiny_model(tmp_path / "base", seed=0)  # what echo2:tiny is for a job of seed 0
    with_adapter = PeftModel.from_pretrained(load_causal_lm(base), exports.adapter).eval()
    plain = load_causal_lm(exports.merged).eval()
    tokenizer = AutoTokenizer.from_pretrained(exports.merged)
    ids = torch.tensor([encode_prompt(tokenizer, "say 3")])
    with torch.no_grad():
        a, b = with_adapter(ids).logits, plain(ids).logits
        unchanged = load_causal_lm(base)(ids).logits
    assert (a - unchanged).abs().max() > 1e-4  # the adapter learnt something
    assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
    mask = torch.ones_like(ids)
    assert with_adapter.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False).tolist() == \
        plain.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False).tolist()


VLLM_GREEDY = """import json, sys
from vllm import LLM, SamplingParams
folder, prompts, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
llm = LLM(model=folder, dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=n))
print("ANSWERS " + json.dumps([o.outputs[0].text for o in outs]))
"""


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"no vLLM venv at {VLLM_PYTHON}: run scripts/setup_vllm_venv.sh")
def test_vllm_loads_an_exported_folder_as_it_is(exports):
    e = exports.full
    tokenizer = AutoTokenizer.from_pretrained(e.folder)
    prompts = [encode_prompt(tokenizer, p.text) for p in e.held_out]
    done = subprocess.run([str(VLLM_PYTHON), "-c", VLLM_GREEDY, str(e.folder), json.dumps(prompts),
                           str(e.job.spec.grpo.max_new_tokens)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("ANSWERS "))
    assert json.loads(line.removeprefix("ANSWERS ")) == e.last.greedy_answers


@pytest.mark.slow
def test_an_exported_smollm2_job_answers_its_held_out_problems_as_its_last_evaluation(tmp_path):
    spec = {"name": "smollm2-export", "base_model": "echo2:smollm2", "task": {"name": "arithmetic",
            "params": {"min_operand": 10, "max_operand": 99, "style": "question"}}, "max_steps": 1, "staleness": 1,
            "weights": {"dtype": "float32"}, "grpo": GRPO | {"max_new_tokens": 8, "lr": 3e-5},
            "eval": {"size": 20, "every": 0}}
    stack = start(tmp_path)
    try:
        (job_id,) = run_jobs(stack, [spec])
        exported = export(stack, job_id, tmp_path / "smollm2")
    finally:
        stack.stop()
    check_answers(exported)
