"""What a worker needs to generate for a job, from the model's config.json and its published weights."""

from echo2.modelinfo import eos_token_ids, generation_memory_gib, weight_bytes

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
