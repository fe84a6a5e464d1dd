"""Does publishing weight versions stall training? Learner step time with publishing on vs off.

    python bench/publish_overlap.py                      # 16 then 64 prompts/step, 20 steps per mode
    python bench/publish_overlap.py --prompts 16 --nice 0 10 --steps 20 --block 5
    python bench/publish_overlap.py --pin                # training on CPU 0, I/O on the others

Setup: the real control plane as a subprocess (`python -m server.cli api`, SQLite) and a running job
whose base model is a random-init Qwen2 built here, larger than `echo2:tiny` so that serialisation,
hashing and upload take real time (defaults: hidden 512, 6 layers, ~72 MB of float32 safetensors,
the tiny model's tokenizer). The learner side is the real one: `learner.trainer.GRPOTrainer` and
`learner.publisher.Publisher` (background thread: save_pretrained, manifest, 8 MiB chunks uploaded
over HTTP through `learner.remote.ControlPlane`, version announced last).

Each step trains `GRPOTrainer.step` on the same fixed batch of arithmetic groups (half of each
group's samples right, half wrong, so every group has signal and every step costs the same). The
steps cycle in blocks of `--block`: an "off" block only trains; then one "on" block per `--nice`
value (the publisher thread's nice value during that block) calls `Publisher.submit` after every
step (κ = 1, as `learner.loop.Learner` does), so each step overlaps the background publication of
the previous ones (a version submitted while an older one still waits replaces it: counted). The
publisher is drained (untimed) at the end of every block so that no upload leaks into the next
one. Two warm-up steps are not counted. Each `--prompts` value gets its own job and model, one after
the other in the same run and control plane.

Reported: the training step time (`GRPOTrainer.step` wall time: what publishing must not stall),
its ratio on/off (target <= 1.1), overall and per adjacent off/on block pair, and where each step's
wall time went: the training thread's own CPU time, the time it was runnable but waiting for a core
(/proc/thread-self/schedstat), and the rest (waiting for the GIL or anything else). Also the time
`Publisher.submit` blocks the training loop (the weight snapshot copy), the background publish time
per version and the CPU each version costs the publisher thread and the control-plane process. On a
CPU-only box the publisher, the server and training share the same cores, so a slowdown can be
plain CPU contention rather than a stall; the breakdown tells which.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from echo2.loading import load_causal_lm
from learner_staleness import ADMIN_KEY, control_plane, ok  # noqa: E402 - the same control plane helper

BIG_CONFIG = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 6, "num_attention_heads": 8,
              "num_key_value_heads": 2, "max_position_embeddings": 512, "tie_word_embeddings": True}


def build_model(out: Path, layers: int, hidden: int) -> Path:
    """A random-init Qwen2 with the tiny model's tokenizer (so the arithmetic task scores it)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from learner.tiny import build_tiny_model

    tiny = build_tiny_model(out.parent / "tiny", seed=0)
    tok = AutoTokenizer.from_pretrained(tiny)
    cfg = {**BIG_CONFIG, "num_hidden_layers": layers, "hidden_size": hidden, "intermediate_size": 3 * hidden,
           "num_attention_heads": hidden // 64}
    config = Qwen2Config(vocab_size=len(tok), bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, **cfg)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (out / f.name).write_bytes(f.read_bytes())
    return out


def spec_dict(model_dir: Path, prompts: int, group: int) -> dict[str, Any]:
    return {"name": "bench-publish", "base_model": str(model_dir), "task": {"name": "arithmetic"},
            "staleness": 1, "publish_period": 1, "max_steps": 10_000, "checkpoint_every": 10_000,
            "grpo": {"group_size": group, "prompts_per_step": prompts, "lr": 1e-4, "max_new_tokens": 3}}


def fixed_groups(tokenizer: Any, prompts: int, group: int) -> list[Any]:
    """One step's claimed groups: half the samples answer right, half wrong."""
    from echo2.prompting import encode_prompt
    from echo2.protocol import ClaimedGroup

    from tasks import get_task

    task = get_task("arithmetic")
    params = task.parse_params({})
    eos = tokenizer.eos_token_id
    groups = []
    for i, p in enumerate(task.generate_prompts(params, 0, prompts)):
        right = int(p.reference)
        samples = []
        for k in range(group):
            text = str(right if k % 2 == 0 else right + 1)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
            samples.append({"token_ids": ids, "logprobs": [-1.0] * len(ids), "text": text, "finish_reason": "stop"})
        groups.append(ClaimedGroup(rollout_id=f"r{i}", prompt_id=i, prompt_text=p.text, reference=p.reference,
                                   version=0, worker_id="bench", prompt_token_ids=encode_prompt(tokenizer, p.text),
                                   samples=samples))
    return groups


def measure(base_url: str, work: Path, args: argparse.Namespace, prompts: int) -> dict[str, Any]:
    import httpx
    import torch
    from echo2.protocol import JobSpec, WeightsConfig
    from transformers import AutoTokenizer

    from learner.parallel import Solo
    from learner.publisher import Publisher
    from learner.remote import ControlPlane
    from learner.trainer import GRPOTrainer
    from learner.weights import Weights

    torch.set_num_threads(args.threads)
    model_dir = build_model(work / "model", args.layers, args.hidden)
    size_mb = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 1e6
    admin = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)
    key = ok(admin.post("/v1/users", json={"name": "bench", "role": "user"}), 201)["api_key"]
    user = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    spec = spec_dict(model_dir, prompts, args.group)
    job_id = ok(user.post("/v1/jobs", json=spec), 201)["id"]
    plane = ControlPlane(base_url, ok(admin.post(f"/v1/jobs/{job_id}/learner/token"), 201)["token"], job_id)
    plane.start()

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_causal_lm(model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(model, tokenizer, JobSpec.model_validate(spec))
    publisher = Publisher(plane, Weights(model, tokenizer, torch.float32), work / "publish", args.chunk_mib * 2**20,
                          WeightsConfig(delta=False))  # the whole model every version: what this bench measures
    groups = fixed_groups(tokenizer, prompts, args.group)
    publisher.submit(0, 0, Solo().model_state(model))
    publisher.wait()

    server_pid, publisher_tid = _server_pid(), publisher._thread.native_id
    if args.pin:
        _pin(server_pid, publisher_tid)
    modes = ["off", *(f"on, nice {n}" for n in args.nice)]
    cpu_publisher = {m: 0.0 for m in modes}
    cpu_server = {m: 0.0 for m in modes}
    step_s: dict[str, list[float]] = {m: [] for m in modes}
    cpu_s: dict[str, list[float]] = {m: [] for m in modes}
    wait_s: dict[str, list[float]] = {m: [] for m in modes}  # runnable but not on a core
    submit_s: list[float] = []
    version = 0
    for _ in range(2):  # warm-up
        trainer.step(groups, 0)
    for b in range(len(modes) * args.steps // args.block):
        mode = modes[b % len(modes)]
        if mode != "off":  # the bench runs as root, so it may raise the priority back too
            os.setpriority(os.PRIO_PROCESS, publisher_tid, args.nice[b % len(modes) - 1])
        c_pub, c_srv = _cpu(f"/proc/self/task/{publisher_tid}/stat"), _cpu(f"/proc/{server_pid}/stat")
        for _ in range(args.block):
            w0, c0, t0 = _run_delay(), time.thread_time(), time.perf_counter()
            trainer.step(groups, 0)
            step_s[mode].append(time.perf_counter() - t0)
            cpu_s[mode].append(time.thread_time() - c0)
            wait_s[mode].append(_run_delay() - w0)
            if mode != "off":
                version += 1
                t0 = time.perf_counter()
                publisher.submit(version, version, Solo().model_state(model))
                submit_s.append(time.perf_counter() - t0)
        publisher.wait()
        cpu_publisher[mode] += _cpu(f"/proc/self/task/{publisher_tid}/stat") - c_pub
        cpu_server[mode] += _cpu(f"/proc/{server_pid}/stat") - c_srv
        print(f"block {b} {mode}: step {statistics.fmean(step_s[mode][-args.block:]):.3f}s, "
              f"load average {os.getloadavg()[0]:.2f}", flush=True)
    publisher.close()
    published = ok(user.get(f"/v1/jobs/{job_id}/versions"))
    plane.close()
    return {"size_mb": size_mb, "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
            "step_s": step_s, "cpu_s": cpu_s, "wait_s": wait_s, "submit_s": submit_s,
            "publish_s": publisher.seconds[1:], "versions": len(published), "skipped": len(publisher.skipped),
            "last_version": published[-1]["version"] if published else None,
            "modes": modes, "cpu_publisher": sum(cpu_publisher.values()) / max(1, version),
            "cpu_server": sum(cpu_server.values()) / max(1, version)}


def _pin(server_pid: int | None, publisher_tid: int) -> None:
    """Training (this thread) on CPU 0; the publisher thread and every control-plane thread on the
    other CPUs: a learner host whose compute trains while spare cores do I/O, with the origin standing
    in for a remote one (in production it is another machine)."""
    rest = set(range(1, os.cpu_count() or 2))
    os.sched_setaffinity(0, {0})  # pid 0: the calling thread only
    os.sched_setaffinity(publisher_tid, rest)
    for task in Path(f"/proc/{server_pid}/task").glob("*") if server_pid else []:
        os.sched_setaffinity(int(task.name), rest)


def _server_pid() -> int | None:
    """The control-plane subprocess (the only child of this process), to read its CPU time."""
    kids = [int(k) for t in Path("/proc/self/task").glob("*") for k in (t / "children").read_text().split()]
    return kids[0] if len(kids) == 1 else None


def _cpu(stat_path: str) -> float:
    """User + system CPU seconds of a process or thread, from /proc (0 when unavailable)."""
    try:
        fields = Path(stat_path).read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run_delay() -> float:
    """Seconds this thread has spent runnable but waiting for a core (Linux schedstat; 0 elsewhere)."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def report(r: dict[str, Any], args: argparse.Namespace, prompts: int) -> str:
    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    def mean(xs: list[float]) -> float:
        return statistics.fmean(xs)

    off, b, cycle = r["step_s"]["off"], args.block, len(r["modes"])
    lines = [
        f"model: random-init Qwen2, {r['params_m']:.1f} M parameters, {r['size_mb']:.1f} MB safetensors; "
        f"{prompts} prompts x G={args.group} per step; torch threads {args.threads}; "
        f"chunks {args.chunk_mib} MiB; blocks of {b} steps cycle {' / '.join(r['modes'])}"
        f"{'; pinned: training on CPU 0, publisher and control plane on the others' if args.pin else ''}",
        "",
        "| publishing | steps | step mean s | step median s | step min s | train-thread CPU s/step "
        "| waiting for a core s/step | rest (GIL, other waits) s/step | ratio on/off (mean) | ratio on/off (median) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *[f"| {m} | {len(xs)} | {mean(xs):.3f} | {med(xs):.3f} | {min(xs):.3f} | {mean(r['cpu_s'][m]):.3f} "
          f"| {mean(r['wait_s'][m]):.3f} | {mean(xs) - mean(r['cpu_s'][m]) - mean(r['wait_s'][m]):.3f} "
          f"| {mean(xs) / mean(off):.2f} | {med(xs) / med(off):.2f} |" for m, xs in r["step_s"].items()],
        "",
    ]
    for m in r["modes"][1:]:  # each on block / the off block of the same cycle
        on = r["step_s"][m]
        pairs = [mean(on[i:i + b]) / mean(off[i:i + b]) for i in range(0, len(on), b)]
        lines.append(f"per block ({m} / the off block of its cycle of {cycle}): "
                     f"{', '.join(f'{x:.2f}' for x in pairs)}; median {med(pairs):.2f}")
    return "\n".join([
        *lines,
        f"Publisher.submit (blocks the loop, weight snapshot copy): mean {mean(r['submit_s']):.3f}s, "
        f"max {max(r['submit_s']):.3f}s",
        f"background publish per version (save + manifest + upload + announce): mean {mean(r['publish_s']):.2f}s, "
        f"median {med(r['publish_s']):.2f}s, max {max(r['publish_s']):.2f}s; "
        f"versions announced {r['versions']} (last {r['last_version']}), replaced before publication {r['skipped']}",
        f"CPU per version: publisher thread {r['cpu_publisher']:.2f}s, control-plane process {r['cpu_server']:.2f}s "
        f"(training step: {mean(r['cpu_s']['off']):.2f}s of CPU on {args.threads} thread(s))",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="measured steps per mode")
    parser.add_argument("--block", type=int, default=5, help="steps per alternating off/on block")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the training step")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--prompts", type=int, nargs="+", default=[16, 64],
                        help="prompts per step; several values are measured one after the other")
    parser.add_argument("--nice", type=int, nargs="+", default=[0],
                        help="publisher thread nice values, each an 'on' mode of the cycle (default: 0, "
                             "the publisher's own normal priority)")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    parser.add_argument("--chunk-mib", type=int, default=8)
    parser.add_argument("--pin", action="store_true",
                        help="training thread on CPU 0; publisher thread and control plane on the others")
    args = parser.parse_args()
    if args.steps % args.block:
        parser.error("--steps must be a multiple of --block")

    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    la = os.getloadavg()
    print(f"# publish overlap bench, {date.today()}, {os.cpu_count()} CPUs, "
          f"load average at start {la[0]:.2f} / {la[1]:.2f} / {la[2]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="echo2-bench-publish-") as tmp, control_plane(Path(tmp)) as url:
        for prompts in args.prompts:
            result = measure(url, Path(tmp) / f"p{prompts}", args, prompts)
            print(f"\n{report(result, args, prompts)}\n", flush=True)
    la = os.getloadavg()
    print(f"\nload average at end {la[0]:.2f} / {la[1]:.2f} / {la[2]:.2f}")


if __name__ == "__main__":
    main()
