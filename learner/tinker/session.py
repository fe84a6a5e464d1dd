"""One Tinker model held by a learner host: a base model with a LoRA adapter (peft), its AdamW state, the
gradients accumulated since the last `optim_step`, and its saved checkpoints.

`forward_backward` adds to the gradients (losses in learner/tinker/losses.py); `optim_step` applies
them with the step's Adam hyperparameters and clears them, as the Tinker SDK's training clients expect.
A checkpoint is a copy of the adapter's weights, kept in memory for as long as the host holds the model;
sampling from it swaps it in for the duration of the sample. A model the control plane parks is saved to
one file (`park`) and built again from it (`restore`): adapter, gradients, optimizer, checkpoints, steps.
`save_state` writes the adapter and optimizer for `load_state`, into this model or a new one.
`publish` sends a sampler checkpoint to the model's fleet job for rollout workers to sample from, and
`audit` re-scores a group one of them drew (api/tinker/fleet.py).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from echo2.loading import load_causal_lm
from echo2.protocol import LoraConfig, WeightsConfig
from echo2.protocol.tinker import (
    AdamStep,
    AuditPayload,
    AuditVerdict,
    CheckpointKind,
    ForwardBackwardPayload,
    ForwardBackwardResult,
    ModelInfo,
    ModelSpec,
    PublishOrder,
    SamplePayload,
    SampleProgress,
    SampleResult,
    SavePayload,
    TinkerLora,
)
from echo2.snapshots import atomic_file

from learner.sampling import sample

from ..audit import GroupClaim, audit_group, audit_versions, shadow_dtype
from ..models import resolve_model, with_adapter
from ..publisher import Publisher
from ..remote import ControlPlane
from ..weights import LoraWeights
from .losses import datum_loss

log = logging.getLogger(__name__)
INFLIGHT = "<inflight>"  # a batch of in-flight requests: drawn with the newest in-flight checkpoint
MICRO_BATCH_TOKENS = 2048  # padded tokens per forward pass: bounds the logits held for the backward
LORA_ALPHA = 32.0  # Tinker's own choice, so learning rates carry over from its docs and recipes
TARGETS = {"attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj"),
           "unembed": ("lm_head",)}


class UserError(ValueError):
    """The request cannot be run as asked (the SDK reports it as the caller's fault)."""


class Cancelled(UserError):
    """The control plane no longer waits for the request (its session ended): stopped between micro-batches."""


def lora_targets(lora: TinkerLora, module_names: set[str]) -> list[str]:
    wanted = [name for part, on in (("attn", lora.train_attn), ("mlp", lora.train_mlp),
                                    ("unembed", lora.train_unembed)) if on for name in TARGETS[part]]
    present = [name for name in wanted if name in module_names]
    if not present:
        raise UserError(f"none of the LoRA targets {wanted} exists in this model")
    return present


class TinkerSession:
    def __init__(self, spec: ModelSpec, cache_dir: Path, device: str = "cpu", private: tuple[Path, ...] = ()) -> None:
        """`private`: the host's work dir, which no base model may be inside (other users' states)."""
        from transformers import AutoTokenizer

        try:
            self.path = resolve_model(spec.base_model, cache_dir, private=private)
        except ValueError as exc:
            raise UserError(str(exc)) from exc
        if not Path(self.path).is_dir():
            raise UserError(f"{spec.base_model} is not a model folder on this learner host")
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        model = load_causal_lm(self.path, dtype=torch.float32).to(device)
        if spec.lora is not None:
            names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
            config = LoraConfig(rank=spec.lora.rank, alpha=LORA_ALPHA, target_modules=lora_targets(spec.lora, names))
            with _seeded(spec.lora.seed):
                model = with_adapter(model, config)
        self.model, self.device = model, device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer: torch.optim.AdamW | None = None
        self.checkpoints: dict[str, list[torch.Tensor]] = {}
        self.published: dict[str, int] = {}  # checkpoint name -> the fleet version it was published as
        self.inflight: str | None = None  # the newest in-flight checkpoint: what in-flight samplers draw with
        self.steps = 0
        self.should_stop: Callable[[], bool] = lambda: False  # the host's: is the running request still wanted
        self._shadow_model: tuple[torch.dtype, Any, list[torch.Tensor]] | None = None  # (dtype, model, its params)
        self._no_room: set[torch.dtype] = set()  # shadows the device could not hold

    def info(self) -> ModelInfo:
        config = self.model.config
        return ModelInfo(tokenizer_id=self.path, arch=str(getattr(config, "model_type", "")),
                         vocab_size=config.vocab_size, max_context_length=config.max_position_embeddings)

    def forward_backward(self, payload: ForwardBackwardPayload) -> ForwardBackwardResult:
        """Per-token logprobs of each datum's targets, its loss summed into `loss:sum`; gradients accumulate
        unless `forward_only`. Datums go through in micro-batches of at most MICRO_BATCH_TOKENS padded
        tokens, each backward as soon as its losses are known to be finite; a non-finite one fails the request
        and puts the gradients back as they were before it, as does `should_stop` (checked before each
        micro-batch) turning true."""
        train = not payload.forward_only
        if train and not self.params:
            raise UserError("this model has no adapter to train (a sampling-only model): use forward")
        self._check_fits(payload)
        grads = [None if p.grad is None else p.grad.clone() for p in self.params]
        outputs: list[dict[str, list[float]]] = []
        metrics: dict[str, float] = {"loss:sum": 0.0}
        # No dropout (a base model's config may ask for it): the logprobs trained on are the ones forward and the
        # sampler give, so an on-policy ratio is 1, as Tinker's is.
        self.model.eval()
        try:
            with torch.set_grad_enabled(train):
                for rows in _micro_batches([len(d.tokens) for d in payload.data], MICRO_BATCH_TOKENS):
                    if self.should_stop():
                        raise Cancelled("cancelled: the control plane no longer waits for this request")
                    self._micro_batch(payload, rows, outputs, metrics)
        except UserError:
            for param, grad in zip(self.params, grads, strict=True):
                param.grad = grad
            raise
        return ForwardBackwardResult(outputs=outputs, metrics=metrics)

    def _check_fits(self, payload: ForwardBackwardPayload) -> None:
        """What the control plane checks at the door once it knows the model; a request queued before the
        host had loaded it gets here unchecked."""
        vocab, context = self.model.config.vocab_size, self.model.config.max_position_embeddings
        for i, datum in enumerate(payload.data):
            if max(datum.tokens) >= vocab or max(datum.target_tokens, default=0) >= vocab:
                raise UserError(f"data[{i}]: token ids must be below the vocabulary size {vocab}")
            if len(datum.tokens) > context:
                raise UserError(f"data[{i}]: {len(datum.tokens)} tokens, beyond the model's context of {context}")

    def _micro_batch(self, payload: ForwardBackwardPayload, rows: list[int], outputs: list[dict[str, list[float]]],
                     metrics: dict[str, float]) -> None:
        data = [payload.data[i] for i in rows]
        losses = []
        for i, datum, logprobs in zip(rows, data, self._target_logprobs(data), strict=True):
            inputs = {k: torch.tensor(v, device=self.device) for k, v in datum.inputs.items()}
            loss, extra = datum_loss(payload.loss_fn, logprobs, inputs, payload.loss_fn_config)
            if not torch.isfinite(loss):
                raise UserError(f"data[{i}]: the {payload.loss_fn.value} loss is not finite")
            losses.append(loss)
            outputs.append({"logprobs": logprobs.detach().cpu().tolist()})
            for key, value in extra.items():
                metrics[key] = metrics.get(key, 0.0) + value
        total = torch.stack(losses).sum()
        metrics["loss:sum"] += float(total.detach())
        if total.requires_grad:
            total.backward()

    def _target_logprobs(self, data: list[Any]) -> list[torch.Tensor]:
        """Each datum's target-token logprobs, from one right-padded forward pass."""
        width = max(len(d.tokens) for d in data)
        ids = torch.tensor([d.tokens + [0] * (width - len(d.tokens)) for d in data], device=self.device)
        mask = torch.tensor([[1] * len(d.tokens) + [0] * (width - len(d.tokens)) for d in data], device=self.device)
        targets = torch.tensor([d.target_tokens + [0] * (width - len(d.tokens)) for d in data], device=self.device)
        logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return [row[:len(d.tokens)] for row, d in zip(logprobs, data, strict=True)]

    def optim_step(self, step: AdamStep) -> dict[str, float]:
        if not self.params:
            raise UserError("this model has no adapter to train (a sampling-only model)")
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(self.params, lr=step.learning_rate)
        for group in self.optimizer.param_groups:
            group.update(lr=step.learning_rate, betas=(step.beta1, step.beta2), eps=step.eps,
                         weight_decay=step.weight_decay)
        max_norm = step.grad_clip_norm if step.grad_clip_norm > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return {"grad_norm": grad_norm, "step": float(self.steps)}

    def save(self, payload: SavePayload) -> int:
        """A sampler checkpoint's weights are kept here to sample; a state (save_weights) is the file the host
        writes, and its name, which a sampler checkpoint may share, leaves the sampler's weights alone."""
        if payload.kind is CheckpointKind.sampler:
            self.checkpoints[payload.name] = [p.detach().clone() for p in self.params]
            self.published.pop(payload.name, None)  # re-saved: no longer the weights of the version it was published as
            if payload.inflight:
                self.inflight = payload.name
        return self.steps

    def drop(self, name: str) -> None:
        """A deleted or expired sampler checkpoint: its weights are forgotten (in-flight samplers whose target it
        was fail their next request until the next in-flight save)."""
        self.checkpoints.pop(name, None)
        self.published.pop(name, None)
        if self.inflight == name:
            self.inflight = None

    def sample(self, payloads: list[SamplePayload]) -> list[SampleResult | SampleProgress]:
        """Requests of one checkpoint (or all in flight: the newest in-flight checkpoint), sampled together in one
        batch; an in-flight request one segment at a time (learner/sampling.py)."""
        wanted = {INFLIGHT if p.inflight else p.checkpoint for p in payloads}
        if len(wanted) != 1:
            raise UserError(f"one batch samples one checkpoint, not {sorted(map(str, wanted))}")
        vocab, context = self.model.config.vocab_size, self.model.config.max_position_embeddings
        if any(max(p.prompt) >= vocab for p in payloads):
            raise UserError(f"prompt token ids must be below the vocabulary size {vocab}")
        if any(len(p.prompt) + p.params.max_tokens > context for p in payloads):
            raise UserError(f"prompt + max_tokens must fit the model's context of {context} tokens")
        checkpoint = wanted.pop()
        if checkpoint == INFLIGHT:
            if self.inflight is None:
                raise UserError("this model has no in-flight checkpoint (it was deleted): save_weights_for_sampler "
                                "with kind='inflight' again")
            checkpoint = self.inflight
        self.model.eval()
        with self._weights(checkpoint):
            return sample(self.model, self.tokenizer, payloads, self.tokenizer.eos_token_id, checkpoint or "base")

    @contextlib.contextmanager
    def _weights(self, checkpoint: str | None) -> Iterator[None]:
        """The adapter as saved under `checkpoint` for the duration (None: the current one, put back after
        whatever the body swaps in)."""
        saved = self.checkpoints.get(checkpoint) if checkpoint is not None else None
        if checkpoint is not None and saved is None:
            raise UserError(f"no checkpoint {checkpoint!r} on this model")
        current = [p.detach().clone() for p in self.params]
        if saved is not None:
            with torch.no_grad():
                for param, value in zip(self.params, saved, strict=True):
                    param.copy_(value)
        try:
            yield
        finally:
            with torch.no_grad():
                for param, value in zip(self.params, current, strict=True):
                    param.copy_(value)

    def park(self, path: Path) -> None:
        """Everything a later request needs, in one file: adapter, pending gradients, optimizer, checkpoints."""
        grads = [None if p.grad is None else p.grad.detach().cpu() for p in self.params]
        _write(path, {**self._state(), "grads": grads, "published": self.published, "inflight": self.inflight,
                      "checkpoints": {k: [t.cpu() for t in v] for k, v in self.checkpoints.items()}})

    def save_state(self, path: Path) -> None:
        """A state to start from again (save_weights): the adapter and the optimizer."""
        _write(path, self._state())

    def _state(self) -> dict[str, Any]:
        return {"params": [p.detach().cpu() for p in self.params], "steps": self.steps,
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None}

    @classmethod
    def restore(cls, spec: ModelSpec, cache_dir: Path, device: str, path: Path,
                private: tuple[Path, ...] = ()) -> TinkerSession:
        """The model as `park` left it."""
        session = cls(spec, cache_dir, device, private)
        # Gone: the host's fault, not the caller's (a server error).
        state = session._read(path, FileNotFoundError("the parked state of this model is gone from the learner host"))
        session._apply(state, optimizer=True)
        for param, grad in zip(session.params, state["grads"], strict=True):
            param.grad = grad
        session.checkpoints, session.published = state["checkpoints"], state.get("published", {})
        session.inflight = state.get("inflight")
        return session

    def load_state(self, path: Path, optimizer: bool) -> None:
        """A state save_state wrote: its adapter, and its optimizer's state (else a fresh AdamW) and step count;
        pending gradients are cleared."""
        self._apply(self._read(path, UserError("that saved state is not on this learner host")), optimizer)
        for param in self.params:
            param.grad = None

    def _read(self, path: Path, missing: Exception) -> dict[str, Any]:
        if not path.is_file():
            raise missing
        state = torch.load(path, map_location=self.device, weights_only=True)
        shapes = [tuple(t.shape) for t in state["params"]]
        if shapes != [tuple(p.shape) for p in self.params]:
            raise UserError("the saved state's adapter does not fit this model (another base model or LoRA rank)")
        return state

    def _apply(self, state: dict[str, Any], optimizer: bool) -> None:
        with torch.no_grad():
            for param, value in zip(self.params, state["params"], strict=True):
                param.copy_(value)
        self.optimizer, self.steps = None, 0
        if optimizer and state["optimizer"] is not None:
            self.optimizer = torch.optim.AdamW(self.params)
            self.optimizer.load_state_dict(state["optimizer"])
            self.steps = state["steps"]

    def run(self, kind: str, payload: dict[str, Any]) -> dict[str, Any]:
        """Dispatch one request by kind; the host turns the answer into a `HostResult`."""
        if kind in ("forward", "forward_backward"):
            parsed = ForwardBackwardPayload.model_validate(payload)
            return {"forward_backward": self.forward_backward(parsed)}
        if kind == "optim_step":
            return {"metrics": self.optim_step(AdamStep.model_validate(payload))}
        if kind in ("save_weights", "save_weights_for_sampler"):
            return {"step": self.save(SavePayload.model_validate(payload))}
        if kind == "sample":
            return answer(self.sample([SamplePayload.model_validate(payload)])[0])
        if kind == "audit":
            return {"audit": self.audit(AuditPayload.model_validate(payload))}
        if kind == "drop_checkpoint":
            self.drop(str(payload["name"]))
            return {}
        raise UserError(f"unknown request kind {kind!r}")

    def audit(self, payload: AuditPayload) -> AuditVerdict:
        """Re-score a group a rollout worker drew for a fleet sample request under the checkpoint it claims
        (learner/audit.py: the worker's logprobs, and how likely its tokens are under the model); an in-flight
        group's every token under the checkpoint of its own version (`audit_versions`)."""
        named = payload.checkpoints or {payload.version: payload.checkpoint}
        for version, name in named.items():
            if self.published.get(name) != version:
                raise UserError(f"checkpoint {name!r} was saved again since version {version}: its weights are "
                                "gone, so the group cannot be audited")
        vocab = self.model.config.vocab_size
        if max(payload.prompt) >= vocab or any(t >= vocab for tokens, _ in payload.samples for t in tokens):
            return AuditVerdict(passed=False, reason=f"token ids outside the vocabulary (size {vocab})")
        self.model.eval()
        claim = GroupClaim(prompt=list(payload.prompt), samples=[(list(t), list(lp)) for t, lp in payload.samples],
                           temperature=payload.temperature, top_p=payload.top_p, top_k=payload.top_k,
                           seed=payload.seed, precision=payload.precision.value)
        low = shadow_dtype(claim.precision, torch.float32)
        shadow_at = None if low is None or not self._has_shadow(low) else (lambda v: self._shadow(named[v], low))
        if payload.versions is None:
            with self._weights(payload.checkpoint):
                result = audit_group(self.model, claim, None, shadow_at and shadow_at(payload.version))
        else:
            with self._weights(None):  # every version's weights are put in by model_at, then these put back
                result = audit_versions(lambda v: self._swap(named[v]), claim, payload.versions, None, shadow_at)
        return AuditVerdict(passed=result.passed, reason=result.reason or "", stats=result.stats())

    def _has_shadow(self, dtype: torch.dtype) -> bool:
        """Whether the audit's shadow in `dtype` (learner/audit.py) is here, made at the first group that needs
        it: a copy of the model in that precision. Where the device cannot hold it, groups are judged by their
        claim's margin, as before shadows (logged once): a worker's claim must not fail the host."""
        if self._shadow_model is None or self._shadow_model[0] != dtype:
            if dtype in self._no_room:
                return False
            try:
                model = copy.deepcopy(self.model).to(dtype).eval()
            except (torch.OutOfMemoryError, MemoryError):
                self._no_room.add(dtype)
                log.error("no memory for the audit's %s shadow: fleet groups claiming it are judged without it", dtype)
                return False
            for param in model.parameters():
                param.grad = None  # the copy's own: gradients are the model's, not the shadow's
            self._shadow_model = (dtype, model, [p for p in model.parameters() if p.requires_grad])
        return True

    def _shadow(self, checkpoint: str, dtype: torch.dtype) -> Any:
        """The shadow in `dtype` (`_has_shadow`) holding `checkpoint`'s weights."""
        assert self._shadow_model is not None and self._shadow_model[0] == dtype
        _, model, params = self._shadow_model
        with torch.no_grad():
            for param, value in zip(params, self.checkpoints[checkpoint], strict=True):
                param.copy_(value)
        return model

    def _swap(self, checkpoint: str) -> Any:
        with torch.no_grad():
            for param, value in zip(self.params, self.checkpoints[checkpoint], strict=True):
                param.copy_(value)
        return self.model

    def publish(self, order: PublishOrder, checkpoint: str, server: str, work_dir: Path) -> int:
        """Publish `checkpoint` (its adapter) as version `order.version` of the model's fleet job, after the
        base model as version 0 when the job has none yet: the learner's publisher, with this model's weights."""
        plane = ControlPlane(server, order.token, order.job_id)
        weights = LoraWeights(self.model, self.tokenizer, torch.float32)
        publisher = Publisher(plane, weights, work_dir, config=WeightsConfig(delta=False))
        try:
            if not order.base_published:
                publisher.submit(0, 0, {})  # version 0 is the base: its weights are read from the model
                publisher.wait()
            with self._weights(checkpoint):
                state = weights.snapshot()
            publisher.submit(order.version, order.version, state)
            publisher.wait()
        finally:
            publisher.close()
            plane.close()
        self.published[checkpoint] = order.version
        return order.version


def answer(result: SampleResult | SampleProgress) -> dict[str, Any]:
    """A sample request's HostResult fields: its result, or (in flight, not finished) its progress."""
    return {"progress": result} if isinstance(result, SampleProgress) else {"sample": result}


def _write(path: Path, state: dict[str, Any]) -> None:
    """Whole or not at all (atomic_file), readable by the host's user only: it is a user's model."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, 0o600) as fh:
        torch.save(state, fh)


def _micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive datums grouped so that each group's padded size (rows x longest) stays within budget."""
    groups: list[list[int]] = []
    for i, length in enumerate(lengths):
        group = groups[-1] if groups else None
        if group is None or (len(group) + 1) * max(length, *(lengths[j] for j in group)) > budget:
            groups.append([i])
        else:
            group.append(i)
    return groups


@contextlib.contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    """A fixed LoRA initialisation for a given seed, without touching the process's random state."""
    if seed is None:
        yield
        return
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)

