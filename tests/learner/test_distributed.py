"""The multi-process learner (learner.gpus > 1): FSDP over 2 gloo CPU processes.

First the proof that sharding is correct: one `grpo_update` on 2 ranks (FSDP2, each rank on its
share of the rows) leaves the same parameters and reports the same stats as one process on the
whole batch. SGD rather than AdamW, so that a wrong gradient scale cannot hide behind Adam's
normalised first step. Then the real launch path (`learner.launch.run_job`, as the learner host
runs it): torchrun with 2 processes against a live control plane fed by real rollouts.
"""

from __future__ import annotations

import copy
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from echo2.loading import load_causal_lm

from learner.objective import ObjectiveConfig
from learner.policy import Rollouts, grpo_update, sample
from server.local import free_port

CFG = ObjectiveConfig(eps_low=0.1, eps_high=0.2, ratio_cap=2.0, kl_coef=0.05, length_norm="token_mean", max_len=8)


def rollouts(tiny) -> Rollouts:
    """4 groups of 3 samples from the tiny model; behaviour logprobs perturbed so that ratios clip and
    cap; group 3's rewards are all equal (dropped)."""
    model, tok = tiny
    prompts = [tok(f"{a}+{b}=")["input_ids"] for a, b in ((1, 2), (30, 4), (5, 67), (8, 9))]
    ids = [p for p in prompts for _ in range(3)]
    out = sample(model, ids, max_new_tokens=8, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, seed=0)
    noise = torch.Generator().manual_seed(1)
    behaviour = [[lp + 0.5 * float(torch.randn(1, generator=noise)) for lp in s.logprobs] for s in out]
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    return Rollouts(ids, [s.completion_ids for s in out], behaviour, rewards, [i // 3 for i in range(12)],
                    [i % 2 for i in range(12)])


def update(model, batch: Rollouts, pad_id: int, world=None, dtype=torch.float32):
    ref = copy.deepcopy(model).eval()
    model = world.wrap(model, dtype) if world else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    # 40 tokens per micro-batch: several micro-batches, some with an odd number of rows
    return grpo_update(model, optimizer, batch, CFG, max_tokens_per_micro_batch=40, grad_clip=None,
                       ref_model=ref, pad_id=pad_id, world=world)


def _rank(rank: int, port: int, tiny_dir: str, batch: Rollouts, pad_id: int, out: str,
          dtype: torch.dtype = torch.float32) -> None:

    from learner.parallel import Sharded

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    world = Sharded(local_rank=rank)
    model = load_causal_lm(tiny_dir, dtype=torch.float32)
    stats = update(model, batch, pad_id, world, dtype)
    if rank:  # as launch.follow does: rank 0 announces the gather
        assert world.receive()[0] == "model_state"
    state = world.model_state(model)
    if rank == 0:
        torch.save({"stats": stats, "state": state}, out)
    world.close()


def test_sharded_update_equals_single_process(tiny, tiny_dir, tmp_path):

    _, tok = tiny
    batch = rollouts(tiny)
    torch.multiprocessing.spawn(_rank, args=(free_port(), str(tiny_dir), batch, tok.pad_token_id,
                                             str(tmp_path / "sharded.pt")), nprocs=2, join=True)
    sharded = torch.load(tmp_path / "sharded.pt")
    single = load_causal_lm(tiny_dir, dtype=torch.float32)
    initial = {k: v.clone() for k, v in single.state_dict().items()}
    stats = update(single, batch, tok.pad_token_id)

    assert stats["dropped_groups"] == 1 and stats["clip_frac"] > 0, stats
    for key in ("loss", "tokens", "clip_frac", "cap_frac", "ratio_mean", "kl", "grad_norm", "kept_samples"):
        assert sharded["stats"][key] == pytest.approx(stats[key], rel=1e-5, abs=1e-7), key
    state = single.state_dict()
    assert set(sharded["state"]) <= set(state)
    moved = 0
    for name, value in sharded["state"].items():
        torch.testing.assert_close(value, state[name], rtol=1e-5, atol=1e-6, msg=name)
        moved += not torch.equal(value, initial[name])
    assert moved > len(state) // 2, "the update changed almost nothing: the comparison would prove little"


def test_sharded_bf16_versions_compute_in_bf16_on_float32_masters(tiny, tiny_dir, tmp_path):
    """With bf16 versions, FSDP gathers the float32 master shards cast to bf16 (the published weights) and
    computes on them; the gathered state stays float32 masters, moved by the step. The update is close to
    the single process's on the same rounded weights (bf16 arithmetic: not equal)."""

    from learner.rounding import Rounder

    _, tok = tiny
    batch = rollouts(tiny)
    torch.multiprocessing.spawn(_rank, args=(free_port(), str(tiny_dir), batch, tok.pad_token_id,
                                             str(tmp_path / "sharded.pt"), torch.bfloat16), nprocs=2, join=True)
    sharded = torch.load(tmp_path / "sharded.pt")
    single = load_causal_lm(tiny_dir, dtype=torch.float32)
    initial = {k: v.clone() for k, v in single.state_dict().items()}
    rounder = Rounder(single, torch.bfloat16)
    ref = copy.deepcopy(single).eval()
    stats = grpo_update(single, torch.optim.SGD(single.parameters(), lr=0.5), batch, CFG,
                        max_tokens_per_micro_batch=40, grad_clip=None, ref_model=ref, pad_id=tok.pad_token_id,
                        computing=rounder.computing)
    assert all(v.dtype == torch.float32 for v in sharded["state"].values())
    assert sum(not torch.equal(v, initial[k]) for k, v in sharded["state"].items()) > len(initial) // 2
    assert sharded["stats"]["loss"] == pytest.approx(stats["loss"], rel=0.05, abs=1e-3)
    assert sharded["stats"]["tokens"] == stats["tokens"]


def torchrun_pid() -> int | None:
    """The torchrun agent started by this test process (run_job's child), once it runs."""
    for task in Path("/proc/self/task").iterdir():
        for pid in (task / "children").read_text().split():
            if b"torch.distributed.run" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return int(pid)
    return None


def wait_for(predicate, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_two_process_learner_over_http(api, tmp_path, capsys):
    """Train with 2 ranks; stop the group (SIGTERM to torchrun) after the step-4 checkpoint; a second
    run_job resumes from it on 2 ranks (sharded weights and optimiser state restored) and finishes."""
    from echo2.protocol import Manifest
    from echo2.snapshots import assemble
    from safetensors.torch import load_file

    from learner.launch import run_job
    from learner.loop import LearnerOptions
    from server.demo import demo_spec
    from tests.factories import activate, learner_for, new_provider, new_user, new_worker, ok
    from tests.rollout_driver import RolloutDriver

    _, alice = new_user(api)
    spec = {**demo_spec("tiny", 8, 1), "checkpoint_every": 4, "learner": {"gpus": 2}}
    jid = ok(alice.post("/v1/jobs", json=spec), 201)["id"]
    token = learner_for(api, jid).headers["Authorization"].split()[1]
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, jid)
    driver = RolloutDriver(api.url, wid, worker.headers["Authorization"].split()[1], tmp_path / "w").start()
    work = tmp_path / "learner"
    options = LearnerOptions(work_dir=work, heartbeat_s=0.5, threads=1)
    failures: list[BaseException] = []
    first = threading.Thread(target=lambda: _catch(failures, run_job, api.url, token, jid, options))
    try:
        first.start()
        wait_for(lambda: ok(alice.get(f"/v1/jobs/{jid}"))["step"] >= 5)
        os.kill(torchrun_pid(), signal.SIGTERM)
        first.join(timeout=60)
        assert failures and "torchrun exited" in str(failures[0]), failures
        run_job(api.url, token, jid, options)
    finally:
        driver.stop()

    err = capsys.readouterr().err
    assert err.count("FSDP learner over 2 processes") == 2 and "resumed from checkpoint at step 4" in err
    job = ok(alice.get(f"/v1/jobs/{jid}"))
    assert job["status"] == "succeeded" and job["step"] == 8, job
    metrics = ok(alice.get(f"/v1/jobs/{jid}/metrics"))
    assert [m["step"] for m in metrics] == list(range(8)) and all(m["tokens"] > 0 for m in metrics), metrics
    versions = [v["version"] for v in ok(alice.get(f"/v1/jobs/{jid}/versions"))]
    assert versions[0] == 0 and versions[-1] == 8 and versions == sorted(set(versions)), versions
    trained, offset = [], 0
    while offset is not None:
        page = ok(alice.get(f"/v1/jobs/{jid}/rollouts", params={"status": "trained", "limit": 200, "offset": offset}))
        trained, offset = trained + page["items"], page["next_offset"]
    assert len(trained) == len({r["id"] for r in trained}) == 8 * spec["grpo"]["prompts_per_step"]

    manifest = Manifest.model_validate(ok(alice.get(f"/v1/jobs/{jid}/versions/8/manifest")))
    folder = assemble(manifest, lambda i: alice.get(f"/v1/jobs/{jid}/versions/8/chunks/{i}").content, tmp_path / "v8")
    published = load_causal_lm(folder, dtype=torch.float32).state_dict()
    initial = load_causal_lm(work / "models" / "tiny-seed0", dtype=torch.float32).state_dict()
    checkpointed = load_file(work / jid / "checkpoints" / "ckpt-8" / "model.safetensors")
    assert published.keys() == initial.keys()
    assert any(not torch.equal(published[k], initial[k]) for k in published), "8 steps changed no weight"
    for name, value in checkpointed.items():  # both gathered by rank 0 from the shards after step 8
        torch.testing.assert_close(published[name], value, rtol=0, atol=0, msg=name)


def _catch(failures: list[BaseException], fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as exc:  # the test asserts on it
        failures.append(exc)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_failing_rank_fails_the_run(api, tmp_path):
    """Rank 0 cannot load the model while rank 1 waits for it: torchrun ends both, run_job says why."""
    from learner.launch import run_job
    from learner.loop import LearnerOptions
    from server.demo import demo_spec
    from tests.factories import learner_for, new_user, ok

    _, alice = new_user(api)
    broken = tmp_path / "broken"  # a model folder (the control plane accepts it) no library can load
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-model"}')
    spec = {**demo_spec("tiny", 2, 1), "base_model": str(broken), "learner": {"gpus": 2}}
    jid = ok(alice.post("/v1/jobs", json=spec), 201)["id"]
    token = learner_for(api, jid).headers["Authorization"].split()[1]
    with pytest.raises(RuntimeError, match="torchrun exited with 1") as failure:
        run_job(api.url, token, jid, LearnerOptions(work_dir=tmp_path / "learner", threads=1))
    assert "tokenizer" in str(failure.value)  # the failing rank's own error, from the end of its log


# ---------------------------------------------------------------- held-out evaluation and LoRA under FSDP

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def eval_setup(tiny_dir: Path):
    """A spec and 40 held-out prompts (two batches of unequal size: rank 1 finishes its generation first)
    whose regex rewards vary from prompt to prompt, so that a mixed-up or lost answer shows."""
    from echo2.protocol import EvalPrompt, JobSpec

    spec = JobSpec.model_validate({"name": "eval", "base_model": str(tiny_dir), "task": {"name": "regex"},
                                   "grpo": {"max_new_tokens": 8}, "seed": 7})
    prompts = [EvalPrompt(id=i, text=f"{i}+{i % 7}=", reference="0123456789 abc"[i % 14]) for i in range(40)]
    return spec, prompts


def _eval_rank(rank: int, port: int, tiny_dir: str, work: str, device: str = "cpu", size: int = 2) -> None:
    """Rank 0 runs the learner's side (start, build, evaluate, stop); the others the real follower
    (launch.follow)."""
    from learner.evaluate import Evaluator
    from learner.launch import follow
    from learner.loop import LearnerOptions, build_trainer
    from learner.parallel import Sharded

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size))
    world = Sharded(local_rank=rank)
    options = LearnerOptions(work_dir=Path(work) / f"rank{rank}", device=device, threads=1)
    if rank:
        follow(world, options, "job")
    else:
        spec, prompts = eval_setup(Path(tiny_dir))
        world.announce("start", (spec, tiny_dir))
        trainer, _ = build_trainer(spec, tiny_dir, options, world, Path(work) / "ckpt")
        report = Evaluator(spec, prompts, trainer.model, trainer.tokenizer, trainer.pad_id, world).run(3, 3)
        world.announce("stop")
        torch.save(report.model_dump(), Path(work) / "report.pt")
    import gc

    gc.collect()
    world.close()


