"""What a worker needs to generate for a job, from the model's config.json and its published weights."""

from echo2.modelinfo import context_length, eos_token_ids, generation_memory_gib, weight_bytes

QWEN3_4B = {"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "hidden_size": 2560, "torch_dtype": "bfloat16"}


def test_a_4b_model_does_not_fit_a_10_gib_worker():
    weights = weight_bytes([("model-00001-of-00002.safetensors", 4_967_000_000),
                            ("model-00002-of-00002.safetensors", 3_077_000_000), ("tokenizer.json", 11_000_000)])
    assert weights == 8_044_000_000
    need = generation_memory_gib({"config.json": QWEN3_4B}.get, weights, sequences=8, new_tokens=1024)
    # weights 7.49 GiB + KV 2 * 36 * 8 * 128 * 2 bytes * 8 * (512 + 1024) = 1.69 GiB, * 1.2 + 0.5
    assert 11.5 < need < 11.6


def test_the_kv_cache_grows_with_the_group_and_a_config_without_sizes_counts_the_weights():
    read = {"config.json": QWEN3_4B}.get
    assert generation_memory_gib(read, 0, 64, 4096) > generation_memory_gib(read, 0, 8, 4096) > 2
    assert generation_memory_gib(lambda _: {}, 2**30, 64, 4096) == 1.7  # 1.2 GiB of weights + the runtime


def test_an_eos_that_is_a_regular_vocabulary_token_is_a_stop_id():
    """The transformers backend stops at its tokenizer's eos; where that is a token of the model's own vocabulary,
    not an added one, the door did not count it a stop token and struck the honest worker's "stop" samples."""
    files = {"tokenizer_config.json": {"eos_token": "</s>"},
             "tokenizer.json": {"added_tokens": [], "model": {"type": "BPE", "vocab": {"<s>": 1, "</s>": 2, "a": 3}}}}
    assert eos_token_ids(lambda name: files.get(name, {})) == {2}
    files["tokenizer.json"]["model"] = {"type": "Unigram", "vocab": [["<unk>", 0.0], ["<s>", 0.0], ["</s>", 0.0]]}
    assert eos_token_ids(lambda name: files.get(name, {})) == {2}


def test_the_context_is_stretched_by_a_rope_scaling_factor_as_vllm_stretches_it():
    """vLLM serves a linear or dynamic RoPE scaling model past max_position_embeddings (by its factor) and stops
    samples there; the door held such a model to max_position_embeddings and would strike its honest samples past
    it. YaRN, llama3 and longrope configs give the scaled length already (vLLM's _get_and_verify_max_len)."""
    def length(**config):  # type: ignore[no-untyped-def]
        return context_length({"config.json": {"max_position_embeddings": 2048, **config}}.get)

    assert length() == 2048
    assert length(rope_scaling={"type": "linear", "factor": 4.0}) == 8192
    assert length(rope_scaling={"rope_type": "dynamic", "factor": 2}) == 4096
    assert length(rope_parameters={"rope_type": "linear", "factor": 2.0}) == 4096
    for kind in ("yarn", "llama3", "longrope", "default"):
        assert length(rope_scaling={"rope_type": kind, "factor": 4.0}) == 2048, kind
    assert length(model_type="gemma3_text", rope_scaling={"rope_type": "linear", "factor": 8.0}) == 2048
    assert context_length({"config.json": {"n_positions": 1024}}.get) == 1024  # GPT-2
