"""A task that calls out scores a step's groups `concurrency` at a time (learner/trainer.py `_rewards`):
http_reward against a real, slow HTTP verifier, on the real tiny model."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from echo2.loading import load_causal_lm
from echo2.prompting import encode_prompt
from echo2.protocol import ClaimedGroup, JobSpec, SampleSubmit

from learner.trainer import GRPOTrainer


class _Slow(BaseHTTPRequestHandler):
    in_flight = peak = 0
    lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        with _Slow.lock:
            _Slow.in_flight += 1
            _Slow.peak = max(_Slow.peak, _Slow.in_flight)
        time.sleep(0.2)
        with _Slow.lock:
            _Slow.in_flight -= 1
        data = json.dumps({"reward": 1.0}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def verifier():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/reward"
    server.shutdown()


@pytest.mark.parametrize("concurrency", [1, 4])
def test_http_rewards_are_computed_concurrency_at_a_time(tiny_dir, verifier, concurrency):
    from transformers import AutoTokenizer

    spec = JobSpec.model_validate({
        "name": "t", "base_model": str(tiny_dir), "prompts": [{"item": {"prompt": "hi"}}],
        "task": {"name": "http_reward", "params": {"url": verifier, "concurrency": concurrency}},
        "grpo": {"group_size": 2, "prompts_per_step": 4, "max_new_tokens": 4}})
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    trainer = GRPOTrainer(load_causal_lm(tiny_dir, dtype=torch.float32), tok, spec)
    ids = encode_prompt(tok, "hi")
    groups = [ClaimedGroup(rollout_id=f"rol_{i}", prompt_id=i, prompt_text="hi", reference=None, version=0,
                           worker_id="wrk_1", prompt_token_ids=ids,
                           samples=[SampleSubmit(token_ids=[5, 6], logprobs=[-1.0, -1.0], finish_reason="length")] * 2)
              for i in range(8)]
    _Slow.peak = 0
    result = trainer.step(groups, 0)
    assert all(r == [1.0, 1.0] for r in result.rewards.values()) and len(result.rewards) == 8
    assert _Slow.peak == 1 if concurrency == 1 else 2 <= _Slow.peak <= concurrency
