"""admission._prompt_bound took a chat template's own tokens for at most 1,024. A model whose
template carries a default system prompt longer than that (a house style guide, safety rules, tool descriptions:
common in fine-tuned instruct models) got every honest worker's every group refused as invalid, with a strike."""

from __future__ import annotations

from echo2.prompting import encode_prompt
from transformers import AutoTokenizer

from tests.api.test_admission import door, sample  # noqa: F401  (the fixture)
from tests.factories import ok

RULES = ("You are a careful assistant. Answer with the final number only, after showing your reasoning "
         "step by step. Never guess. ") * 12  # ~1,300 characters of default system prompt


def test_an_honest_prompt_rendered_by_a_chat_template_with_a_long_default_system_prompt_is_accepted(
        api, door, tiny_model_dir):  # noqa: F811
    job, alice, wid, worker, lease = door
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = ("{% if messages[0]['role'] != 'system' %}<s>system\n" + RULES + "\n{% endif %}"
                         "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
    prompt = lease["prompts"][0]
    ids = encode_prompt(tok, prompt["text"], prompt.get("context"))  # exactly what an honest worker sends
    group = {"prompt_id": prompt["prompt_id"], "version": 0, "prompt_token_ids": ids,
             "samples": [sample(), sample(tokens=(6, 5, 0))]}
    out = ok(worker.post(f"/v1/leases/{lease['id']}/rollouts", json={"groups": [group]}))["results"][0]
    got = ok(api.admin.get(f"/v1/workers/{wid}"))
    assert out["status"] == "accepted", (
        f"an honest group ({len(ids)} prompt tokens for a {len(prompt['text'])}-character prompt, as the model's "
        f"own chat template renders it) came back {out['status']}: {out['reason']}; the worker is now {got['trust']}")