def test_sharded_evaluation_equals_single_process(tiny_dir, tmp_path):
    """Held-out evaluation under FSDP: each rank generates its batches on the sharded model (ranks in
    lockstep), rank 0 gathers the rewards; the report is the single-process one."""
    from learner.evaluate import Evaluator
    from learner.loop import LearnerOptions, build_trainer
    from learner.parallel import Solo

    torch.multiprocessing.spawn(_eval_rank, args=(free_port(), str(tiny_dir), str(tmp_path)), nprocs=2, join=True)
    sharded = torch.load(tmp_path / "report.pt")
    spec, prompts = eval_setup(tiny_dir)
    trainer, _ = build_trainer(spec, str(tiny_dir), LearnerOptions(work_dir=tmp_path / "solo"), Solo(),
                               tmp_path / "solo-ckpt")
    single = Evaluator(spec, prompts, trainer.model, trainer.tokenizer, trainer.pad_id).run(3, 3)
    assert 0 < single.greedy_accuracy < 1 and 0 < single.sampled_accuracy < 1, single  # a comparison that can fail
    for key in ("prompts", "greedy_accuracy", "sampled_accuracy", "sampled_reward_mean"):
        assert sharded[key] == getattr(single, key), key


def lora_model(tiny_dir: str):
    from echo2.protocol import LoraConfig

    from learner.models import with_adapter

    model = load_causal_lm(tiny_dir, dtype=torch.float32)
    torch.manual_seed(0)  # the adapter's initial A: the same on every rank and in the single process
    return with_adapter(model, LoraConfig(**LORA))


