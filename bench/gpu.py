"""Echo2's own code at real model sizes on one device: the learner's GRPO update, the worker's transformers
backend beside `model.generate` and the memory-bandwidth bound of decoding, an audit, and a publication.

    python bench/gpu.py                      # the three shapes of issue 28 on a CUDA GPU (about 6 minutes on an H100)
    python bench/gpu.py --shapes smollm2-135m smollm2-1.7b
    python bench/gpu.py --smoke              # a tiny shape on the CPU, under 2 minutes: the same code paths

Models are random-init (weights do not change throughput; nothing is downloaded): SmolLM2-135M and -1.7B
(Llama), and the Qwen2.5-7B shape trained as a LoRA adapter (r = 16, activation checkpointing).

- learner: `learner.policy.grpo_update` (what `GRPOTrainer.step` runs) on 64 prompts x G 8 (7B: 16 x 8) of
  128 prompt + 512 completion tokens, float32 master weights with bf16 autocast on a GPU; seconds per step,
  trained tokens per second, and MFU = model FLOPs / (seconds x the device's dense bf16 peak), model FLOPs
  = 6 N per trained token for a full fine-tune and 4 N for LoRA (frozen weights get no gradient), N the
  model's parameters, recomputation not counted;
- worker: `TransformersBackend` (bf16 on a GPU) generating 256 new tokens after 128-token prompts at T = 1,
  never stopping early, at the batch it chooses itself, against `model.generate` (sampling, with logits) at the
  same batch; and the decode bound, rows x bandwidth / bytes one decode step must read (bf16 weights + the
  KV cache at the mean context), with the device's nominal memory bandwidth;
- audit: `learner.audit.audit_group` on the device in the learner's compute dtype, on groups the worker drew
  (replay included); its share of learner time at the default audit rate = rate x audit seconds per group /
  learner seconds per group;
- publish: `learner.publisher.Publisher` of one full bf16 version of the learner's weights (snapshot, write,
  chunk and hash), the upload replaced by a local copy (`learner.sources.LocalWeights`); in learner steps.

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=[s for s in SHAPES if s != "smoke"],
                        default=["smollm2-135m", "smollm2-1.7b", "qwen2.5-7b"])
    parser.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU (the code paths, no figures)")
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
        table["shapes"][shape] = measure(shape, device, name)
        print(json.dumps({shape: table["shapes"][shape]}), flush=True)
    table["seconds"] = time.perf_counter() - start
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(table, indent=1))
    print(summary(table))


def measure(shape: str, device: Any, name: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="echo2-gpu-") as tmp:
        work = Path(tmp)
        folder = build(shape, work / "model")
        row: dict[str, Any] = {"params": _params(folder)}
        row |= learner(shape, folder, device, name, work)
        _free()
        groups, gen = worker(shape, folder, device, name)
        row |= gen
        _free()
        row |= audit(shape, folder, device, groups, row["step_s"] / LEARNER.get(shape, DEFAULT_LEARNER)[0])
        _free()
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


def worker(shape: str, folder: Path, device: Any, name: str) -> tuple[list[Any], dict[str, Any]]:
    """The worker's backend at its own batch, `model.generate` at that batch, and the decode bound."""
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
        _sync(device)
        t0 = time.perf_counter()
        out = backend.generate(batch)
        _sync(device)
        worker_s = time.perf_counter() - t0
        model = backend.model
        batch_rows = sum(r.n for r in batch)
        generate_s = _generate(model, batch, new, device)
        kv = kv_bytes_per_token(model.config, model.dtype) * batch_rows * (plen + new / 2)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        bandwidth = _peak(name)[1] if _peak(name) else None
    finally:
        backend.close()
    tokens = batch_rows * new
    bound = batch_rows * bandwidth / (weight_bytes + kv) if bandwidth else None
    groups = [(i, r, [(s.token_ids, s.logprobs) for s in o])
              for i, (r, o) in enumerate(zip(batch[:4], out[:4], strict=True))]
    return groups, {"worker_rows": batch_rows, "worker_tokens_per_s": tokens / worker_s,
                    "generate_tokens_per_s": tokens / generate_s, "worker_vs_generate": generate_s / worker_s,
                    "decode_bound_tokens_per_s": bound,
                    "worker_vs_bound": tokens / worker_s / bound if bound else None}


def _generate(model: Any, batch: list[Any], new: int, device: Any) -> float:
    """Seconds of `model.generate` sampling the same rows, logits returned, never stopping early."""
    import torch

    ids = torch.tensor([r.prompt_token_ids for r in batch for _ in range(r.n)], device=device)
    model.generation_config.eos_token_id = None  # random weights: every row runs to max_new_tokens, as the worker's
    kwargs = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": new,
              "output_logits": True, "return_dict_in_generate": True, "pad_token_id": 1}
    with torch.inference_mode():
        model.generate(ids[:1], **{**kwargs, "max_new_tokens": 4})  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        _sync(device)
    return time.perf_counter() - t0


def audit(shape: str, folder: Path, device: Any, groups: list[Any], learner_s_per_group: float) -> dict[str, Any]:
    """Audits of the worker's groups on the device, in the learner's compute dtype (the replay included)."""

    from learner.audit import AuditConfig, GroupClaim, audit_group
    from learner.auditor import compute_dtype

    dtype = compute_dtype(device)
    model = load_causal_lm(folder, dtype=dtype).to(device).eval()
    config = AuditConfig(auditor=str(dtype).removeprefix("torch."))
    claims = [GroupClaim(prompt=r.prompt_token_ids, samples=s, temperature=1.0, seed=i,
                         precision="bfloat16" if device.type == "cuda" else "float32") for i, r, s in groups]
    audit_group(model, claims[0], config)  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    results = [audit_group(model, c, config) for c in claims]
    _sync(device)
    seconds = (time.perf_counter() - t0) / len(claims)
    tokens = sum(r.tokens for r in results) / len(results)
    del model
    return {"audit_s_per_group": seconds, "audit_tokens_per_s": tokens / seconds,
            "audit_share": AUDIT_RATE * seconds / learner_s_per_group,
            "audits_passed": sum(r.passed for r in results), "audits": len(results)}


def summary(table: dict[str, Any]) -> str:
    shape = next((s for s in HEADLINE if s in table["shapes"]), next(iter(table["shapes"])))
    r = table["shapes"][shape]

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}"

    publish = f"{r['publish_steps']:.2f}" if "publish_steps" in r else "n/a"
    return (f"gpu: worker/bound {pct(r['worker_vs_bound'])} %, worker/generate {r['worker_vs_generate']:.2f}, "
            f"audit share {pct(r['audit_share'])} %, publish {publish} steps, MFU {pct(r['mfu'])} % "
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
