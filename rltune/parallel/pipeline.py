"""Pipeline parallelism: a Hugging Face decoder cut into ``pp`` stages by layer, run with
``torch.distributed.pipelining`` (``ScheduleGPipe`` or ``Schedule1F1B``).

**Stages.** :func:`split_model` keeps, on this rank, only its stage's part of the model
*in place* (the other layers, and the embeddings or the final norm and head it does not
own, become ``None``), so parameter names stay the model's own and the optimizer,
checkpoints and exports see the same names as one process. Layers are split evenly; the
remainder goes to the first stages, because the last stage also runs the head and the
loss. Every stage recomputes the position ids, the causal mask and the rotary phases from
the attention mask, which reaches every stage as a keyword argument (the ranks along
``pp`` hold the same rows), so only the hidden states travel between stages.

**The head runs inside the last stage's forward** (the LM head on the completion
positions, a critic's value head, or a reward model's score head, by the objective's
forward): with FSDP2 over the stage the head's weights are then gathered by the stage's
own hooks. The loss of every rltune objective is computed on the last stage, by the
schedule's ``loss_fn``, with the step's whole-batch denominator
(:class:`~rltune.learner.parallel.StepPlan`), on exactly the micro-batch's own rows and
columns.

**Equal micro-batches.** The schedules receive into buffers of one shape, so the
token-budget micro-batches of a step are padded to one shape: prompts on the left and
completions on the right to the longest, rows with copies of a real row. The loss takes
only the real rows and columns back, so padding adds nothing to the gradient; it costs
compute (at most the largest micro-batch times their count).

**Tied embeddings** (``tie_word_embeddings``): the last stage holds a copy of the
embedding matrix as its LM head. After each step's backward the two gradients are summed
over the first and last stages, so both copies take the same (one-process) gradient and
the same optimizer update and stay equal; the gradient norm counts the matrix once.

**What the group sees.** The loss, the metrics and no-grad predictions are computed on the
last stage and broadcast over the ``pp`` ranks; the gradient norm is the whole model's
(the stages' squared norms summed). MoE router losses are not collected across stages:
``aux_loss_coef > 0`` with ``pp > 1`` is refused.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from rltune.data.records import TrainBatch
from rltune.learner.objectives import Objective, logprob_forward
from rltune.metrics.types import Aggregator, Metric
from rltune.models.chunked import chunked_stats
from rltune.models.logprobs import LogProbOutput, position_ids_from_mask
from rltune.parallel.layout import PP_AUX_FREE_BIAS, PP_AUX_LOSS, PP_ROUTING_REPLAY, PP_SEQUENCE_PARALLEL

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - older torch
    DTensor = ()

SCHEDULES: dict[str, type] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
"""``train.parallel.pp_schedule`` -> the torch schedule."""


# ----------------------------------------------------------------------------- stages


def stage_layer_ranges(num_layers: int, stages: int) -> list[range]:
    """The decoder layers of each stage: ``num_layers // stages`` each, one more for the
    first ``num_layers % stages`` stages (the last stage also runs the head and loss)."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"pipeline parallelism: pp={stages} stages for a model of {num_layers} decoder "
                         f"layer(s); every stage needs at least one layer, so pp must be 1..{num_layers}")
    base, extra = divmod(num_layers, stages)
    sizes = [base + (1 if s < extra else 0) for s in range(stages)]
    starts = [sum(sizes[:s]) for s in range(stages)]
    return [range(a, a + n) for a, n in zip(starts, sizes)]


def decoder_body(model: nn.Module) -> nn.Module:
    """The transformer body of ``model`` (a causal LM's ``model``, a critic's ``body``, a
    reward model's base model), checked for the parts a stage runs."""
    body = getattr(model, "body", None)
    if body is None:
        body = getattr(model, "base_model", None)
    missing = [name for name in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(body, name)]
    if body is None or body is model or missing:
        raise TypeError(
            f"pipeline parallelism splits Llama-family decoders (embed_tokens, layers, norm, rotary_emb); "
            f"{type(model).__name__}'s body {type(body).__name__} lacks {missing or 'a separate body'}"
        )
    return body


