"""The transformers generation backend on the tiny model: shapes, seeds, logprobs, stops, reload."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from echo2.loading import load_causal_lm
from echo2_worker.backends import BackendError, GenRequest, GenSample, create_backend, model_eos_token_ids
from echo2_worker.backends.transformers_backend import TransformersBackend
from safetensors.torch import load_file, save_file

from learner.tiny import build_tiny_model

LOGPROB_TOL = 1e-4  # KV-cached decode vs one teacher-forced forward pass, fp32 on CPU


def make_next_version(src: Path, dst: Path, *, noise: float = 0.05, seed: int = 1) -> Path:
    """A 'published next version': same folder, every weight nudged (as a training step would)."""
    shutil.copytree(src, dst)
    gen = torch.Generator().manual_seed(seed)
    for file in sorted(dst.glob("*.safetensors")):
        tensors = load_file(str(file))
        nudged = {
            k: (v + noise * torch.randn(v.shape, generator=gen, dtype=v.dtype)).contiguous() for k, v in tensors.items()
        }
        save_file(nudged, str(file), metadata={"format": "pt"})
    return dst


def teacher_forced_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T)[token] for each completion token, from one forward pass without cache."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    rows = logp[len(prompt) - 1 : len(prompt) - 1 + len(completion)]
    return rows.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1).tolist()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny")
    v0 = build_tiny_model(root / "v0", seed=0)
    return v0, make_next_version(v0, root / "v1")


@pytest.fixture(scope="module")
def backend(models):
    b = TransformersBackend(device="cpu")
    b.load(models[0])
    yield b
    b.close()


@pytest.fixture(scope="module")
def hf_models(models):
    return [load_causal_lm(m, dtype=torch.float32, use_safetensors=True).eval() for m in models]


def requests_mixed() -> list[GenRequest]:
    return [
        GenRequest([5, 6, 7, 8, 9, 10, 11], n=3, seeds=[11, 12, 13], max_new_tokens=24),
        GenRequest([20, 21], n=2, seeds=[7, 8], max_new_tokens=16, temperature=0.7, top_p=0.9),
        GenRequest([30], n=1, seeds=[99], max_new_tokens=8, temperature=1.3),
    ]


def tokens(groups: list[list[GenSample]]) -> list[list[list[int]]]:
    return [[s.token_ids for s in g] for g in groups]


def test_shapes_and_text(backend):
    reqs = requests_mixed()
    out = backend.generate(reqs)
    assert [len(g) for g in out] == [r.n for r in reqs]
    for r, group in zip(reqs, out, strict=True):
        for s in group:
            assert 1 <= len(s.token_ids) <= r.max_new_tokens
            assert len(s.logprobs) == len(s.token_ids)
            assert all(lp <= 0.0 for lp in s.logprobs)
            assert s.finish_reason in ("stop", "length")
            assert s.text == backend.tokenizer.decode(s.token_ids, skip_special_tokens=True)


def test_same_seed_same_sample_different_seed_different(backend):
    reqs = requests_mixed()
    first, again = backend.generate(reqs), backend.generate(reqs)
    assert tokens(first) == tokens(again)
    assert [[s.logprobs for s in g] for g in first] == [[s.logprobs for s in g] for g in again]
    group = first[0]
    assert len({tuple(s.token_ids) for s in group}) == len(group), "different seeds gave equal samples"
    # A sample depends on its own seed only, not on its group or batch neighbours.
    alone = backend.generate([GenRequest(reqs[0].prompt_token_ids, n=1, seeds=[12], max_new_tokens=24)])
    assert alone[0][0].token_ids == group[1].token_ids


@pytest.mark.parametrize("compiled", [False, True], ids=["static", "static-compiled"])
def test_static_cache_decodes_as_the_growing_cache_does(backend, models, compiled):
    """The pre-allocated KV cache a GPU worker decodes into (and its compiled step) gives the growing cache's
    tokens and logprobs, stops and lengths included, for a batch of prompts of different lengths."""
    other = TransformersBackend(device="cpu", kv_cache="static", compile_decode=compiled)
    other.load(models[0])
    reqs = requests_mixed()
    want, got = backend.generate(reqs), other.generate(reqs)
    assert tokens(got) == tokens(want)
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            assert a.finish_reason == b.finish_reason
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < LOGPROB_TOL
    other.close()


def test_unknown_kv_cache_is_refused():
    with pytest.raises(BackendError, match="kv_cache must be auto, static or dynamic"):
        TransformersBackend(kv_cache="paged")


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (1.3, 0.5)])
def test_logprobs_match_teacher_forcing(backend, hf_models, temperature, top_p):
    """Behaviour logprob = log_softmax(logits / T) before top-p, as the learner recomputes it."""
    req = GenRequest(
        [3, 14, 15, 9, 26], n=4, seeds=[1, 2, 3, 4], max_new_tokens=32, temperature=temperature, top_p=top_p
    )
    worst = 0.0
    for s in backend.generate([req])[0]:
        ref = teacher_forced_logprobs(hf_models[0], req.prompt_token_ids, s.token_ids, temperature)
        worst = max(worst, max(abs(a - b) for a, b in zip(ref, s.logprobs, strict=True)))
    assert worst < LOGPROB_TOL


def test_top_p_restricts_support(backend, hf_models):
    """With a small top_p only the most likely tokens are drawn (their logprobs stay untruncated)."""
    req = GenRequest([3, 14, 15], n=8, seeds=list(range(8)), max_new_tokens=12, top_p=1e-3)
    for s in backend.generate([req])[0]:
        ids = req.prompt_token_ids + s.token_ids
        with torch.no_grad():
            logits = hf_models[0](input_ids=torch.tensor([ids])).logits[0]
        argmax = logits[len(req.prompt_token_ids) - 1 : -1].argmax(-1).tolist()
        assert s.token_ids == argmax[: len(s.token_ids)]


def test_stop_and_length_finish_reasons(backend, models):
    eos = model_eos_token_ids(models[0])
    assert eos, "the tiny model declares an eos id"
    stop_extra = list(range(40, 44))
    req = GenRequest([5, 6, 7], n=16, seeds=list(range(100, 116)), max_new_tokens=20, stop_token_ids=stop_extra)
    out = backend.generate([req])[0]
    stops = eos | set(stop_extra)
    for s in out:
        assert not stops & set(s.token_ids[:-1]), "generation went on past a stop token"
        if s.finish_reason == "stop":
            assert s.token_ids[-1] in stops
        else:
            assert len(s.token_ids) == req.max_new_tokens and s.token_ids[-1] not in stops
    assert {s.finish_reason for s in out} == {"stop", "length"}


def test_eos_ends_a_sample(backend, models):
    (eos_id,) = model_eos_token_ids(models[0])
    req = GenRequest([5, 6, 7], n=16, seeds=list(range(16)), max_new_tokens=128)
    out = backend.generate([req])[0]
    ended = [s for s in out if s.finish_reason == "stop"]
    assert ended, "no sample drew eos in 16 x 128 tokens"
    assert all(s.token_ids[-1] == eos_id and eos_id not in s.token_ids[:-1] for s in ended)
    assert all(len(s.token_ids) == 128 for s in out if s.finish_reason == "length")


def test_reload_swaps_weights_in_place(models, hf_models):
    b = TransformersBackend(device="cpu")
    b.load(models[0])
    req = GenRequest([3, 14, 15, 9], n=3, seeds=[5, 6, 7], max_new_tokens=16)
    before = b.generate([req])[0]
    ptrs = [p.data_ptr() for p in b.model.parameters()]
    b.reload(models[1])
    assert [p.data_ptr() for p in b.model.parameters()] == ptrs, "reload re-allocated the model"
    after = b.generate([req])[0]
    assert [s.logprobs for s in after] != [s.logprobs for s in before]
    for s in after:
        ref = teacher_forced_logprobs(hf_models[1], req.prompt_token_ids, s.token_ids, 1.0)
        assert max(abs(a - c) for a, c in zip(ref, s.logprobs, strict=True)) < LOGPROB_TOL
    b.reload(models[0])
    assert tokens([b.generate([req])[0]]) == tokens([before])
    b.close()


def test_reload_rejects_other_architecture(models, tmp_path):
    other = shutil.copytree(models[0], tmp_path / "other")
    (weights,) = other.glob("*.safetensors")
    tensors = load_file(str(weights))
    key = next(k for k in tensors if k.endswith("mlp.up_proj.weight"))
    tensors[key] = torch.zeros(tensors[key].shape[0] + 1, tensors[key].shape[1])
    save_file(tensors, str(weights))
    b = TransformersBackend(device="cpu")
    b.load(models[0])
    req = GenRequest([3, 14, 15], n=2, seeds=[1, 2], max_new_tokens=8)
    before = b.generate([req])
    with pytest.raises(BackendError, match="not the same architecture"):
        b.reload(other)
    assert b.generate([req]) == before, "a refused reload changed the weights"
    b.close()


def test_refuses_pickled_weights(models, tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    shutil.copy(models[0] / "config.json", folder / "config.json")
    (folder / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(BackendError, match="only safetensors"):
        TransformersBackend(device="cpu").load(folder)


def test_request_validation():
    with pytest.raises(ValueError, match="one seed per sample"):
        GenRequest([1], n=2, seeds=[1], max_new_tokens=4)
    with pytest.raises(ValueError, match="temperature"):
        GenRequest([1], n=1, seeds=[1], max_new_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match="unknown backend"):
        create_backend("nope")


def test_import_is_light():
    """`echo2-worker --help` imports the backends package; it must not pull in torch or vllm."""
    heavy = "{'torch', 'vllm', 'transformers'}"
    code = f"import sys, echo2_worker.backends; print(sorted({heavy} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-3), ("auto", 5e-2)])
def test_cuda_sampling_matches_teacher_forcing(models, dtype, tol):
    """On CUDA (bf16 with dtype auto) samples stay seeded and logprobs match the same model's forward."""
    b = TransformersBackend(device="cuda", dtype=dtype)
    b.load(models[0])
    req = GenRequest([3, 14, 15, 9], n=4, seeds=[1, 2, 3, 4], max_new_tokens=32, temperature=0.8, top_p=0.95)
    out = b.generate([req])[0]
    assert tokens([out]) == tokens([b.generate([req])[0]])
    for s in out:
        ids = torch.tensor([req.prompt_token_ids + s.token_ids], device="cuda")
        with torch.no_grad():
            logits = b.model(input_ids=ids, use_cache=False).logits[0].float()
        rows = torch.log_softmax(logits / req.temperature, -1)[len(req.prompt_token_ids) - 1 : -1]
        ref = rows.gather(-1, torch.tensor(s.token_ids, device="cuda").unsqueeze(-1)).squeeze(-1).tolist()
        assert max(abs(a - c) for a, c in zip(ref, s.logprobs, strict=True)) < tol
    b.close()


