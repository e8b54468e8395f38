"""The train step: micro-batches, accumulation, precision, clipping, non-finite guard."""

from __future__ import annotations

import contextlib
import math

import torch

from rltune.config.schema import TrainConfig
from rltune.data.records import TrainBatch
from rltune.learner.microbatch import split_by_tokens
from rltune.learner.objectives import Objective, logprobs_only
from rltune.learner.optim import build_optimizer, build_schedule
from rltune.metrics.types import Aggregator, Histogram, Last, Mean, Metric, Sum
from rltune.models.load import is_moe


class NonFiniteError(RuntimeError):
    """Raised after ``train.max_nonfinite_steps`` consecutive steps with a non-finite gradient."""


class LocalLearner:
    """Learner protocol on one torch module in this process."""

    def __init__(
        self,
        model: torch.nn.Module,
        objective: Objective,
        cfg: TrainConfig,
        *,
        temperature: float = 1.0,
        aux_loss_coef: float = 0.0,
        updates_per_step: int = 1,
    ) -> None:
        self.model = model
        self.objective = objective
        self.cfg = cfg
        self.temperature = temperature
        self.aux_loss_coef = aux_loss_coef
        self.optimizer = build_optimizer(model.parameters(), cfg)
        self.schedule = build_schedule(self.optimizer, cfg, updates_per_step=updates_per_step)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.moe = hasattr(model, "config") and is_moe(model)
        self.nonfinite_in_a_row = 0
        self.nonfinite_total = 0
        self.version = 0

    def step(self, batch: TrainBatch) -> dict[str, Metric]:
        """One optimizer step on ``batch``; returns the step's metrics, typed (means
        weighted by each micro-batch's ``objective.metric_weight``)."""
        self.model.train()
        denominator = self.objective.denominator(batch)
        agg = Aggregator()
        total_loss = torch.zeros(())
        load = None
        for mb in split_by_tokens(batch, self.cfg.micro_batch_tokens, unit=self.objective.unit):
            with self._autocast():
                out = self.objective.forward(
                    self.model, mb, temperature=self.temperature, router_logits=self.moe
                )
            loss, metrics = self.objective.loss(out, mb, denominator)
            if out.aux_loss is not None and self.aux_loss_coef > 0:
                share = len(mb) / len(batch)
                loss = loss + self.aux_loss_coef * share * out.aux_loss.float()
                metrics["aux_loss"] = out.aux_loss.detach().float()
            mb_load = getattr(out, "expert_load", None)
            if mb_load is not None:
                load = mb_load if load is None else load + mb_load
            loss.backward()
            total_loss += loss.detach().float()
            # values stay tensors through the micro-batches and become floats once per step
            agg.add(metrics, weight=self.objective.metric_weight(mb).detach().float())
        # a loss, and each named part of it (``loss/...``), is the sum of its micro-batch
        # parts; across steps and updates it is averaged
        result = {k: Mean(m.value) if k.startswith("loss/") and isinstance(m, Sum) else m
                  for k, m in agg.result().items()}
        result["loss"] = Mean(float(total_loss))
        result.update(self._apply_gradients())
        result["tokens"] = Sum(float(batch.loss_mask.sum()))
        if load is not None:
            result.update(expert_load_metrics(load))
        return result

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, C]`` per-token log-probs of ``batch`` under the current weights, no grad."""
        return self.predict(batch, logprobs_only, "logprobs")

    def values(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, C]`` critic values of ``batch`` (for a learner with a value objective)."""
        return self.predict(batch, self.objective.forward, "values")

    def predict(self, batch: TrainBatch, forward, field: str) -> torch.Tensor:
        """The ``field`` of ``forward`` on ``batch``, in eval mode, without gradient, in
        row chunks within the micro-batch token budget."""
        self.model.eval()
        return predict(
            self.model, forward, batch, field,
            budget=self.cfg.micro_batch_tokens, temperature=self.temperature, autocast=self._autocast,
        )

    def _apply_gradients(self) -> dict[str, Metric]:
        """Clip and step, or skip the step when the gradient norm is not finite."""
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip is not None else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm, foreach=True))
        lr = self.schedule.get_last_lr()[0]
        finite = math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
            self.schedule.step()
            self.nonfinite_in_a_row = 0
            self.version += 1
        else:
            self.nonfinite_in_a_row += 1
            self.nonfinite_total += 1
        self.optimizer.zero_grad(set_to_none=True)
        if self.nonfinite_in_a_row >= self.cfg.max_nonfinite_steps:
            raise NonFiniteError(
                f"{self.nonfinite_in_a_row} steps in a row had a non-finite gradient norm "
                f"({grad_norm}); stopping. Lower `train.lr`, set `train.grad_clip`, or check "
                "the rewards and data for extreme values."
            )
        return {
            "grad_norm": Mean(grad_norm),
            "lr": Last(lr),
            "skipped": Sum(float(not finite)),
            "nonfinite_total": Last(float(self.nonfinite_total)),
        }

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.cfg.precision == "bf16":
            device = next(self.model.parameters()).device.type
            return torch.autocast(device_type=device, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def export_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}


def expert_load_metrics(load: torch.Tensor, *, per_expert_up_to: int = 16) -> dict[str, Metric]:
    """How evenly an MoE model's routing spread over its experts in one step.

    ``load`` ``[L, E]``: routing choices per layer and expert. Each expert's share of its
    layer's choices is scaled by ``E``, so 1.0 is a perfectly even load: ``moe/load_max``
    (the busiest expert of any layer), ``moe/load_min`` (the idlest), ``moe/load/eI``
    (expert I averaged over layers, for models with at most ``per_expert_up_to`` experts)
    and the histogram ``moe/expert_load`` of every layer's experts."""
    layers, experts = load.shape
    share = load / load.sum(-1, keepdim=True).clamp(min=1) * experts  # [L, E]
    metrics: dict[str, Metric] = {
        "moe/load_max": Mean(float(share.max())),
        "moe/load_min": Mean(float(share.min())),
        "moe/expert_load": Histogram(share.reshape(-1)),
    }
    if experts <= per_expert_up_to:
        metrics.update({f"moe/load/e{i}": Mean(float(v)) for i, v in enumerate(share.mean(0))})
    return metrics


@torch.no_grad()
def predict(
    model: torch.nn.Module,
    forward,
    batch: TrainBatch,
    field: str,
    *,
    budget: int,
    temperature: float = 1.0,
    autocast=contextlib.nullcontext,
) -> torch.Tensor:
    """``getattr(forward(model, rows), field)`` for all rows of ``batch``, ``[B, C]``
    float32, computed on consecutive row chunks whose padded size fits ``budget``."""
    rows = max(1, budget // batch.input_ids.shape[1])
    parts = []
    for i in range(0, len(batch), rows):
        with autocast():
            out = forward(model, batch.select(slice(i, i + rows)), temperature=temperature, router_logits=False)
        parts.append(getattr(out, field).float())
    return torch.cat(parts)
