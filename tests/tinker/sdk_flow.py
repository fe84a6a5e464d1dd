"""Drives the unmodified `tinker` SDK against Echo2; run by tests/tinker/test_sdk.py in .venv-tinker.

Reads TINKER_BASE_URL and TINKER_API_KEY like any Tinker program, takes the base model as argv[1], and
prints one JSON object with what it saw, for the test to check.
"""

import json
import sys
import time

import tinker
from tinker import types


def main(base_model: str) -> dict:
    out: dict = {}
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model=base_model, rank=4, seed=0).result()
    info = training.get_info()
    out["model_id"], out["tokenizer_id"] = training.model_id, info.model_data.tokenizer_id
    tokenizer = training.get_tokenizer()
    prompt, answer = tokenizer.encode("12+34="), tokenizer.encode("46")
    tokens = prompt + answer
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})
    out["ce_losses"] = []
    for _ in range(12):
        fwdbwd = training.forward_backward([datum], "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=0.003))
        out["ce_losses"].append(fwdbwd.result().metrics["loss:sum"])
        out["optim_metrics"] = optim.result().metrics

    saved = training.save_weights_for_sampler("trained").result()
    out["path"] = saved.path
    trained = service.create_sampling_client(model_path=saved.path)
    greedy = trained.sample(types.ModelInput.from_ints(prompt), 1,
                            types.SamplingParams(max_tokens=len(answer), temperature=0.0)).result()
    out["greedy"], out["answer"] = greedy.sequences[0].tokens, answer
    out["prompt_logprobs"] = trained.compute_logprobs(types.ModelInput.from_ints(tokens)).result()

    sampler = training.save_weights_and_get_sampling_client().result()
    drawn = sampler.sample(types.ModelInput.from_ints(prompt), 4,
                           types.SamplingParams(max_tokens=6, temperature=1.0, seed=1)).result()
    out["samples"] = [{"tokens": s.tokens, "logprobs": s.logprobs, "stop": s.stop_reason} for s in drawn.sequences]
    rl_data = [types.Datum(model_input=types.ModelInput.from_ints(prompt + s.tokens[:-1]),
                           loss_fn_inputs={"target_tokens": prompt[1:] + s.tokens,
                                           "logprobs": [0.0] * (len(prompt) - 1) + s.logprobs,
                                           "advantages": [0.0] * (len(prompt) - 1) + [1.0] * len(s.tokens)})
               for s in drawn.sequences if s.tokens]
    for loss in ("importance_sampling", "ppo"):
        result = training.forward_backward(rl_data, loss).result()
        out[loss] = {"metrics": result.metrics, "logprobs": [o["logprobs"].tolist() for o in result.loss_fn_outputs]}
    training.optim_step(types.AdamParams(learning_rate=0.001)).result()
    state = training.save_state("resume-point").result()
    out["state_path"] = state.path
    out["state_logprobs"] = training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    out["errors"] = errors(service, training, datum)
    rest = service.create_rest_client()
    session_id = training.model_id.split(":")[0]
    found = rest.get_session(session_id).result()
    out["session"] = {"id": session_id, "listed": rest.list_sessions(limit=5).result().sessions,
                      "training_run_ids": found.training_run_ids, "sampler_ids": found.sampler_ids}
    service.close("success").result()
    out["resumed"] = resumed(state.path, datum)
    return out


def resumed(path: str, datum) -> dict:
    """A new session, as a program restarted after a crash makes one, goes on from the saved state: with its
    optimizer, and with the weights alone."""
    service = tinker.ServiceClient()
    with_optimizer = service.create_training_client_from_state_with_optimizer(path).result()
    weights_only = service.create_training_client_from_state(path).result()
    forward = with_optimizer.forward([datum], "cross_entropy").result()
    steps = [client.optim_step(types.AdamParams(learning_rate=0.001)).result().metrics["step"]
             for client in (with_optimizer, weights_only)]
    service.close("success").result()
    return {"logprobs": forward.loss_fn_outputs[0]["logprobs"].tolist(), "steps": steps}


def errors(service: tinker.ServiceClient, training, datum) -> dict:
    """Each unsupported thing must fail at once with a message, never hang."""
    cases = {  # in this order: a failed training call leaves the TrainingClient refusing further calls
        "unknown_model": lambda: service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result(),
        "unsupported_method": lambda: training.save_weights_external("x").result(),
        "unknown_loss": lambda: training.forward_backward([datum], "custom").result(),
    }
    seen = {}
    for name, call in cases.items():
        start = time.monotonic()
        try:
            call()
            seen[name] = {"raised": None}
        except Exception as exc:  # noqa: BLE001 - the test checks the type and the message
            seen[name] = {"raised": type(exc).__name__, "message": str(exc)[:400]}
        seen[name]["seconds"] = time.monotonic() - start
    return seen


if __name__ == "__main__":
    sys.stdout.write(json.dumps(main(sys.argv[1])) + "\n")