def _lora_rank(rank: int, port: int, tiny_dir: str, batch: Rollouts, pad_id: int, work: str) -> None:
    from echo2.protocol import LoraConfig
    from transformers import AutoTokenizer

    from learner.parallel import Sharded
    from learner.sharded_lora import ShardedLoraWeights
    from learner.weights import Role

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    world = Sharded(local_rank=rank)
    model = lora_model(tiny_dir)
    stats = update(model, batch, pad_id, world)
    if rank:  # as launch.follow does: rank 0 announces the gather
        assert world.receive()[0] == "trainable_state"
        world.trainable_state(model)
    else:
        weights = ShardedLoraWeights(model, AutoTokenizer.from_pretrained(tiny_dir), torch.float32, world, tiny_dir,
                                     LoraConfig(**LORA))
        state = weights.snapshot()
        for role in Role:
            weights.write(state, Path(work) / role.value, role)
        torch.save({"stats": stats, "state": state}, Path(work) / "lora.pt")
    world.close()


def test_sharded_lora_trains_and_publishes_what_a_single_process_does(tiny, tiny_dir, tmp_path):
    """LoRA under FSDP: one update on 2 ranks moves the adapter as one process does; its versions (the base,
    the adapter, the merged model with the adapter) are the single-process LoraWeights' files."""
    from safetensors.torch import load_file

    from learner.weights import LoraWeights, Role

    model, tok = tiny
    batch = rollouts(tiny)
    torch.multiprocessing.spawn(_lora_rank, args=(free_port(), str(tiny_dir), batch, tok.pad_token_id,
                                                  str(tmp_path / "sharded")), nprocs=2, join=True)
    sharded = torch.load(tmp_path / "sharded" / "lora.pt")
    single = lora_model(str(tiny_dir))
    stats = update(single, batch, tok.pad_token_id)
    for key in ("loss", "tokens", "kl", "grad_norm", "kept_samples"):
        assert sharded["stats"][key] == pytest.approx(stats[key], rel=1e-5, abs=1e-7), key
    weights = LoraWeights(single, tok, torch.float32)
    state = weights.snapshot()
    assert set(sharded["state"]) == set(state) and any("lora_B" in k and v.abs().sum() > 0 for k, v in state.items())
    for name, value in state.items():
        torch.testing.assert_close(sharded["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    for role in Role:
        weights.write(state, tmp_path / "single" / role.value, role)
        files = sorted(p.relative_to(tmp_path / "single" / role.value)
                       for p in (tmp_path / "single" / role.value).rglob("*.safetensors"))
        assert files == sorted(p.relative_to(tmp_path / "sharded" / role.value)
                               for p in (tmp_path / "sharded" / role.value).rglob("*.safetensors"))
        for f in files:
            ours, theirs = (load_file(tmp_path / side / role.value / f) for side in ("sharded", "single"))
            assert ours.keys() == theirs.keys(), (role, f)
            for k in ours:
                torch.testing.assert_close(ours[k], theirs[k], rtol=1e-5, atol=1e-6, msg=f"{role} {f} {k}")


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_two_process_lora_learner_with_evaluation_over_http(api, tmp_path, capsys):
    """The launch path with LoRA and held-out evaluation on 2 ranks: held-out accuracy reported before the
    first step, every 2 steps and after the last; version 0 the base, then adapters, the final one merged.
    (The rollout driver generates from version 0 throughout: S = 3 admits it at every step.)"""
    from learner.launch import run_job
    from learner.loop import LearnerOptions
    from server.demo import demo_spec
    from tests.factories import activate, learner_for, new_provider, new_user, new_worker, ok
    from tests.rollout_driver import RolloutDriver

    _, alice = new_user(api)
    spec = {**demo_spec("tiny", 3, 3), "learner": {"gpus": 2}, "lora": LORA, "eval": {"size": 8, "every": 2}}
    jid = ok(alice.post("/v1/jobs", json=spec), 201)["id"]
    token = learner_for(api, jid).headers["Authorization"].split()[1]
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, jid)
    driver = RolloutDriver(api.url, wid, worker.headers["Authorization"].split()[1], tmp_path / "w", lag=3).start()
    try:
        run_job(api.url, token, jid, LearnerOptions(work_dir=tmp_path / "learner", heartbeat_s=0.5, threads=1))
    finally:
        driver.stop()

    assert "FSDP learner over 2 processes" in capsys.readouterr().err
    job = ok(alice.get(f"/v1/jobs/{jid}"))
    assert job["status"] == "succeeded" and job["step"] == 3, job
    evals = ok(alice.get(f"/v1/jobs/{jid}/evals"))
    assert [e["step"] for e in evals] == [0, 2, 3] and evals[0]["prompts"] > 0, evals
    assert all(e["prompts"] == evals[0]["prompts"] and e["greedy_accuracy"] is not None for e in evals), evals
    versions = ok(alice.get(f"/v1/jobs/{jid}/versions"))
    assert [(v["version"], v["adapter"]) for v in versions] == [(0, False), (1, True), (2, True), (3, False)]
    assert max(v["total_size"] for v in versions[1:3]) < versions[0]["total_size"] / 10, versions
    final = {f["path"] for f in ok(alice.get(f"/v1/jobs/{jid}/versions/3/manifest"))["files"]}
    assert {"model.safetensors", "adapter/adapter_model.safetensors"} <= final, final


# ---------------------------------------------------------------- FSDP on CUDA (skipped without a GPU)


def _cuda_rank(rank: int, size: int, port: int, tiny_dir: str, batch: Rollouts, pad_id: int, out: str) -> None:

    from learner.parallel import Sharded

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size))
    world = Sharded(local_rank=rank)
    model = load_causal_lm(tiny_dir, dtype=torch.float32).to(world.device("cuda"))
    stats = update(model, batch, pad_id, world)
    if rank:
        assert world.receive()[0] == "model_state"
    state = world.model_state(model)
    if rank == 0:
        torch.save({"stats": stats, "state": state}, out)
    world.close()


