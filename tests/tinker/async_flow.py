"""Drives the unmodified `tinker` SDK against Echo2 for the calls of async RL (issue 31); run by
tests/tinker/test_sdk_async.py in .venv-tinker. Prints one JSON object with what it saw.

- the losses cispo, dro, gspo on one batch; sampling with record_stability_info and training stable_reinforce on
  the recorded sequences through provenance spans (as tinker-cookbook's rl_loop builds them);
- top-k prompt and sample logprobs, prompt_logprobs_last_n, prompt_alt_tokens_k;
- an in-flight sampling client: a long sample, then a training step and an in-flight save queued behind it;
- the checkpoint life cycle: save_state with a TTL, list (the run's and the user's), set_ttl, copy_weights,
  delete; and the billing calls.
"""

import json
import os
import sys
import time
from datetime import UTC

import httpx
import tinker
from tinker import types

KEY = os.environ["TINKER_API_KEY"].removeprefix("tml-")


def echo2(path: str) -> dict:
    """Echo2's own REST API, with the same key (what the SDK has no call for)."""
    with httpx.Client(base_url=os.environ["TINKER_BASE_URL"], headers={"Authorization": f"Bearer {KEY}"}) as http:
        answer = http.get(path)
        answer.raise_for_status()
        return answer.json()


def rl_datum(prompt: list[int], seq, advantage: float, provenance: bool, gspo: bool = False) -> types.Datum:
    """As tinker_cookbook/recipes/rl_loop.py builds a datum from a sampled sequence."""
    ob_len = len(prompt) - 1
    # The targets of the prompt's positions are the prompt's own tokens, shifted: what a prompt span claims.
    inputs = {"target_tokens": prompt[1:] + seq.tokens, "logprobs": [0.0] * ob_len + seq.logprobs,
              "advantages": [0.0] * ob_len + [advantage] * len(seq.tokens)}
    if gspo:
        inputs["sequence_ratio_mask"] = [0.0] * ob_len + [1.0] * len(seq.tokens)
    datum = types.Datum(model_input=types.ModelInput.from_ints(prompt + seq.tokens[:-1]), loss_fn_inputs=inputs)
    if not provenance:
        return datum
    return datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=len(prompt)),
                     types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens) - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=ob_len),
                        types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens))])


def losses(training, prompt: list[int]) -> dict:
    out: dict = {}
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
    drawn = sampler.sample(types.ModelInput.from_ints(prompt), 4,
                           types.SamplingParams(max_tokens=5, temperature=1.0, seed=3, stop=[])).result()
    seqs = drawn.sequences
    out["sequence_ids"] = [s.sequence_id for s in seqs]
    advantages = [1.0, -1.0, 0.5, -0.5]
    for loss in ("cispo", "dro", "gspo"):
        data = [rl_datum(prompt, s, a, False, gspo=loss == "gspo") for s, a in zip(seqs, advantages, strict=False)]
        result = training.forward_backward(data, loss).result()
        out[loss] = {"loss": result.metrics["loss:sum"],
                     "logprobs": [o["logprobs"].tolist()[len(prompt) - 1:] for o in result.loss_fn_outputs]}
    data = [rl_datum(prompt, s, a, True) for s, a in zip(seqs, advantages, strict=False)]
    result = training.forward_backward(data, "stable_reinforce").result()
    out["stable_reinforce"] = {"loss": result.metrics["loss:sum"], "metrics": result.metrics}
    out["sampled"] = [{"tokens": s.tokens, "logprobs": s.logprobs} for s in seqs]
    out["advantages"] = advantages
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    out["record"] = echo2(f"/v1/tinker/sequences/{seqs[0].sequence_id}")
    # A forged span: the sequence's tokens are not the datum's.
    forged = rl_datum(prompt, seqs[0], 1.0, True)
    forged = types.Datum(model_input=forged.model_input, loss_fn_inputs={
        **forged.loss_fn_inputs, "target_tokens": prompt[1:] + [(t + 1) % 100 for t in seqs[0].tokens]},
        model_input_spans=forged.model_input_spans, loss_fn_input_spans=forged.loss_fn_input_spans)
    out["forged"] = error(lambda: training.forward_backward([forged], "stable_reinforce").result())
    out["no_spans"] = error(lambda: training.forward_backward([rl_datum(prompt, seqs[0], 1.0, False)],
                                                              "stable_reinforce").result())
    return out


def logprob_calls(training, prompt: list[int]) -> dict:
    sampler = training.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=5, stop=[])
    full = sampler.sample(types.ModelInput.from_ints(prompt), 2, params, include_prompt_logprobs=True,
                          topk_prompt_logprobs=3, topk_sample_logprobs=2).result()
    last = sampler.sample(types.ModelInput.from_ints(prompt), 1, params, include_prompt_logprobs=True,
                          topk_prompt_logprobs=2, prompt_logprobs_last_n=2).result()
    alt = sampler.sample(types.ModelInput.from_ints(prompt), 1, params, prompt_alt_tokens_k=3).result()
    return {"prompt_logprobs": full.prompt_logprobs, "topk_prompt": full.topk_prompt_logprobs,
            "topk_sample": [s.topk_logprobs for s in full.sequences],
            "sample_logprobs": [s.logprobs for s in full.sequences],
            "sample_tokens": [s.tokens for s in full.sequences],
            "last_prompt_logprobs": last.prompt_logprobs, "last_topk": last.topk_prompt_logprobs,
            "alt_tokens": alt.prompt_alt_tokens.tokens.tolist(),
            "alt_logprobs": alt.prompt_alt_tokens.logprobs.tolist(),
            "alt_shape": alt.prompt_alt_tokens.tokens.shape,
            "too_many": error(lambda: sampler.sample(types.ModelInput.from_ints(prompt), 1, params,
                                                     topk_prompt_logprobs=500).result())}


