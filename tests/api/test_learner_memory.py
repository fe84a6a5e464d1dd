"""A job's learner memory, estimated at submission from its model's config, against the registered learner
hosts' GPUs: refused with the numbers and what to change when none can hold it, accepted (and said so)
when no learner host with GPUs is registered yet."""

from __future__ import annotations

import json
from pathlib import Path

from echo2.loading import load_causal_lm

from scheduler import hosts
from tests.factories import job_spec, new_job, new_user, ok

QWEN_7B = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
           "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}
QWEN_7B_PARAMS = 7_615_616_512  # Qwen2.5-7B's published parameter count


def qwen_folder(tmp_path: Path) -> str:
    folder = tmp_path / "qwen2.5-7b"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(QWEN_7B))
    return str(folder)


def h100_host(api, gpus: int = 1) -> None:
    found = [{"id": str(i), "name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.1} for i in range(gpus)]
    slots, gpus = hosts.describe(None, found)
    with api.db.session() as s:
        hosts.register(s, "h100-host", slots, gpus=gpus)
        s.commit()


def test_a_job_no_learner_host_can_hold_is_refused_with_the_numbers(api, tmp_path):
    _, alice = new_user(api)
    h100_host(api)
    full = job_spec(base_model=qwen_folder(tmp_path), learner={"gpus": 1})
    gib = QWEN_7B_PARAMS * 4 / 2**30
    for route in ("/v1/jobs", "/v1/jobs:estimate"):
        r = alice.post(route, json=full)
        assert r.status_code == 422, r.text
        detail = r.json()["detail"]
        assert r.json()["errors"][0]["field"] == "learner"
        assert detail.startswith("this job needs about ") and "on each of its 1 learner GPU(s) (full fine-tuning of " \
            "7.62B parameters: " in detail, detail
        assert f"weights {gib:.2f} + gradients {gib:.2f} + AdamW {2 * gib:.2f}" in detail, detail
        assert "the largest registered learner host's GPUs hold 79.1 GiB" in detail
        assert detail.endswith("To change: train a LoRA adapter (lora: {}): about 155.39 GiB a GPU (still too big); "
                               "learner.activation_checkpointing: true: about 132.56 GiB a GPU (still too big); "
                               "grpo.micro_batch_tokens: 4096: about 145.94 GiB a GPU (still too big); together, "
                               "train a LoRA adapter (lora: {}) and learner.activation_checkpointing: true: about "
                               "47.61 GiB a GPU (fits)"), detail
    assert ok(alice.get("/v1/jobs"))["total"] == 0

    lora = {**full, "lora": {"rank": 16}, "learner": {"gpus": 1, "activation_checkpointing": True}}
    estimate = ok(alice.post("/v1/jobs:estimate", json=lora))["learner_memory"]
    assert estimate["fits"] is True and estimate["largest_gpu_gib"] == 79.1 and estimate["params"] == QWEN_7B_PARAMS
    assert estimate["gradients_gib"] < 0.1 and estimate["weights_gib"] == round(gib + estimate["gradients_gib"], 2)
    parts = [estimate[k] for k in ("weights_gib", "gradients_gib", "optimizer_gib", "reference_gib", "gathered_gib",
                                   "activations_gib", "runtime_gib")]
    assert abs(sum(parts) - estimate["per_gpu_gib"]) < 0.05
    job = ok(alice.post("/v1/jobs", json=lora), 201)
    assert job["learner_memory_gib"] == estimate["per_gpu_gib"]


def test_a_job_that_fits_only_over_more_gpus_is_told_how_many(api, tmp_path):
    _, alice = new_user(api)
    h100_host(api, gpus=4)
    spec = job_spec(base_model=qwen_folder(tmp_path), learner={"gpus": 1, "activation_checkpointing": True},
                    grpo={"group_size": 2, "prompts_per_step": 4, "micro_batch_tokens": 8192})
    r = alice.post("/v1/jobs", json=spec)
    assert r.status_code == 422 and "shard it over more GPUs (learner.gpus: 2): about " in r.text, r.text
    spec["learner"]["gpus"] = 2
    job = ok(alice.post("/v1/jobs", json=spec), 201)
    assert 60 < job["learner_memory_gib"] < 79.1  # half the states each, plus the reference-free rest
    spec["learner"]["gpus"] = 8
    r = alice.post("/v1/jobs", json=spec)
    assert r.status_code == 422 and r.json()["detail"] == ("learner.gpus 8: no registered learner host has 8 GPUs "
                                                           "(the most on one host: 4); ask for at most 4")


def test_without_a_gpu_learner_host_registered_the_job_is_accepted_and_told_so(api, tmp_path):
    _, alice = new_user(api)
    spec = job_spec(base_model=qwen_folder(tmp_path), learner={"gpus": 1})
    estimate = ok(alice.post("/v1/jobs:estimate", json=spec))
    assert estimate["learner_memory"]["fits"] is None and estimate["learner_memory"]["per_gpu_gib"] > 200
    assert any("no learner host with GPUs is registered yet" in a for a in estimate["assumptions"])
    job = ok(alice.post("/v1/jobs", json=spec), 201)
    assert job["learner_memory_gib"] == estimate["learner_memory"]["per_gpu_gib"]


def test_a_cpu_learner_is_not_held_to_the_gpus(api, tmp_path):
    _, alice = new_user(api)
    h100_host(api)
    new_job(alice, base_model=qwen_folder(tmp_path), learner={"gpus": 0, "device": "cpu"})


def test_parameters_are_counted_in_the_safetensors_files_when_at_hand(api, tiny_model_dir):

    _, alice = new_user(api)
    memory = ok(alice.post("/v1/jobs:estimate", json=job_spec(base_model=str(tiny_model_dir))))["learner_memory"]
    assert memory["params"] == load_causal_lm(tiny_model_dir).num_parameters()
    assert "parameters counted in its safetensors files" in memory["source"]
    builtin = ok(alice.post("/v1/jobs:estimate", json=job_spec()))["learner_memory"]
    assert builtin["params"] == memory["params"] and "the built-in echo2:tiny" in builtin["source"]