@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")
def test_fsdp_on_cuda_updates_as_one_gpu_does(tiny, tiny_dir, tmp_path, size):
    """FSDP2 over NCCL (world size 1, and 2 where two GPUs are visible) against one unsharded GPU, both in
    bf16 autocast: the same stats and weights, to bf16 tolerance."""

    if torch.cuda.device_count() < size:
        pytest.skip(f"{size} GPUs needed")
    _, tok = tiny
    batch = rollouts(tiny)
    torch.multiprocessing.spawn(_cuda_rank, args=(size, free_port(), str(tiny_dir), batch, tok.pad_token_id,
                                                  str(tmp_path / "sharded.pt")), nprocs=size, join=True)
    sharded = torch.load(tmp_path / "sharded.pt")
    single = load_causal_lm(tiny_dir, dtype=torch.float32).to("cuda")
    stats = update(single, batch, tok.pad_token_id)
    for key in ("loss", "tokens", "kl", "grad_norm", "kept_samples"):
        assert sharded["stats"][key] == pytest.approx(stats[key], rel=2e-2, abs=1e-4), key
    state = single.state_dict()
    for name, value in sharded["state"].items():
        torch.testing.assert_close(value, state[name].cpu(), rtol=2e-2, atol=1e-3, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")
def test_sharded_evaluation_on_cuda_equals_one_gpu(tiny_dir, tmp_path):
    """Held-out evaluation on FSDP ranks over NCCL (as many as there are GPUs, up to 2) against one
    unsharded GPU."""
    from learner.evaluate import Evaluator
    from learner.loop import LearnerOptions, build_trainer
    from learner.parallel import Solo

    size = min(2, torch.cuda.device_count())
    torch.multiprocessing.spawn(_eval_rank, args=(free_port(), str(tiny_dir), str(tmp_path), "cuda", size),
                                nprocs=size, join=True)
    sharded = torch.load(tmp_path / "report.pt")
    spec, prompts = eval_setup(tiny_dir)
    trainer, _ = build_trainer(spec, str(tiny_dir), LearnerOptions(work_dir=tmp_path / "solo", device="cuda"),
                               Solo(), tmp_path / "solo-ckpt")
    single = Evaluator(spec, prompts, trainer.model, trainer.tokenizer, trainer.pad_id).run(3, 3)
    for key in ("prompts", "greedy_accuracy", "sampled_accuracy", "sampled_reward_mean"):
        assert sharded[key] == getattr(single, key), key
