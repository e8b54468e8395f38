"""The train step: micro-batches, accumulation, precision, clipping, non-finite guard."""

from __future__ import annotations

import contextlib
import ctypes
import math
import sys

import torch

from rltune.config import ConfigError
from rltune.config.schema import TrainConfig
from rltune.data.records import TrainBatch
from rltune.learner.memory import prepare_memory
from rltune.learner.compiled import compile_blocks
from rltune.learner.microbatch import split_by_tokens
from rltune.learner.objectives import Objective, logprobs_only
from rltune.learner.optim import build_optimizer, build_schedule
from rltune.learner.parallel import NoParallelism, Parallelism, StepPlan
from rltune.learner.precision import convert_fp8, learner_precision
from rltune.learner.selective import select_rows
from rltune.metrics import keys
from rltune.metrics.types import Aggregator, Last, Mean, Metric, Sum
from rltune.models.load import is_moe
from rltune.models.replay import forget, replayed_metrics
from rltune.models.routing import agreement_metrics, expert_load_metrics, update_routing_bias
from rltune.models.shared_prompt import shares_prompts


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""glibc's ``mallopt`` parameters (``<malloc.h>``)."""

HEAP_KEEP_BYTES = 1 << 30
"""Free memory at the top of the heap that glibc keeps instead of handing it back."""

MMAP_ABOVE_BYTES = 32 << 20
"""Blocks at least this large come from ``mmap`` (glibc's ceiling for the threshold on a 64-bit host)."""