def inflight(training, prompt: list[int], datum: types.Datum) -> dict:
    """An in-flight sampler draws a long sample; a training step and an in-flight save sent after it run between
    its segments, and its later tokens are drawn with the newer checkpoint."""
    sampler = training.save_weights_and_get_sampling_client(kind="inflight").result()
    # A long forward first keeps the host busy (the model's requests run in order) while the rest is queued behind
    # it, in this order: the sample, then the training step and the in-flight save.
    long = (prompt * 400)[:400]
    busy = training.forward([types.Datum(model_input=types.ModelInput.from_ints(long[:-1]), loss_fn_inputs={
        "target_tokens": long[1:], "weights": [1.0] * (len(long) - 1)})] * 64, "cross_entropy")
    time.sleep(0.2)
    future = sampler.sample(types.ModelInput.from_ints(prompt), 1,
                            types.SamplingParams(max_tokens=96, temperature=1.0, seed=11, stop=[]))
    time.sleep(0.2)
    training.forward_backward([datum], "cross_entropy")
    training.optim_step(types.AdamParams(learning_rate=0.05))
    second = training.save_weights_and_get_sampling_client(kind="inflight").result()
    busy.result()
    seq = future.result().sequences[0]
    after = second.sample(types.ModelInput.from_ints(prompt), 1,
                          types.SamplingParams(max_tokens=4, temperature=1.0, seed=11, stop=[])).result()
    return {"tokens": len(seq.tokens), "record": echo2(f"/v1/tinker/sequences/{seq.sequence_id}"),
            "after": echo2(f"/v1/tinker/sequences/{after.sequences[0].sequence_id}")}


def life_cycle(service, training) -> dict:
    rest = service.create_rest_client()
    state = training.save_state("keep", ttl_seconds=7200).result().path
    other = training.save_state("scratch").result().path
    mine = rest.list_checkpoints(training.model_id).result()
    listed = {c.tinker_path: {"type": c.checkpoint_type, "expires": c.expires_at is not None, "size": c.size_bytes}
              for c in mine.checkpoints}
    rest.set_checkpoint_ttl_from_tinker_path(other, 3600).result()
    again = rest.list_checkpoints(training.model_id).result().checkpoints
    expiry = {c.tinker_path: c.expires_at is not None for c in again}
    copy = rest.copy_weights(state, "ignored-project", ttl_seconds=3600).result()
    rest.delete_checkpoint_from_tinker_path(other).result()
    after = [c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints]
    user = rest.list_user_checkpoints(limit=50).result()
    run = rest.get_training_run(training.model_id).result()
    runs = rest.list_training_runs().result()
    info = rest.get_weights_info_by_tinker_path(state).result()
    return {"state": state, "other": other, "listed": listed, "expiry": expiry, "copy": copy, "after_delete": after,
            "user_paths": [c.tinker_path for c in user.checkpoints], "user_total": user.cursor.total_count,
            "run": {"id": run.training_run_id, "lora_rank": run.lora_rank, "is_lora": run.is_lora,
                    "last_checkpoint": run.last_checkpoint.tinker_path if run.last_checkpoint else None},
            "runs": [r.training_run_id for r in runs.training_runs],
            "weights_info": {"lora_rank": info.lora_rank, "base_model": info.base_model},
            "bad_ttl": error(lambda: rest.set_checkpoint_ttl_from_tinker_path(state, 10).result()),
            "load_deleted": error(lambda: service.create_training_client_from_state(other).result()),
            "copy_sampler": error(lambda: rest.copy_weights(
                f"tinker://{training.model_id}/sampler_weights/x", "p").result())}


def billing(service) -> dict:
    admin = tinker.AdminClient()
    now = time.time()
    hour = int(now // 3600) * 3600
    from datetime import datetime

    usage = admin.get_billing_usage(datetime.fromtimestamp(hour - 3600, UTC),
                                    datetime.fromtimestamp(hour + 3600, UTC)).result()
    storage = admin.get_current_checkpoint_storage_usage().result()
    return {"events": [{"type": e.event_info.type, "tokens": getattr(e.event_info, "token_count", None),
                        "usd": e.estimated_cost_usd, "session": e.session_id} for e in usage.data],
            "storage_bytes": storage.data[0].size_bytes, "storage_count": storage.data[0].checkpoint_count}


def error(call) -> dict:
    try:
        call()
        return {"raised": None}
    except Exception as exc:  # noqa: BLE001 - the test checks the type and the message
        return {"raised": type(exc).__name__, "message": str(exc)[:400]}


def main(base_model: str) -> dict:
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model=base_model, rank=4, seed=0).result()
    tokenizer = training.get_tokenizer()
    prompt = tokenizer.encode("12+34=")
    tokens = prompt + tokenizer.encode("46")
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    out = {"model_id": training.model_id, "prompt": prompt, "losses": losses(training, prompt),
           "logprobs": logprob_calls(training, prompt), "inflight": inflight(training, prompt, datum),
           "life_cycle": life_cycle(service, training)}
    out["billing"] = billing(service)
    out["session_id"] = service.holder.get_session_id() if hasattr(service.holder, "get_session_id") else None
    service.close("success").result()
    return out


if __name__ == "__main__":
    sys.stdout.write(json.dumps(main(sys.argv[1]), default=str) + "\n")
