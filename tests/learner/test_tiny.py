"""The tiny model folder: loadable by transformers, deterministic, vLLM-compatible shape, fast."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
from echo2.loading import load_causal_lm

from learner.tiny import TINY_ALPHABET, build_tiny_model

FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def _digests(folder: Path) -> dict[str, str]:
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in FILES}


def test_loads_with_auto_classes(tiny_dir, tiny):
    model, tok = tiny
    assert model.__class__.__name__ == "Qwen2ForCausalLM"
    cfg = model.config
    assert cfg.hidden_size // cfg.num_attention_heads >= 64  # vLLM CPU attention needs head_dim >= 64
    assert tok.eos_token is not None and tok.pad_token is not None
    assert tok.eos_token_id != tok.pad_token_id
    assert cfg.eos_token_id == tok.eos_token_id and cfg.pad_token_id == tok.pad_token_id
    assert cfg.vocab_size == len(tok)
    gen = json.loads((tiny_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id


def test_tokenizer_round_trips_the_task_alphabet(tiny_dir, tiny):
    from tokenizers import Tokenizer

    _, tok = tiny
    raw = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    for text in [TINY_ALPHABET, "3+4=", "what is 12*7?\n", "question: 1,234.5 #### 42"]:
        ids = tok(text)["input_ids"]
        assert ids == raw.encode(text).ids  # AutoTokenizer (Qwen2 class) == the trained tokenizer.json
        assert tok.decode(ids) == text
    digits = {tok.convert_ids_to_tokens(tok(d)["input_ids"])[0] for d in "0123456789"}
    assert len(digits) == 10  # one token per digit


def test_deterministic_per_seed_and_fast(tmp_path):
    build_tiny_model(tmp_path / "warm", seed=0)  # first call pays the imports
    start = time.perf_counter()
    a = build_tiny_model(tmp_path / "a", seed=0)
    elapsed = time.perf_counter() - start
    b = build_tiny_model(tmp_path / "b", seed=0)
    c = build_tiny_model(tmp_path / "c", seed=1)
    assert _digests(a) == _digests(b)
    assert _digests(a)["model.safetensors"] != _digests(c)["model.safetensors"]
    assert elapsed < 1.0, f"build took {elapsed:.2f}s"


def test_forward_pass_runs(tiny):
    import torch

    model, tok = tiny
    ids = torch.tensor([tok("3+4=")["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert torch.isfinite(logits).all()


def test_import_smollm2(tmp_path):
    """GGUF (Q4_1) -> HF safetensors folder that loads with the Auto classes and answers sensibly."""
    pytest.importorskip("gguf")
    import torch
    from transformers import AutoTokenizer

    from learner.tiny import import_smollm2, smollm2_gguf_path

    try:
        gguf = smollm2_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    out = import_smollm2(tmp_path / "smollm2")
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    tok = AutoTokenizer.from_pretrained(out)
    model = load_causal_lm(out, dtype=torch.float32)
    assert model.config.model_type == "llama"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token is not None
    original = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    for text in ["What is 2+3? Answer: 5", " spaces  and\n\nnewlines 1234567", "<|im_start|>user\nhi<|im_end|>"]:
        assert tok(text)["input_ids"] == original(text)["input_ids"]
    chat = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True,
                                   return_tensors="pt", return_dict=True)
    out_ids = model.generate(**chat, max_new_tokens=16, do_sample=False)
    assert "5" in tok.decode(out_ids[0, chat["input_ids"].shape[1] :])


def test_a_model_folder_inside_echo2s_own_data_is_refused_on_the_host(tmp_path, monkeypatch):
    from learner.models import resolve_model

    work = tmp_path / "learner"
    checkpoint = work / "job_other" / "checkpoints" / "ckpt-5"
    checkpoint.mkdir(parents=True)
    with pytest.raises(ValueError, match="inside Echo2's own data"):
        resolve_model(str(checkpoint), work / "models", private=(work,))  # other jobs' checkpoints
    monkeypatch.setenv("ECHO2_DATA_DIR", str(tmp_path / "data"))
    (tmp_path / "data" / "blobs").mkdir(parents=True)
    with pytest.raises(ValueError, match="inside Echo2's own data"):
        resolve_model(str(tmp_path / "data" / "blobs"), tmp_path / "elsewhere" / "models")
    mine = tmp_path / "my-model"
    mine.mkdir()
    assert resolve_model(str(mine), work / "models", private=(work,)) == str(mine.resolve())