def keep_freed_heap() -> bool:
    """Let glibc's ``malloc`` reuse the memory a train step frees in the next step, rather
    than returning it to the kernel and taking it back page by page.

    A CPU step allocates and frees the same activations every time (at 3 M parameters
    about 1.2 MB each). With glibc's defaults (a dynamic mmap threshold from 128 kB, and
    a trim threshold twice it) such blocks are often mapped and unmapped, or trimmed off
    the heap, each step: about 1,300-1,800 page faults a step (5-7 MB zero-filled by the
    kernel) in the GRPO benchmark's learner, some 3-5 ms of its ~85 ms. Fixing both
    thresholds (``mallopt(3)``: ``M_MMAP_THRESHOLD`` 32 MB, ``M_TRIM_THRESHOLD`` 1 GB)
    leaves about 1 fault a step. The cost is that the process keeps its peak heap. It
    applies to the whole process; values do not change. Returns whether it was applied:
    only on Linux with glibc (other C libraries have no such parameters)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl names its library otherwise)
        return False
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_ABOVE_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, HEAP_KEEP_BYTES))


class NonFiniteError(RuntimeError):
    """Raised after ``train.max_nonfinite_steps`` consecutive steps with a non-finite gradient."""


class LocalLearner:
    """Learner protocol on one torch module in this process.

    ``parallelism`` says how this process's step cooperates with the other ranks of a
    learner group (:mod:`rltune.learner.parallel`): ``NoParallelism()`` (the default)
    trains alone; with ``DDP()`` or ``FSDP2()`` every rank calls every method together,
    each with its own shard of the global batch
    (:func:`rltune.learner.distributed.shard_batch`), and the update and the metrics
    are the group's: those of one learner on the whole batch. ``model`` stays the plain
    module (FSDP2 shards it in place); ``train_module`` is what training forwards go
    through (the DDP wrapper, or ``model``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        objective: Objective,
        cfg: TrainConfig,
        *,
        parallelism: Parallelism | None = None,
        temperature: float = 1.0,
        aux_loss_coef: float = 0.0,
        updates_per_step: int = 1,
        skip_zero_advantage: bool = False,
    ) -> None:
        self.parallelism = parallelism if parallelism is not None else NoParallelism()
        keep_freed_heap()  # a step's activations reuse the last step's memory, without page faults
        if cfg.precision == "fp8":  # the float8 linears replace nn.Linear before any wrapper sees them
            convert_fp8(model)
        prepare_memory(model, cfg, self.parallelism)  # activation checkpointing, offload: before wrapping
        if cfg.compile:  # after checkpointing (compiled with it), before DDP/FSDP2 wrap the blocks
            compile_blocks(model)
        self.train_module = self.parallelism.wrap(model)
        self.precision = learner_precision(cfg.precision, model, self.parallelism)
        self.model = model
        self.objective = objective
        self.cfg = cfg
        self.temperature = temperature
        self.aux_loss_coef = aux_loss_coef
        self.optimizer = build_optimizer(model.parameters(), cfg)
        self.schedule = build_schedule(self.optimizer, cfg, updates_per_step=updates_per_step)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.moe = hasattr(model, "config") and is_moe(model)
        if skip_zero_advantage and self.moe and aux_loss_coef > 0:  # the model's own coefficient too
            raise ConfigError(
                f"algo.skip_zero_advantage with an MoE model whose router load-balancing loss is on "
                f"(coefficient {aux_loss_coef}): that loss depends on the routing of every row, so "
                "skipping a row would change the update; set model.router_aux_loss_coef: 0, or "
                "algo.skip_zero_advantage: false"
            )
        self.skip_zero_advantage = skip_zero_advantage
        self.nonfinite_in_a_row = 0
        self.nonfinite_total = 0
        self.version = 0

    def step(self, batch: TrainBatch) -> dict[str, Metric]:
        """One optimizer step on ``batch``; returns the step's metrics, typed (means
        weighted by each micro-batch's ``objective.metric_weight``)."""
        batch = self.parallelism.place(batch)
        # selective backprop: only rows with an advantage run; the denominator stays the whole batch's
        selection = select_rows(batch, self.objective.unit) if self.skip_zero_advantage else None
        run = selection.rows if selection is not None else batch
        micro = split_by_tokens(run, self.cfg.micro_batch_tokens, unit=self.objective.unit,
                                shared=shares_prompts(self.train_module))
        plan = self.parallelism.agree(len(batch), len(micro), self.objective.denominator(batch))
        self.train_module.train()
        pipe = getattr(self.parallelism, "pipeline", None)
        if pipe is not None:  # the stages run the micro-batches; the loss is the last stage's
            total_loss, parts = pipe.train(micro, plan.forwards, self.objective, plan.denominator,
                                           temperature=self.temperature, autocast=self._autocast,
                                           aux_loss_coef=self.aux_loss_coef if self.moe else 0.0)
            load = None
        else:
            total_loss, load, parts = self._accumulate(batch, micro, plan)
        # a loss, and each named part of it (``loss/...``), is the sum of its micro-batch
        # parts; across steps and updates it is averaged
        measured = {k: Mean(m.value) if keys.is_loss_part_key(k) and isinstance(m, Sum) else m
                    for k, m in parts.items()}
        measured[keys.LOSS] = Mean(float(total_loss))
        measured[keys.TOKENS] = Sum(float(batch.loss_mask.sum()))
        if selection is not None:
            measured.update(selection.metrics())
        measured.update(replayed_metrics(self.model))
        applied = self._apply_gradients()  # the same on every rank: not combined
        forget(self.model)  # the decode's records are of the old weights (an offloaded optimizer steps copies)
        result = {**self.parallelism.all_reduce_metrics(measured), **applied}
        if load is not None:
            load = self.parallelism.sum(load)
            result.update(expert_load_metrics(load))
            update_routing_bias(self.model, load)  # aux-free balancing, after the optimizer step
        return result

    def _accumulate(self, batch: TrainBatch, micro: list[TrainBatch], plan: StepPlan
                    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Metric]]:
        """Forward and backward of every micro-batch in this process (then padding
        forwards up to ``plan.forwards``); returns the summed loss, the MoE routing counts
        and the step's metrics."""
        agg = Aggregator()
        total_loss = load = None
        for index in range(plan.forwards):
            with self.parallelism.gradient_sync(self.train_module, sync=index == plan.forwards - 1):
                if index >= len(micro):
                    self._pad_forward(batch)
                    continue
                loss, mb_load = self._learn(micro[index], plan.denominator, len(batch), agg)
            total_loss = loss if total_loss is None else total_loss + loss
            if mb_load is not None:
                load = mb_load if load is None else load + mb_load
        return total_loss, load, agg.result()

    def _learn(self, mb: TrainBatch, denominator: torch.Tensor, rows: int,
               agg: Aggregator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward and backward of one micro-batch of a ``rows``-row batch, its metrics
        added to ``agg``; returns its loss (detached, fp32) and MoE routing counts."""
        with self._autocast():
            out = self.objective.forward(
                self.train_module, mb, temperature=self.temperature, router_logits=self.moe
            )
        loss, metrics = self.objective.loss(out, mb, denominator)
        if out.aux_loss is not None and self.aux_loss_coef > 0:
            share = len(mb) / rows
            loss = loss + self.aux_loss_coef * share * out.aux_loss.float()
            metrics["aux_loss"] = out.aux_loss.detach().float()
        self.precision.scale(loss).backward()  # fp16: times the loss scale
        # values stay tensors through the micro-batches and become floats once per step
        agg.add(metrics, weight=self.objective.metric_weight(mb).detach().float())
        agg.add(agreement_metrics(getattr(out, "route_agreement", None)))
        load = getattr(out, "expert_load", None)
        return loss.detach().float(), load

    def _pad_forward(self, batch: TrainBatch) -> None:
        """A forward, and a zero backward, on the batch's first unit of rows: it adds
        nothing to the gradient, and lets this rank take part in the collectives of a
        forward that a busier rank runs (:class:`~rltune.learner.parallel.StepPlan`)."""
        rows = batch.select(slice(0, self.objective.unit)).trim()
        with self._autocast():
            out = self.objective.forward(self.train_module, rows, temperature=self.temperature, router_logits=self.moe)
        outputs = [t for t in vars(out).values() if isinstance(t, torch.Tensor) and t.requires_grad]
        if outputs:
            torch.autograd.backward(outputs, [torch.zeros_like(t) for t in outputs])

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, C]`` per-token log-probs of ``batch`` under the current weights, no grad."""
        return self.predict(batch, logprobs_only, "logprobs")

    def values(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, C]`` critic values of ``batch`` (for a learner with a value objective)."""
        return self.predict(batch, self.objective.forward, "values")

    def predict(self, batch: TrainBatch, forward, field: str) -> torch.Tensor:
        """The ``field`` of ``forward`` on ``batch``, in eval mode, without gradient, in
        row chunks within the micro-batch token budget, one forward each. In a group
        whose forwards are collectives (FSDP2), a rank with fewer chunks than another
        runs extra forwards on one row (results dropped) until the counts match."""
        batch = self.parallelism.place(batch)
        chunks = -(-len(batch) // chunk_rows(batch, self.cfg.micro_batch_tokens))
        plan = self.parallelism.agree(len(batch), chunks, None)
        self.model.eval()
        pipe = getattr(self.parallelism, "pipeline", None)
        if pipe is not None:  # forward only through the stages; every rank gets the result
            rows = chunk_rows(batch, self.cfg.micro_batch_tokens)
            chunks = [batch.select(slice(i, i + rows)) for i in range(0, len(batch), rows)]
            return pipe.predict(chunks, plan.forwards, forward, field,
                                temperature=self.temperature, autocast=self._autocast)
        out = predict(
            self.model, forward, batch, field,
            budget=self.cfg.micro_batch_tokens, temperature=self.temperature, autocast=self._autocast,
        )
        first = batch.select(slice(0, 1))
        with torch.no_grad():
            for _ in range(plan.forwards - chunks):
                with self._autocast():
                    forward(self.model, first, temperature=self.temperature, router_logits=False)
        return out

    def _apply_gradients(self) -> dict[str, Metric]:
        """Clip and step, or skip the step when the gradient norm is not finite. With
        fp16 the gradients are unscaled first (the clip sees true values); a step whose
        scaled gradient overflowed is skipped as an overflow, not as a non-finite step."""
        overflow = self.precision.unscale(self.optimizer)  # the same on every rank
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip is not None else math.inf
        grad_norm = float(self.parallelism.clip_grad_norm(self.params, max_norm))  # decides the step
        lr = self.schedule.get_last_lr()[0]
        finite = math.isfinite(grad_norm) and not overflow
        if finite:
            self.optimizer.step()
            self.schedule.step()
            self.nonfinite_in_a_row = 0
            self.version += 1
        elif not overflow:
            self.nonfinite_in_a_row += 1
            self.nonfinite_total += 1
        self.precision.update(overflow)
        self.optimizer.zero_grad(set_to_none=True)
        if self.nonfinite_in_a_row >= self.cfg.max_nonfinite_steps:
            raise NonFiniteError(
                f"{self.nonfinite_in_a_row} steps in a row had a non-finite gradient norm "
                f"({grad_norm}); stopping. Lower `train.lr`, set `train.grad_clip`, or check "
                "the rewards and data for extreme values."
            )
        return {
            keys.GRAD_NORM: Mean(grad_norm),
            keys.LR: Last(lr),
            "skipped": Sum(float(not finite)),
            "nonfinite_total": Last(float(self.nonfinite_total)),
            **self.precision.metrics(overflow),
        }

    def _autocast(self) -> contextlib.AbstractContextManager:
        return self.precision.autocast()

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The full weights (in a group, on every rank: FSDP2 gathers them)."""
        return self.parallelism.full_state_dict(self.model)


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
    float32, computed on consecutive chunks of :func:`chunk_rows` rows."""
    rows = chunk_rows(batch, budget)
    parts = []
    for i in range(0, len(batch), rows):
        with autocast():
            out = forward(model, batch.select(slice(i, i + rows)), temperature=temperature, router_logits=False)
        parts.append(getattr(out, field).float())
    return torch.cat(parts)


def chunk_rows(batch: TrainBatch, budget: int) -> int:
    """How many of ``batch``'s rows one no-grad forward takes: as many as fit ``budget``
    padded tokens, at least one."""
    return max(1, budget // batch.input_ids.shape[1])
