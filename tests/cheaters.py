"""Rational cheating workers: each is the honest rollout driver (tests/rollout_driver.py, the real transformers
backend over HTTP) with one way of doing less work than it claims, and it always recomputes its logprobs
honestly under the version it claims, so only the replay audit can tell. The cheats of issue 27:

- `stale`: keeps sampling the first version it loaded, claims the newest (held: it downloads it, to rescore);
- `stale3`: the same, refreshing its sampling weights every third version;
- `nearby`: samples with the claimed weights plus 1 % noise (`NEARBY_NOISE`);
- `copy`: draws one sample and submits it G times;
- `eos`: stops every sample after its first token with an end-of-sequence token;
- `pick`: draws 3G samples (the leased seeds and 2G more) and submits the G with the lowest reward.

Any of them may also be `disguised`: it computes in float32 but claims bfloat16 and adds noise to its logprobs
(`DISGUISE_NOISE` nats), so that the audit's margin, narrowed by how far its logprobs are from the audit's,
widens to bfloat16's (the auditor's shadow caps it: learner/audit.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from echo2.loading import load_causal_lm
from echo2.prompting import encode_prompt
from echo2.protocol import LeaseRead, Manifest
from echo2.seeds import sample_seed
from echo2.snapshots import assemble
from echo2_worker.backends.base import GenRequest
from transformers import AutoTokenizer

from learner.policy import completion_logprobs, pad_batch
from tests.rollout_driver import RolloutDriver

CHEATS = ("stale", "stale3", "nearby", "copy", "eos", "pick")
NEARBY_NOISE = 0.01
DISGUISE_NOISE = 0.03


class Cheater(RolloutDriver):
    def __init__(self, cheat: str, *args: Any, disguised: bool = False, **kwargs: Any) -> None:
        assert cheat in CHEATS, cheat
        super().__init__(*args, **kwargs)
        self.cheat, self.disguised = cheat, disguised
        self.noise = torch.Generator().manual_seed(1)
        self.claimed: Any = None  # the claimed version's model, to rescore with
        self.sampling_version: int | None = None

    def _hold(self, job_id: str, version: int) -> None:
        if self.held is not None and self.held >= version:
            return
        manifest = Manifest.model_validate(self._get(f"/v1/jobs/{job_id}/versions/{version}/manifest"))
        folder = assemble(manifest, lambda i: self.http.get(
            f"/v1/jobs/{job_id}/versions/{version}/chunks/{i}").raise_for_status().content,
            self.work_dir / f"v{version}")
        self.claimed = load_causal_lm(folder, dtype=torch.float32).eval()
        self.tokenizer = self.tokenizer or AutoTokenizer.from_pretrained(folder)
        if self._refresh(version):
            self._load_sampler(folder)
            self.sampling_version = version
        self.held, self.files = version, manifest.target_files()  # it holds the claimed version: it proves it

    def _refresh(self, version: int) -> bool:
        if self.sampling_version is None or self.cheat not in ("stale", "stale3"):
            return True
        return self.cheat == "stale3" and version - self.sampling_version >= 3

    def _load_sampler(self, folder: Path) -> None:
        if self.cheat != "nearby":
            (self.backend.reload if self.backend.model is not None else self.backend.load)(folder)
            return
        noisy = folder.with_name(folder.name + "-nearby")
        model = load_causal_lm(folder, dtype=torch.float32)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(NEARBY_NOISE * p.abs().mean() * torch.randn(p.shape, generator=gen))
        model.save_pretrained(noisy)
        self.tokenizer.save_pretrained(noisy)
        (self.backend.reload if self.backend.model is not None else self.backend.load)(noisy)

    def _one_lease(self, job_id: str) -> None:
        r = self.http.post("/v1/leases", json={"job_id": job_id, "max_prompts": self.per_lease, "version": self.held})
        if r.status_code == 409:
            return
        lease = LeaseRead.model_validate(r.raise_for_status().json())
        groups = [self._group(lease, p) for p in lease.prompts]
        self.results += self._post(f"/v1/leases/{lease.id}/rollouts", {"groups": groups})["results"]
        self.versions_used.append(lease.version)

    def _group(self, lease: LeaseRead, prompt: Any) -> dict[str, Any]:
        s = lease.sampling
        ids = encode_prompt(self.tokenizer, prompt.text)
        extra = 3 if self.cheat == "pick" else 1
        request = GenRequest(prompt_token_ids=ids, n=s.group_size * extra, max_new_tokens=s.max_new_tokens,
                             seeds=[sample_seed(prompt.seed, k) for k in range(s.group_size * extra)],
                             temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
        drawn = [x.token_ids for x in self.backend.generate([request])[0]]
        tokens = self._forge(drawn, prompt.text, s.group_size)
        logprobs = self._rescore(ids, tokens, s.temperature)
        eos = self.tokenizer.eos_token_id
        return {"prompt_id": prompt.prompt_id, "version": lease.version, "prompt_token_ids": ids,
                "samples": [{"token_ids": t, "logprobs": lp,
                             "finish_reason": "stop" if t[-1] == eos else "length"}
                            for t, lp in zip(tokens, logprobs, strict=True)]} | self._claim()

    def _claim(self) -> dict[str, Any]:
        return {"precision": "bfloat16"} if self.disguised else {}

    def _forge(self, drawn: list[list[int]], text: str, g: int) -> list[list[int]]:
        if self.cheat == "copy":
            return [drawn[0]] * g
        if self.cheat == "eos":
            return [[t[0], self.tokenizer.eos_token_id] if t[0] != self.tokenizer.eos_token_id else t[:1]
                    for t in drawn]
        if self.cheat == "pick":
            return sorted(drawn, key=lambda t: _reward(text, self.tokenizer.decode(t, skip_special_tokens=True)))[:g]
        return drawn

    def _rescore(self, prompt: list[int], tokens: list[list[int]], temperature: float) -> list[list[float]]:
        """Honest behaviour logprobs of `tokens` under the claimed version."""
        batch = pad_batch([prompt] * len(tokens), tokens, self.tokenizer.pad_token_id or 0)
        with torch.no_grad():
            lp = completion_logprobs(self.claimed, batch, temperature=temperature)
        if self.disguised:
            lp = lp + DISGUISE_NOISE * torch.randn(lp.shape, generator=self.noise)
        return [[max(-1e4, min(0.0, x)) for x in lp[i, : len(t)].tolist()] for i, t in enumerate(tokens)]


def _reward(question: str, answer: str) -> float:
    """The arithmetic task's reward, as a cheater would compute it (it can add)."""
    nums = [int(x) for x in re.findall(r"\d+", question)[:2]]
    got = re.findall(r"-?\d+", answer)
    return float(len(nums) == 2 and bool(got) and int(got[0]) == sum(nums))