def test_backends_loading_in_several_threads_leave_the_process_able_to_load(models):
    """transformers swaps process-wide torch globals while it loads: loads racing in threads once left them
    swapped, after which every load in the process had parameters with no data (echo2.loading)."""
    from concurrent.futures import ThreadPoolExecutor

    backends = [TransformersBackend(device="cpu") for _ in range(6)]
    with ThreadPoolExecutor(len(backends)) as pool:
        for _ in range(3):
            list(pool.map(lambda b: b.load(models[0]), backends))
    assert torch.get_default_device() == torch.device("cpu")
    for b in backends:
        assert all(p.device.type == "cpu" for p in b.model.parameters())
        b.close()
    fresh = load_causal_lm(models[0], dtype=torch.float32, use_safetensors=True)
    assert not any(p.is_meta for p in fresh.parameters())


def test_a_sample_stops_where_the_models_context_ends(backend):
    """vLLM stops a sample where the model's context ends (512 tokens for the tiny model), finish "length"; this
    backend did not, and the door refuses a sample past the context."""
    (cut,) = backend.generate([GenRequest([5] * 509, n=4, seeds=[1, 2, 3, 4], max_new_tokens=24)])
    assert all(len(s.token_ids) <= 3 for s in cut) and any(s.finish_reason == "length" for s in cut)
    assert all(len(s.token_ids) == 3 for s in cut if s.finish_reason == "length")


def test_transformers_backend_stops_at_the_models_context_like_vllm_does(tmp_path):
    """On a model with learned positions (GPT-2's config says `n_positions`, here 64) decoding past the context
    raised IndexError, and a worker exits at its third failed generation in a row: one job whose prompt +
    max_new_tokens passed the context took down every worker that served it (review finding)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    tiny = build_tiny_model(tmp_path / "tiny", seed=0)  # only for its tokenizer (vocabulary of 96)
    folder = tmp_path / "gpt2"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_positions=64, n_embd=64, n_layer=1, n_head=2, vocab_size=96, bos_token_id=1,
                               eos_token_id=2, pad_token_id=0)).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, folder / name)
    backend = TransformersBackend(device="cpu")
    backend.load(folder)
    try:
        prompt = [5] * 40  # no eos stop, so that the random model cannot end a sample early by luck
        (group,) = backend.generate([GenRequest(prompt, n=2, seeds=[1, 2], max_new_tokens=64, stop_at_eos=False)])
    finally:
        backend.close()
    for sample in group:  # 24 tokens of room after a 40-token prompt in a 64-token context
        assert len(sample.token_ids) <= 64 - len(prompt)
        assert sample.finish_reason == "stop" or len(sample.token_ids) == 64 - len(prompt)
