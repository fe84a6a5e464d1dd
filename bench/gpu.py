"""Echo2's own code at real model sizes on one device: the learner's GRPO update, the worker's transformers
backend beside `model.generate` and the memory-bandwidth bound of decoding, an audit, and a publication.

    python bench/gpu.py                      # the three shapes of issue 28 on a CUDA GPU, one process each
    python bench/gpu.py --shapes smollm2-135m smollm2-1.7b
    python bench/gpu.py --smoke              # a tiny shape on the CPU, under 2 minutes: the same code paths
    python bench/gpu.py --quick --cpu-audit-s 45   # the worker's draw and its audits only, the CPU auditor's too

Models are random-init (weights do not change throughput; nothing is downloaded): SmolLM2-135M and -1.7B
(Llama), and the Qwen2.5-7B shape trained as a LoRA adapter (r = 16, activation checkpointing).

- learner: `learner.policy.grpo_update` (what `GRPOTrainer.step` runs) on 64 prompts x G 8 (7B: 16 x 8) of
  128 prompt + 512 completion tokens, float32 master weights with bf16 autocast on a GPU; seconds per step,
  trained tokens per second, and MFU = model FLOPs / (seconds x the device's dense bf16 peak), model FLOPs
  = 6 N per trained token for a full fine-tune and 4 N for LoRA (frozen weights get no gradient), N the
  model's parameters, recomputation not counted;
- worker: `TransformersBackend` (bf16 on a GPU) generating 256 new tokens after 128-token prompts at T = 1,
  never stopping early, at the batch it chooses itself, in its default settings (a static KV cache on a GPU),
  then with the other cache and (small shapes) the compiled decode step, each with the share of samples whose
  tokens equal the default's; against `model.generate` (sampling, with logits) at the same batch, where its
  logits fit in memory; and the decode bound, rows x bandwidth / bytes one decode step must read (bf16 weights + the
  KV cache at the mean context), with the device's nominal memory bandwidth;
- audit: `learner.audit.audit_group` on the device in the learner's compute dtype, with the shadow the
  learner's auditor gives a bf16 worker's groups (learner/auditor.py), on groups the worker drew (replay
  included); its share of learner time at the default audit rate = rate x audit seconds per group / learner
  seconds per group; then every group the worker drew judged (passed, the replay's near ties and largest gap,
  the largest logprob difference, the shadow's largest rounding) and, with --cpu-audit-s on a GPU, as many as
  fit in those seconds by the default fp32 CPU auditor: the false alarms of honest bf16 GPU workers at real
  shapes;
- publish: `learner.publisher.Publisher` of one full bf16 version of the learner's weights (snapshot, write,
  chunk and hash), the upload replaced by a local copy (`learner.sources.LocalWeights`); in learner steps.

A part that fails (out of memory, say) is named under the shape's "errors" and the others still run.
scripts/gpu_check.sh runs this and the gpu-marked tests on a lent GPU within a deadline.
It writes one JSON table (`--out`, default $OUT/gpu.json when $OUT is set) and ends with the summary line
`gpu: worker/bound F %, worker/generate R, audit share A %, publish P steps, MFU M % (DEVICE)` for the
headline shape (SmolLM2-1.7B, or the smoke shape).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from echo2.loading import load_causal_lm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LLAMA = {"rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048}
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {"arch": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                     "tie_word_embeddings": True, **LLAMA},
    "smollm2-1.7b": {"arch": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
                     "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 49152,
                     "tie_word_embeddings": True, **LLAMA},
    "qwen2.5-7b": {"arch": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                   "tie_word_embeddings": False, "max_position_embeddings": 4096, "lora": 16},
    "smoke": {"arch": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "tie_word_embeddings": True,
              **LLAMA},
}
# (prompts per step, G, prompt tokens, completion tokens) of the learner step; (rows, prompt, new) of generation
LEARNER = {"qwen2.5-7b": (16, 8, 128, 512), "smoke": (4, 4, 16, 32)}
GENERATION = {"smoke": (16, 16, 16)}
DEFAULT_LEARNER, DEFAULT_GENERATION = (64, 8, 128, 512), (512, 128, 256)
HEADLINE = ("smollm2-1.7b", "smoke")
# Dense bf16 peak FLOP/s and memory bandwidth (bytes/s) by device name, from the vendors' data sheets.
PEAKS = (("H200", 989e12, 4.8e12), ("H100 PCIe", 756e12, 2.0e12), ("H100", 989e12, 3.35e12),
         ("A100", 312e12, 2.0e12), ("L40S", 362e12, 0.864e12))
AUDIT_RATE = 0.1  # api/settings.py's default: one group in ten of a trusted worker
AUDIT_TIMED = 4  # groups an audit is timed over


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=[s for s in SHAPES if s != "smoke"],
                        default=["smollm2-135m", "smollm2-1.7b", "qwen2.5-7b"])
    parser.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU (the code paths, no figures)")
    parser.add_argument("--quick", action="store_true",
                        help="no learner step, cache variants or model.generate: the worker's draw and its audits")
    parser.add_argument("--cpu-audit-s", type=float, default=0.0,
                        help="on a GPU, seconds of the fp32 CPU auditor judging the worker's groups too")
    parser.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) / "gpu.json" if "OUT" in os.environ
                        else None)
    args = parser.parse_args()
    import torch

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    shapes = ["smoke"] if args.smoke else args.shapes
    table: dict[str, Any] = {"device": name, "torch": torch.__version__, "shapes": {}}
    start = time.perf_counter()
    for shape in shapes:
        # Several shapes run one process each: a shape's leftovers (compiled graphs, the allocator's cache)
        # would otherwise crowd the next one out of the GPU's memory.
        table["shapes"][shape] = (measure(shape, device, name, args.quick, args.cpu_audit_s) if len(shapes) == 1
                                  else _in_child(shape, args.quick, args.cpu_audit_s))
        print(json.dumps({shape: table["shapes"][shape]}), flush=True)
    table["seconds"] = time.perf_counter() - start
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(table, indent=1))
    print(summary(table))


def _in_child(shape: str, quick: bool, cpu_audit_s: float) -> dict[str, Any]:
    import subprocess

    with tempfile.TemporaryDirectory(prefix="echo2-gpu-") as tmp:
        out = Path(tmp) / "one.json"
        done = subprocess.run([sys.executable, __file__, "--shapes", shape, "--out", str(out), "--cpu-audit-s",
                               str(cpu_audit_s)] + (["--quick"] if quick else []), check=False)
        if not out.exists():
            return {"error": f"the measuring process ended with status {done.returncode} before writing figures"}
        return json.loads(out.read_text())["shapes"][shape]


def measure(shape: str, device: Any, name: str, quick: bool = False, cpu_audit_s: float = 0.0) -> dict[str, Any]:
    """Every part's figures; a part that fails (out of memory, say) is named under "errors" and the next
    one still runs. Figures so far are printed after each part."""
    row: dict[str, Any] = {"errors": {}}

    def part(label: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 (any failure of one part is reported; the others still run)
            row["errors"][label] = f"{type(e).__name__}: {str(e)[:300]}"
            return None
        finally:
            _free()
            print(json.dumps({shape: row}), flush=True)

    with tempfile.TemporaryDirectory(prefix="echo2-gpu-") as tmp:
        work = Path(tmp)
        folder = build(shape, work / "model")
        row["params"] = _params(folder)
        if not quick:
            row |= part("learner", learner, shape, folder, device, name, work) or {}
        groups, gen = part("worker", worker, shape, folder, device, name, quick) or ([], {})
        row |= gen
        if groups and (quick or "step_s" in row):
            per_group = row["step_s"] / LEARNER.get(shape, DEFAULT_LEARNER)[0] if "step_s" in row else None
            row |= part("audit", audit, shape, folder, device, groups, per_group, cpu_audit_s) or {}
    return row


def build(shape: str, out: Path) -> Path:
    """A random-init model folder of the shape (bf16, as a bf16 base is published) with a word-level tokenizer
    of its vocabulary (token i is the word "t<i>"; id 0 is the end of sequence)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    spec = {k: v for k, v in SHAPES[shape].items() if k not in ("arch", "lora")}
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if SHAPES[shape]["arch"] == "llama" else (
        Qwen2Config, Qwen2ForCausalLM)
    config = config_cls(**spec, bos_token_id=0, eos_token_id=0, pad_token_id=1, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = model_cls(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(spec["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0", pad_token="t1").save_pretrained(out)
    del model
    return out


def learner(shape: str, folder: Path, device: Any, name: str, work: Path) -> dict[str, Any]:
    """One GRPO update timed after one warm-up, then one full version published."""
    import torch
    from transformers import AutoTokenizer

    from learner.objective import ObjectiveConfig
    from learner.policy import grpo_update

    prompts, g, plen, clen = LEARNER.get(shape, DEFAULT_LEARNER)
    model = load_causal_lm(folder, dtype=torch.float32).to(device)
    lora = SHAPES[shape].get("lora")
    if lora:
        from echo2.protocol import LoraConfig

        from learner.models import with_adapter

        model.gradient_checkpointing_enable()
        model = with_adapter(model, LoraConfig(rank=lora, alpha=2 * lora))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6,
                            fused=device.type == "cuda")
    rows = _rollouts(prompts, g, plen, clen, SHAPES[shape]["vocab_size"])
    model.train()
    grpo_update(model, opt, rows, ObjectiveConfig(), max_tokens_per_micro_batch=16_384, pad_id=1)  # warm-up
    _sync(device)
    _reset_peak(device)
    t0 = time.perf_counter()
    stats = grpo_update(model, opt, rows, ObjectiveConfig(), max_tokens_per_micro_batch=16_384, pad_id=1)
    _sync(device)
    step_s = time.perf_counter() - t0
    tokens = prompts * g * (plen + clen)
    flops = (4 if lora else 6) * _params(folder) * tokens
    peak = _peak(name)
    out = {"step_s": step_s, "trained_tokens_per_s": tokens / step_s, "stepped": stats["stepped"] == 1.0,
           "mfu": flops / step_s / peak[0] if peak else None, "learner_peak_gib": _peak_gib(device)}
    if not lora:
        out |= publish(model, AutoTokenizer.from_pretrained(folder), work, step_s)
    del model, opt
    return out


def _rollouts(prompts: int, g: int, plen: int, clen: int, vocab: int) -> Any:
    import torch

    from learner.policy import Rollouts

    gen = torch.Generator().manual_seed(0)
    rows = Rollouts()
    for i in range(prompts * g):
        prompt = torch.randint(2, vocab, (plen,), generator=gen).tolist()
        completion = torch.randint(2, vocab, (clen,), generator=gen).tolist()
        rows.add(prompt, completion, [-10.0] * clen, float(torch.rand(1, generator=gen)), i // g, 0)
    return rows


def publish(model: Any, tokenizer: Any, work: Path, step_s: float) -> dict[str, Any]:
    import torch

    from learner.publisher import Publisher
    from learner.sources import LocalWeights
    from learner.weights import Weights

    weights = Weights(model, tokenizer, torch.bfloat16)
    publisher = Publisher(LocalWeights(work / "origin"), weights, work / "publish")
    try:
        t0 = time.perf_counter()
        publisher.submit(0, 0, weights.snapshot())
        publisher.wait()
        seconds = time.perf_counter() - t0
    finally:
        publisher.close()
    return {"publish_s": seconds, "publish_bytes": publisher.sizes[-1][1], "publish_steps": seconds / step_s}


VARIANTS = {"dynamic": ("dynamic", False), "static": ("static", False), "compiled": ("static", True)}
COMPILED = {"smollm2-135m", "smoke"}  # compiling a 1.7B or 7B step would take much of the bench's 8 minutes


def worker(shape: str, folder: Path, device: Any, name: str, quick: bool) -> tuple[list[Any], dict[str, Any]]:
    """The worker's backend at its own batch in its default settings (a static KV cache on a GPU, a growing
    one on a CPU), then (unless quick) with the other cache and with the decode step compiled (small shapes) and
    `model.generate` at that batch; the decode bound."""
    import torch
    from echo2.seeds import sample_seed
    from echo2_worker.backends import GenRequest
    from echo2_worker.backends.transformers_backend import TransformersBackend, kv_bytes_per_token

    rows, plen, new = GENERATION.get(shape, DEFAULT_GENERATION)
    vocab = SHAPES[shape]["vocab_size"]
    gen = torch.Generator().manual_seed(1)
    g = 8 if rows >= 8 else rows
    requests = [GenRequest(prompt_token_ids=torch.randint(2, vocab, (plen,), generator=gen).tolist(), n=g,
                           seeds=[sample_seed(i, k) for k in range(g)], max_new_tokens=new, stop_at_eos=False)
                for i in range(rows // g)]
    backend = TransformersBackend(device=device.type)
    backend.load(folder)
    try:
        backend.generate(requests[:1])  # warm-up
        budget = backend._row_budget(requests)
        batch = requests[: max(1, budget // g)]
        worker_s, out = _timed(backend, batch, device)
        default = "static" if backend._static() else "dynamic"
        variants = {k: _variant(backend, batch, device, *v, out) for k, v in VARIANTS.items()
                    if not quick and k != default and (k != "compiled" or shape in COMPILED)}
        model = backend.model
        batch_rows = sum(r.n for r in batch)
        generate_s = None if quick else _generate(model, batch, new, device)  # None where its logits do not fit
        kv = kv_bytes_per_token(model.config, model.dtype) * batch_rows * (plen + new / 2)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        bandwidth = _peak(name)[1] if _peak(name) else None
    finally:
        backend.close()
    tokens = batch_rows * new
    bound = batch_rows * bandwidth / (weight_bytes + kv) if bandwidth else None
    groups = [(i, r, [(s.token_ids, s.logprobs) for s in o])
              for i, (r, o) in enumerate(zip(batch, out, strict=True))]
    return groups, {"worker_rows": batch_rows, "worker_tokens_per_s": tokens / worker_s,
                    "generate_tokens_per_s": tokens / generate_s if generate_s else None,
                    "worker_vs_generate": generate_s / worker_s if generate_s else None,
                    "decode_bound_tokens_per_s": bound,
                    "worker_vs_bound": tokens / worker_s / bound if bound else None,
                    "variants": {k: {"tokens_per_s": tokens / v[0], "same_tokens": v[1], **v[2]}
                                 for k, v in variants.items()}}


def _timed(backend: Any, batch: list[Any], device: Any) -> tuple[float, list[Any]]:
    _sync(device)
    t0 = time.perf_counter()
    out = backend.generate(batch)
    _sync(device)
    return time.perf_counter() - t0, out


def _variant(backend: Any, batch: list[Any], device: Any, kv_cache: str, compiled: bool,
             reference: list[Any]) -> tuple[float, float, dict[str, float]]:
    """Seconds of one batch with the cache kind and compilation given (a first batch warms a compiled step up),
    the share of samples whose tokens equal the default settings' and the warm-up's seconds."""
    backend.kv_cache, backend.compile_decode, backend._step = kv_cache, compiled, None
    extra = {}
    try:
        if compiled:
            extra["compile_s"] = _timed(backend, batch, device)[0]
        seconds, out = _timed(backend, batch, device)
    finally:
        backend.kv_cache, backend.compile_decode, backend._step = "auto", False, None
    pairs = [(a.token_ids, b.token_ids) for ga, gb in zip(out, reference, strict=True)
             for a, b in zip(ga, gb, strict=True)]
    return seconds, sum(a == b for a, b in pairs) / len(pairs), extra


def _generate(model: Any, batch: list[Any], new: int, device: Any) -> float | None:
    """Seconds of `model.generate` sampling the same rows, logits returned, never stopping early; None where
    it runs out of memory (it keeps every step's float32 logits: rows x vocabulary x 4 bytes a token)."""
    import torch

    ids = torch.tensor([r.prompt_token_ids for r in batch for _ in range(r.n)], device=device)
    model.generation_config.eos_token_id = None  # random weights: every row runs to max_new_tokens, as the worker's
    kwargs = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": new,
              "output_logits": True, "return_dict_in_generate": True, "pad_token_id": 1}
    try:
        with torch.inference_mode():
            model.generate(ids[:1], **{**kwargs, "max_new_tokens": 4})  # warm-up
            _sync(device)
            t0 = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            _sync(device)
    except torch.OutOfMemoryError:
        return None
    return time.perf_counter() - t0


def audit(shape: str, folder: Path, device: Any, groups: list[Any], learner_s_per_group: float | None,
          cpu_seconds: float) -> dict[str, Any]:
    """Audits of the worker's groups on the device, in the learner's compute dtype (the replay included): timed
    over the first AUDIT_TIMED, then every group judged; on a GPU, then as many as `cpu_seconds` allow by the
    default fp32 CPU auditor (the false alarms of bf16 workers against a CPU learner's audits, at this shape)."""
    import torch

    from learner.audit import AuditConfig, GroupClaim, audit_group
    from learner.auditor import compute_dtype

    dtype = compute_dtype(device)
    precision = "bfloat16" if device.type == "cuda" else "float32"
    model, shadow = load_causal_lm(folder, dtype=dtype).to(device).eval(), _shadow(folder, precision, dtype, device)
    config = AuditConfig(auditor=str(dtype).removeprefix("torch."))
    claims = [GroupClaim(prompt=r.prompt_token_ids, samples=s, temperature=1.0, seed=i, precision=precision)
              for i, r, s in groups]
    audit_group(model, claims[0], config, shadow)  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    results = [audit_group(model, c, config, shadow) for c in claims[:AUDIT_TIMED]]
    _sync(device)
    seconds = (time.perf_counter() - t0) / len(results)
    tokens = sum(r.tokens for r in results) / len(results)
    out = {"audit_s_per_group": seconds, "audit_tokens_per_s": tokens / seconds,
           "audit_share": AUDIT_RATE * seconds / learner_s_per_group if learner_s_per_group else None,
           **_judged(results + [audit_group(model, c, config, shadow) for c in claims[AUDIT_TIMED:]], "")}
    del model, shadow
    _free()
    if device.type == "cuda" and cpu_seconds > 0:
        cpu = load_causal_lm(folder, dtype=torch.float32).eval()
        cpu_shadow = _shadow(folder, precision, torch.float32, torch.device("cpu"))
        deadline, judged = time.monotonic() + cpu_seconds, []
        for c in claims:
            if time.monotonic() > deadline:
                break
            judged.append(audit_group(cpu, c, AuditConfig(), cpu_shadow))
        out |= _judged(judged, "cpu_")
    return out


def _shadow(folder: Path, precision: str, auditor: Any, device: Any) -> Any:
    """The auditor's shadow for groups claiming `precision`, as learner/auditor.py builds it (None: none)."""
    from learner.audit import shadow_dtype

    low = shadow_dtype(precision, auditor)
    return None if low is None else load_causal_lm(folder, dtype=low).to(device).eval()


def _judged(results: list[Any], prefix: str) -> dict[str, Any]:
    """What the audits of honest groups found: how many passed, their replay's near ties and largest gap, and
    the largest difference between the worker's logprobs and the auditor's."""
    return {f"{prefix}audits_passed": sum(r.passed for r in results), f"{prefix}audits": len(results),
            f"{prefix}replayed": sum(r.replayed for r in results),
            f"{prefix}near_ties": sum(r.near_ties for r in results),
            f"{prefix}max_gap": max((r.max_gap for r in results), default=None),
            f"{prefix}max_abs_diff": max((r.max_abs_diff for r in results), default=None),
            f"{prefix}max_rounding": max((r.rounding for r in results if r.rounding is not None), default=None)}


def summary(table: dict[str, Any]) -> str:
    shape = next((s for s in HEADLINE if s in table["shapes"]), next(iter(table["shapes"])))
    r = table["shapes"][shape]

    def pct(key: str) -> str:
        return "n/a" if r.get(key) is None else f"{100 * r[key]:.1f}"

    def num(key: str) -> str:
        return "n/a" if r.get(key) is None else f"{r[key]:.2f}"

    return (f"gpu: worker/bound {pct('worker_vs_bound')} %, worker/generate {num('worker_vs_generate')}, "
            f"audit share {pct('audit_share')} %, publish {num('publish_steps')} steps, MFU {pct('mfu')} % "
            f"({table['device']}, {shape})")


def _params(folder: Path) -> int:
    """Parameters of the model folder (a tied embedding counted once, as the folder stores it)."""
    import math

    from safetensors import safe_open

    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118
    return total


def _peak(name: str) -> tuple[float, float] | None:
    return next(((flops, bw) for key, flops, bw in PEAKS if key in name), None)


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: Any) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
