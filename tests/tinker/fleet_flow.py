"""Drives the unmodified `tinker` SDK against Echo2 with rollout workers; run by tests/e2e/test_tinker_fleet.py in
.venv-tinker. A LoRA training client trains three steps, saves weights for a sampler, and samples in rounds
until the model's fleet job has delivered `want` groups (read from Echo2's own REST API with the same key: the
SDK cannot tell who drew its samples) or the deadline passes; then it scores every sampled sequence with
`compute_logprobs`, which the learner host runs, to compare with the logprobs the samples came with.

Prints one JSON object with what it saw."""

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import tinker
from tinker import types


def main(base_model: str, want: int, deadline_s: float) -> dict:
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model=base_model, rank=4, seed=0).result()
    tokenizer = training.get_tokenizer()
    prompt = tokenizer.encode("12+34=")
    tokens = prompt + tokenizer.encode("46")
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    for _ in range(3):
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=0.003)).result()
    sampler = training.save_weights_and_get_sampling_client("fleet").result()
    params = types.SamplingParams(max_tokens=6, temperature=1.0)
    drawn, rounds, end = [], 0, time.monotonic() + deadline_s
    while delivered(training.model_id) < want and time.monotonic() < end:
        futures = [sampler.sample(types.ModelInput.from_ints(prompt), 4, params) for _ in range(4)]
        drawn += [s for f in futures for s in f.result().sequences]
        rounds += 1
    with ThreadPoolExecutor(4) as pool:  # each sequence scored under the checkpoint by the learner host
        scored = list(pool.map(lambda s: sampler.compute_logprobs(
            types.ModelInput.from_ints(prompt + s.tokens)).result(), drawn))
    service.close("success").result()
    return {"model_id": training.model_id, "rounds": rounds, "delivered": delivered(training.model_id),
            "samples": [{"tokens": s.tokens, "logprobs": s.logprobs, "stop": s.stop_reason,
                         "scored": lps[len(prompt):]} for s, lps in zip(drawn, scored, strict=True)]}


def delivered(model_id: str) -> int:
    """Groups the worker fleet drew for this model (its fleet job's rollouts delivered)."""
    key = os.environ["TINKER_API_KEY"].removeprefix("tml-")
    with httpx.Client(base_url=os.environ["TINKER_BASE_URL"], headers={"Authorization": f"Bearer {key}"}) as http:
        name = f"Tinker sampler of {model_id}"
        jobs = [j for j in http.get("/v1/jobs", params={"name": name}).json()["items"] if j["name"] == name]
        if not jobs:
            return 0
        return http.get(f"/v1/jobs/{jobs[0]['id']}/rollouts", params={"status": "trained", "limit": 1}).json()["total"]


if __name__ == "__main__":
    sys.stdout.write(json.dumps(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))) + "\n")