def _head_name(model: nn.Module) -> str | None:
    """The attribute of ``model`` that holds its head on the last stage."""
    for name in ("lm_head", "head", "score"):
        if isinstance(getattr(model, name, None), nn.Module):
            return name
    return None


class StageModule(nn.Module):
    """One stage of the pipeline: ``forward(x, attention_mask=, input_ids=)`` takes token
    ids (first stage) or hidden states and returns hidden states, or, on the last stage,
    what :attr:`head` makes of the final normed states. ``model`` is the pruned model
    (registered, so the stage's parameters are the model's own, under the model's names
    with a ``model.`` prefix)."""

    def __init__(self, model: nn.Module, index: int, stages: int, layers: range) -> None:
        super().__init__()
        self.model = model
        self.index, self.stages, self.layers = index, stages, layers
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.wire_dtype = next(model.parameters()).dtype
        self.head: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        """Set per call on the last stage: ``(hidden, attention_mask) -> output``."""
        self.autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    @property
    def body(self) -> nn.Module:
        return decoder_body(self.model)

    @property
    def config(self) -> Any:
        return self.body.config  # a critic has no config of its own, its body has

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        with self.autocast():
            hidden = self._layers(x, attention_mask)
            if not self.is_last:  # tensor parallel without sequence parallel: replicated
                return (hidden.to_local() if isinstance(hidden, DTensor) else hidden).to(self.wire_dtype)
            if self.head is None:
                raise RuntimeError("the last pipeline stage ran without a head (set by Pipeline.train/predict)")
            return self.head(hidden, attention_mask, input_ids)

    def _layers(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """This stage's decoder layers as the body's forward runs them (same masks,
        positions and rotary phases), then the final norm on the last stage."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        body = self.body
        position_ids = position_ids_from_mask(attention_mask)
        hidden = body.embed_tokens(x) if self.is_first else x
        mask_kwargs = {"config": body.config, "inputs_embeds": hidden, "attention_mask": attention_mask,
                       "cache": None, "position_ids": position_ids}
        masks = {"full_attention": create_causal_mask(**mask_kwargs)}
        layer_types = getattr(body.config, "layer_types", None)
        if "sliding_attention" in (layer_types or ()):
            masks["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs)
        phases = body.rotary_emb(hidden, position_ids)
        for i in self.layers:
            hidden = body.layers[i](
                hidden, attention_mask=masks[layer_types[i] if layer_types else "full_attention"],
                position_ids=position_ids, position_embeddings=phases, cache=None, use_cache=False,
            )
        return body.norm(hidden) if self.is_last else hidden


def split_model(model: nn.Module, index: int, stages: int) -> StageModule:
    """Keep only stage ``index`` of ``stages`` of ``model``, in place, and return it as a
    :class:`StageModule`. A tied LM head on a last stage that is not the first becomes a
    copy of the embedding matrix (kept equal by :meth:`Pipeline.sync_tied`)."""
    body = decoder_body(model)
    ranges = stage_layer_ranges(len(body.layers), stages)
    first, last = index == 0, index == stages - 1
    head = _head_name(model)
    embed = body.embed_tokens
    if head == "lm_head" and last and not first and model.lm_head.weight is embed.weight:
        model.lm_head.weight = nn.Parameter(embed.weight.detach().clone())
    for i in range(len(body.layers)):
        if i not in ranges[index]:
            body.layers[i] = None
    if not first:
        body.embed_tokens = None
    if not last:
        body.norm = None
        if head is not None:
            setattr(model, head, None)
    return StageModule(model, index, stages, ranges[index])


def is_tied(model: nn.Module) -> bool:
    """Whether ``model`` (before :func:`split_model`) shares its embedding matrix with its LM head."""
    return getattr(getattr(model, "lm_head", None), "weight", None) is decoder_body(model).embed_tokens.weight


# ----------------------------------------------------------------------------- heads


def head_kind(forward: Callable[..., Any]) -> tuple[str, bool]:
    """``(kind, with_entropy)`` of an objective's forward: ``logprobs`` (the policy, SFT
    and preference forwards), ``values`` (a critic) or ``scores`` (a reward model)."""
    from rltune.learner.preference import score_forward
    from rltune.models.value import value_forward

    func = forward.func if isinstance(forward, functools.partial) else forward
    keywords = forward.keywords if isinstance(forward, functools.partial) else {}
    if func is logprob_forward:
        return "logprobs", bool(keywords.get("with_entropy", True))
    if func is value_forward:
        return "values", False
    if func is score_forward:
        return "scores", False
    raise ValueError(f"pipeline parallelism runs the forwards logprob_forward, value_forward and score_forward; "
                     f"this objective's forward is {getattr(func, '__qualname__', func)!r}")


def _stage_head(model: nn.Module, kind: str, prompt_len: int, temperature: float, with_entropy: bool
                ) -> Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]:
    """The last stage's ``(hidden, attention_mask, input_ids) -> float32 output`` for
    ``kind``: ``[B, C, 2]`` log-probs and entropy at the completion positions ``P-1 .. T-2``
    (the LM head in chunks, :func:`rltune.models.chunked.chunked_stats`: the ``[B, C, V]``
    logits never leave the stage), the critic's values at the same positions, or the score
    at each row's last attended token."""
    if kind == "logprobs":
        def stats(h: torch.Tensor, mask: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            logp, entropy = chunked_stats(model, h[:, prompt_len - 1 : -1], ids[:, prompt_len:],
                                          mask[:, prompt_len:].bool(), temperature=temperature, with_entropy=with_entropy)
            return torch.stack([logp, entropy if entropy is not None else torch.zeros_like(logp)], dim=-1)
        return stats
    if kind == "values":
        return lambda h, mask, ids: model.head(h[:, prompt_len - 1 : -1].float()).squeeze(-1)
    from rltune.models.reward_model import SCORE_HEAD, last_attended_index

    def score(h: torch.Tensor, mask: torch.Tensor, ids: Any) -> torch.Tensor:
        rows = torch.arange(len(h), device=h.device)
        return getattr(model, SCORE_HEAD)(h[rows, last_attended_index(mask)]).squeeze(-1).float()

    return score


def stage_output(kind: str, out: torch.Tensor, mb: TrainBatch, *, temperature: float, with_entropy: bool) -> Any:
    """What the objective's forward would have returned for ``mb`` from the last stage's
    padded output ``out`` (its first ``len(mb)`` rows and first completion columns are
    ``mb``'s own)."""
    from rltune.learner.preference import ScoreOutput
    from rltune.models.value import ValueOutput

    rows, width = len(mb), mb.completion_len
    if kind == "scores":
        return ScoreOutput(scores=out[:rows])
    valid = mb.attention_mask[:, mb.prompt_len :].bool()
    if kind == "values":
        values = out[:rows, :width]
        return ValueOutput(values=torch.where(valid, values, values.new_zeros(())))
    stats = out[:rows, :width]  # the stage's [B, C, 2] log-probs and entropy, at ``temperature``
    return LogProbOutput(logprobs=stats[..., 0], entropy=stats[..., 1].detach() if with_entropy else None)


# ----------------------------------------------------------------------------- equal micro-batches


@dataclass
class EqualBatches:
    """A step's micro-batches padded to one shape and stacked: ``input_ids`` and
    ``attention_mask`` ``[count * rows, P + C]`` (the schedule cuts them into ``count``
    equal chunks)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_len: int
    rows: int
    count: int

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]


def equalise(micro: list[TrainBatch], count: int) -> EqualBatches:
    """``micro`` padded to one shape (prompts left, completions right, rows with copies of
    the first row), then ``count - len(micro)`` copies of the first one (forwards a
    lockstep group runs with no rows of its own; their loss is zero)."""
    if not micro or count < len(micro):
        raise ValueError(f"equalise: {len(micro)} micro-batch(es) into {count} forwards")
    if any(m.vision is not None for m in micro):
        raise ValueError("pipeline parallelism (train.parallel.pp > 1) runs token ids only, and this batch "
                         "has images: train a vision-language model with pp: 1")
    rows = max(len(m) for m in micro)
    prompt = max(m.prompt_len for m in micro)
    completion = max(m.completion_len for m in micro)
    ids, masks = [], []
    for k in range(count):
        m = micro[k] if k < len(micro) else micro[0]
        pad = (prompt - m.prompt_len, completion - m.completion_len)
        for out, t in ((ids, m.input_ids), (masks, m.attention_mask)):
            t = torch.nn.functional.pad(t, pad, value=0)
            out.append(torch.cat([t, t[:1].expand(rows - len(t), -1)]) if len(t) < rows else t)
    return EqualBatches(torch.cat(ids), torch.cat(masks), prompt, rows, count)


# ----------------------------------------------------------------------------- the pipeline


class Pipeline:
    """This rank's stage and the schedule that runs it with the other ``pp`` ranks.

    Built by :func:`build_pipeline`; the learner hands it a step's micro-batches
    (:meth:`train`) or a prediction's row chunks (:meth:`predict`); the strategy sums the
    stages' squared gradient norms over :attr:`group` (leaving :attr:`tied_copy` out) and
    asks it for the full weights (:meth:`full_state_dict`)."""

    def __init__(self, stage: StageModule, mesh: Any, *, schedule: str, device: torch.device, tied: bool) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"train.parallel.pp_schedule={schedule!r}; expected one of {sorted(SCHEDULES)}")
        self.stage, self.device, self.schedule = stage, device, schedule
        self.group = mesh["pp"].get_group()
        self.last_rank = dist.get_global_rank(self.group, stage.stages - 1)
        self.tied_group = _ends_group(mesh) if tied else None
        self.tied = tied

    @property
    def tied_copy(self) -> torch.Tensor | None:
        """The last stage's copy of a tied embedding matrix (the gradient norm counts the
        matrix once, the first stage's, and clips both). Looked up at each call: FSDP2
        replaces the module's parameters when it shards them."""
        return self.stage.model.lm_head.weight if self.tied and self.stage.is_last else None

    def train(self, micro: list[TrainBatch], forwards: int, objective: Objective, denominator: torch.Tensor, *,
              temperature: float, autocast: Callable[[], Any], aux_loss_coef: float = 0.0
              ) -> tuple[float, dict[str, Metric]]:
        """Forward and backward of ``micro`` (run as ``forwards`` pipeline micro-batches:
        the extra ones have zero loss) through the schedule, the loss on the last stage
        divided by ``denominator``; returns the step's loss and metrics, the same on every
        ``pp`` rank. The gradients are this stage's (tied copies summed)."""
        if aux_loss_coef > 0:
            raise ValueError(PP_AUX_LOSS.format(coef=aux_loss_coef))
        # recorded routes (an MoE policy's samples carry them with replay off too) are not
        # given to the stages: their routers choose by themselves, as replay off means
        # (a router that replays is refused by build_pipeline)
        kind, with_entropy = head_kind(objective.forward)
        agg, losses = Aggregator(), []

        def loss_fn(out: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            k = int(index[0])
            if k >= len(micro):  # a lockstep forward without rows: no gradient, no metric
                return out.sum() * 0.0
            mb = micro[k]
            result = stage_output(kind, out, mb, temperature=temperature, with_entropy=with_entropy)
            loss, metrics = objective.loss(result, mb, denominator)
            agg.add(metrics, weight=objective.metric_weight(mb).detach().float())
            losses.append(loss.detach().float())
            return loss

        self._run(equalise(micro, self._count(forwards)), (kind, temperature, with_entropy), autocast, loss_fn=loss_fn)
        self.sync_tied()
        total = float(torch.stack(losses).sum()) if self.stage.is_last else None
        return self._share(total, agg.result() if self.stage.is_last else None)

    @torch.no_grad()
    def predict(self, chunks: list[TrainBatch], forwards: int, forward: Callable[..., Any], field: str, *,
                temperature: float, autocast: Callable[[], Any]) -> torch.Tensor:
        """``field`` of ``forward``'s output on every row of ``chunks`` (consecutive rows of
        one batch), ``[B, C]`` float32 (a reward model's scores: ``[B]``) on every ``pp``
        rank: forward only, through the schedule, the head on the last stage, then broadcast."""
        kind, with_entropy = head_kind(forward)
        rows = sum(len(c) for c in chunks)
        shape = (rows,) if kind == "scores" else (rows, chunks[0].completion_len)
        result = torch.empty(shape, dtype=torch.float32, device=self.device)
        count = self._count(forwards)
        out = self._run(equalise(chunks, count), (kind, temperature, with_entropy), autocast, loss_fn=None)
        if self.stage.is_last:
            size = len(out) // count
            parts = [getattr(stage_output(kind, out[k * size : (k + 1) * size], c, temperature=temperature,
                                          with_entropy=with_entropy), field).float()
                     for k, c in enumerate(chunks)]
            result.copy_(torch.cat(parts))
        dist.broadcast(result, src=self.last_rank, group=self.group)
        return result

    def _count(self, forwards: int) -> int:
        """How many pipeline micro-batches run ``forwards`` forwards: 1F1B needs at least
        one per stage (the extra ones are padding, with zero loss)."""
        return max(forwards, self.stage.stages) if self.schedule == "1f1b" else forwards

    def _run(self, equal: EqualBatches, head: tuple[str, float, bool], autocast: Callable[[], Any], *,
             loss_fn: Callable[..., torch.Tensor] | None) -> torch.Tensor | None:
        """One schedule step over ``equal``: with ``loss_fn`` forward and backward, else
        forward only (returns the last stage's outputs, stacked)."""
        stage = self.stage
        stage.autocast = autocast
        kind = head[0]  # (kind, temperature, with_entropy)
        stage.head = _stage_head(stage.model, kind, equal.prompt_len, *head[1:]) if stage.is_last else None
        runner = PipelineStage(stage, stage.index, stage.stages, self.device, group=self.group,
                               input_args=self._input_meta(equal, loss_fn is not None),
                               output_args=self._output_meta(equal, kind, loss_fn is not None))
        schedule = SCHEDULES[self.schedule](runner, equal.count, loss_fn=loss_fn, scale_grads=False)
        args = (equal.input_ids,) if stage.is_first else ()
        kwargs = {"attention_mask": equal.attention_mask, "input_ids": equal.input_ids}
        try:
            if loss_fn is None:
                return schedule.eval(*args, **kwargs)
            target = torch.arange(equal.count)
            schedule.step(*args, target=target, losses=[] if stage.is_last else None, return_outputs=False, **kwargs)
            return None
        finally:
            stage.head = None

    # The shapes of what each stage receives and sends (the schedule's "static" mode: no
    # shape-inference pass); hidden states carry gradients when training.

    def _input_meta(self, equal: EqualBatches, grad: bool) -> torch.Tensor:
        if self.stage.is_first:
            return torch.empty(equal.rows, equal.width, dtype=equal.input_ids.dtype, device="meta")
        return self._hidden_meta(equal, grad)

    def _hidden_meta(self, equal: EqualBatches, grad: bool) -> torch.Tensor:
        hidden = self.stage.config.hidden_size
        meta = torch.empty(equal.rows, equal.width, hidden, dtype=self.stage.wire_dtype, device="meta")
        return meta.requires_grad_(grad)

    def _output_meta(self, equal: EqualBatches, kind: str, grad: bool) -> torch.Tensor:
        if not self.stage.is_last:
            return self._hidden_meta(equal, grad)
        width = equal.width - equal.prompt_len
        shape = {"logprobs": (equal.rows, width, 2),
                 "values": (equal.rows, width), "scores": (equal.rows,)}[kind]
        return torch.empty(shape, dtype=torch.float32, device="meta")

    def _share(self, loss: float | None, metrics: dict[str, Metric] | None) -> tuple[float, dict[str, Metric]]:
        """The last stage's loss and metrics, on every ``pp`` rank."""
        payload = [loss, metrics]
        dist.broadcast_object_list(payload, src=self.last_rank, group=self.group,
                                   device=self.device if self.device.type != "cpu" else None)
        return payload[0], payload[1]

    def sync_tied(self) -> None:
        """Sum the gradients of a tied embedding matrix's two copies (first and last
        stage) so that each holds the one-process gradient."""
        if self.tied_group is None:
            return
        param = self.tied_copy if self.stage.is_last else self.stage.body.embed_tokens.weight
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grad = param.grad
        dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=self.tied_group)

    def full_state_dict(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every stage's full weights (``local``: this stage's, already unsharded) merged,
        on every ``pp`` rank."""
        everyone: list[Any] = [None] * self.stage.stages
        dist.all_gather_object(everyone, {k: v.detach().cpu() for k, v in local.items()}, group=self.group)
        merged: dict[str, torch.Tensor] = {}
        for part in everyone:
            merged.update({k: v.to(self.device) for k, v in part.items()})
        return merged


def _ends_group(mesh: Any) -> dist.ProcessGroup | None:
    """The process group of this rank's first and last pipeline stage (same data, tp
    coordinates), for the tied embedding's gradient; None on a middle stage. Every rank
    creates every such group (creating one is a collective)."""
    if mesh["pp"].size() == 2:
        return mesh["pp"].get_group()
    ranks = mesh.mesh.movedim(mesh.mesh_dim_names.index("pp"), 0).reshape(mesh["pp"].size(), -1)
    mine = None
    for first, last in zip(ranks[0].tolist(), ranks[-1].tolist()):
        group = dist.new_group([first, last])
        if dist.get_rank() in (first, last):
            mine = group
    return mine


def build_pipeline(model: nn.Module, mesh: Any, *, schedule: str, device: torch.device) -> Pipeline:
    """Split ``model`` in place for this rank's coordinate on ``mesh``'s ``pp`` dim and
    return its :class:`Pipeline`. ``pipeline.stage`` is what training forwards go
    through, and the root to shard (FSDP2 over the stage: the schedule then drives its
    gradient reduction, once per step)."""
    from rltune.models.routing import installed_routers

    routers = installed_routers(model)
    if any(gate.__dict__.get("_rltune_rate", 0.0) > 0 for gate in routers):
        raise ValueError(PP_AUX_FREE_BIAS)  # a bias restored at rate 0 stays fixed: it selects in every stage
    if any(gate.__dict__.get("_rltune_replay", False) for gate in routers):
        raise ValueError(PP_ROUTING_REPLAY)
    tied = is_tied(model)
    stage = split_model(model, mesh["pp"].get_local_rank(), mesh["pp"].size())
    stage.to(device)
    return Pipeline(stage, mesh, schedule=schedule, device=device, tied=tied and stage.stages > 1)


def apply_pipeline(model: nn.Module, mesh: Any, layout: Any) -> Pipeline:
    """:func:`build_pipeline` with ``layout.pp_schedule``, on the device of ``model``."""
    if layout.tp > 1 and layout.sequence_parallel:
        raise ValueError(PP_SEQUENCE_PARALLEL)
    return build_pipeline(model, mesh, schedule=layout.pp_schedule, device=next(model.parameters()).device)


__all__ = ["SCHEDULES", "EqualBatches", "Pipeline", "StageModule", "apply_pipeline", "build_pipeline", "decoder_body", "equalise",
           "head_kind", "split_model", "stage_layer_ranges", "stage_output"]
