"""The learner's auditor: it keeps the weights of every version a rollout may still claim (the last S+1
published), and re-scores the groups the control plane picks under the version each one claims
(learner/audit.py says how). A version it does not hold — after a resume, say — is fetched from the
control plane, chunk by verified chunk, like a worker would. A partial rollout's tokens are each
re-scored under the version that produced it (all of them at or after the group's version, so all
held or fetched): none is skipped.

It runs on a model of its own (a second instance of the architecture, loaded with one version's
weights at a time), so auditing never touches the weights being trained. For a LoRA job that model
carries an adapter of the job's shape, and a version's weights are its adapter's (version 0, the base,
is the adapter at zero)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from echo2.loading import load_causal_lm
from echo2.protocol import ClaimedGroup, JobSpec

from .audit import AuditConfig, AuditResult, GroupClaim, audit_group, audit_versions, shadow_dtype
from .models import with_adapter
from .weights import ADAPTER_DIR

log = logging.getLogger(__name__)
Fetch = Callable[[int], Path]  # version -> a local folder holding its safetensors


class Auditor:
    """Audits on `device` (the learner's), in the dtype the learner computes in there: bfloat16 on a GPU that
    has it, float32 elsewhere. The replay's margin then allows for the auditor's precision as well as the
    worker's (AuditConfig.auditor). Unless worker and auditor both compute in float32, a group is also
    re-scored by a shadow, another instance of the model in the precision the two do not share
    (audit.shadow_dtype), built at the first such group: its difference from the audit caps the margin, so a
    worker that claims a coarser precision than it computed in, and reports noisy logprobs to match, gains no
    more room than that precision gives."""

    def __init__(self, model_path: str, spec: JobSpec, fetch: Fetch, config: AuditConfig | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.model_path, self.spec, self.fetch = model_path, spec, fetch
        self.device = torch.device(device)
        self.dtype = compute_dtype(self.device)
        self.config = replace(config or AuditConfig(), auditor=str(self.dtype).removeprefix("torch."))
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self._models: dict[torch.dtype, Any] = {}  # the auditor's dtype, and a shadow's
        self._zero_adapter: dict[str, torch.Tensor] = {}
        self._loaded: dict[torch.dtype, int] = {}  # the version each model holds
        self._no_room: set[torch.dtype] = set()  # shadows the device could not hold
        self.seconds = 0.0

    def remember(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """A published version's weights (a CPU copy nobody mutates; shared, not copied)."""
        self.versions[version] = state

    def keep_from(self, oldest: int) -> None:
        """Forget versions no rollout may claim any more (older than t - S)."""
        for version in [v for v in self.versions if v < oldest]:
            del self.versions[version]
        for dtype in [d for d, v in self._loaded.items() if v < oldest]:
            del self._loaded[dtype]

    def audit(self, group: ClaimedGroup) -> AuditResult:
        start = time.perf_counter()
        try:
            claim = claim_of(group, self.spec)
            low = shadow_dtype(claim.precision, self.dtype)
            shadow_at = None if low is None else self._shadow_at(low)
            if any(s.versions is not None for s in group.samples):  # a partial rollout: each token its version
                return audit_versions(self._model_at, claim, [s.token_versions(group.version) for s in group.samples],
                                      self.config, shadow_at)
            return audit_group(self._model_at(group.version), claim, self.config,
                               None if shadow_at is None else shadow_at(group.version))
        finally:
            self.seconds += time.perf_counter() - start

    def _shadow_at(self, dtype: torch.dtype) -> Callable[[int], Any] | None:
        """The shadow in `dtype`, by version; None where the device cannot hold it (logged once), and the group
        is judged by the claim's margin, as before shadows: a worker's claim must not stop the learner."""
        if dtype not in self._models and dtype not in self._no_room:
            try:
                self._models[dtype] = self._build(dtype)
            except (torch.OutOfMemoryError, MemoryError):
                self._no_room.add(dtype)
                log.error("no memory on %s for the audit's %s shadow: groups claiming that precision are judged "
                          "without it", self.device, dtype)
        return partial(self._model_at, dtype=dtype) if dtype in self._models else None

    def _model_at(self, version: int, dtype: torch.dtype | None = None) -> Any:
        """The model in `dtype` (the auditor's own by default) holding `version`'s weights."""
        dtype = dtype or self.dtype
        if dtype not in self._models:
            self._models[dtype] = self._build(dtype)
        model = self._models[dtype]
        if self._loaded.get(dtype) != version:
            state = self.versions.get(version)
            if state is None:
                state = self.versions[version] = self._load_folder(self.fetch(version))
            if self.spec.lora is not None:
                from peft import set_peft_model_state_dict

                set_peft_model_state_dict(model, state)
            else:
                model.load_state_dict(state, strict=False)  # tied weights are stored twice; either loads
            self._loaded[dtype] = version
        return model

    def _build(self, dtype: torch.dtype) -> Any:
        model = load_causal_lm(self.model_path, dtype=dtype, use_safetensors=True)
        model = model.to(self.device)
        if self.spec.lora is not None:
            # Its adapter's initialisation draws nothing from the trainer's random stream: dropout masks drawn after
            # an audit differed from a relaunched learner's (which audits nothing while it replays), so a replay
            # of a LoRA job with dropout was not bit-exact.
            on = torch.device(self.device)
            with torch.random.fork_rng(devices=[on.index or 0] if on.type == "cuda" else []):
                model = with_adapter(model, self.spec.lora)
            from peft import get_peft_model_state_dict

            if not self._zero_adapter:  # the first model's; a shadow's would be a cast of the same zeros
                self._zero_adapter = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
        return model.eval()

    def _load_folder(self, folder: Path) -> dict[str, torch.Tensor]:
        """A fetched version's weights: its model files, or for a LoRA job its adapter's (the final
        version keeps it in adapter/; the base, version 0, has none: the adapter at zero)."""
        from safetensors.torch import load_file

        if self.spec.lora is not None:
            adapter = next((f for f in (folder / "adapter_model.safetensors",
                                        folder / ADAPTER_DIR / "adapter_model.safetensors") if f.exists()), None)
            return load_file(str(adapter)) if adapter is not None else self._zero_adapter
        state: dict[str, torch.Tensor] = {}
        for file in sorted(folder.glob("*.safetensors")):
            state.update(load_file(str(file)))
        log.info("audit weights loaded from %s", folder)
        return state


def compute_dtype(device: torch.device) -> torch.dtype:
    """What the learner computes in on `device` (policy.autocast): bfloat16 on a GPU that has it."""
    return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32


def claim_of(group: ClaimedGroup, spec: JobSpec) -> GroupClaim:
    """What a claimed group says about itself, for the audit: drawn at the job's settings with its leased seed."""
    g = spec.grpo
    return GroupClaim(prompt=list(group.prompt_token_ids), samples=[(list(s.token_ids), list(s.logprobs))
                                                                     for s in group.samples],
                      temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, seed=group.seed,
                      precision=group.precision.value,
                      masks=[None if s.turns is None else s.model_token_mask() for s in group.samples])
