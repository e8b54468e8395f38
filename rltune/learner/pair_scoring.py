"""Scoring preference pairs without gradients: the frozen reference's log-probs, computed
once and cached with the run, and held-out preference accuracy.

Both read a :data:`PairForward`, ``batch -> output``, so that the pairs are scored by a
model in this process (:func:`model_pairs`) or by a learner on its own devices, a Ray
learner group laid out over its ranks included (``Learner.pair_outputs``): the driver of
a large model's run then holds none of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from safetensors.torch import save as save_tensors
from safetensors.torch import save_file

from rltune.data.collate import collate_pairs
from rltune.data.records import Prompt, TrainBatch
from rltune.learner.distributed import to_device
from rltune.learner.objectives import logprobs_only
from rltune.learner.preference import RowRewards, ScoreOutput, chosen_rejected, score_forward, sequence_logps
from rltune.metrics import keys
from rltune.models.logprobs import LogProbOutput
from rltune.models.lora import adapters_disabled
from rltune.models.safetensors_io import open_tensors

if TYPE_CHECKING:
    from rltune.learner.learner import LocalLearner

ContextFactory = Callable[[torch.nn.Module], contextlib.AbstractContextManager]
"""``model -> context manager`` under which ``model`` computes as the reference (e.g. its
LoRA adapters disabled)."""
PairForward = Callable[[TrainBatch], Any]
"""``batch -> output`` of every row of a pair batch, without gradients, its tensors on the
CPU: ``logprobs`` ``[B, C]`` (a causal LM, at temperature 1) or ``scores`` ``[B]`` (a
reward model)."""

PAIR_FORWARDS: dict[str, Callable[..., Any]] = {"logprobs": logprobs_only, "scores": score_forward}
"""The no-grad forward of each output a pair batch is scored by: a causal LM's token
log-probs, or a reward model's score of each row."""

REFERENCE_FILE = "reference_logps.safetensors"
_CACHE_FIX = "it only caches the reference log-probs: delete it and they are computed again"
_CACHE_FORMAT = 1  # bump when what the cache holds, or how it is computed, changes


# ---------------------------------------------------------------- batching pairs


def pair_batches(
    prompts: Sequence[Prompt],
    pad_id: int,
    *,
    budget: int,
    ref_logps: torch.Tensor | None = None,
) -> Iterator[tuple[list[int], TrainBatch]]:
    """``(indices into prompts, batch of their pairs)`` covering every pair once.

    Pairs go longest first into batches whose padded size (rows x (longest prompt +
    longest response)) stays within ``budget`` tokens; a pair longer than the budget is a
    batch of its own. The grouping depends only on the lengths, so the same prompts give
    the same batches every time. ``ref_logps`` ``[N, 2]`` are passed to ``collate_pairs``.
    """
    prompt_lens = [len(p.input_ids) for p in prompts]
    response_lens = [max(len(p.meta["chosen_ids"]), len(p.meta["rejected_ids"])) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: -(prompt_lens[i] + response_lens[i]))
    chunk: list[int] = []
    width_p = width_c = 0
    for i in order:
        new_p, new_c = max(width_p, prompt_lens[i]), max(width_c, response_lens[i])
        if chunk and 2 * (len(chunk) + 1) * (new_p + new_c) > budget:
            yield chunk, _collate(prompts, chunk, pad_id, ref_logps)
            chunk, new_p, new_c = [], prompt_lens[i], response_lens[i]
        chunk.append(i)
        width_p, width_c = new_p, new_c
    if chunk:
        yield chunk, _collate(prompts, chunk, pad_id, ref_logps)


def _collate(
    prompts: Sequence[Prompt], rows: list[int], pad_id: int, ref_logps: torch.Tensor | None
) -> TrainBatch:
    ref = None if ref_logps is None else ref_logps[torch.tensor(rows)]
    return collate_pairs([prompts[i] for i in rows], pad_id, ref)


@contextlib.contextmanager
def _inference(model: torch.nn.Module) -> Iterator[None]:
    """No gradients and eval mode (no dropout), the previous mode restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def model_pairs(
    model: torch.nn.Module, forward: Callable[..., Any] = logprobs_only, *, context: ContextFactory | None = None
) -> Iterator[PairForward]:
    """A :data:`PairForward` of ``model`` in this process: ``forward`` (an objective's,
    ``model, batch -> output``) in eval mode without gradients, under ``context(model)``
    when given, on the model's device; the model's mode is restored on exit."""
    device = next(model.parameters()).device
    enter = context(model) if context is not None else contextlib.nullcontext()
    with enter, _inference(model):
        yield lambda batch: on_cpu(forward(model, to_device(batch, device), temperature=1.0, router_logits=False))


def on_cpu(out: Any) -> Any:
    """A forward's output (a dataclass) with each of its tensors on the CPU, as float32."""
    return dataclasses.replace(out, **{
        f.name: value.float().cpu() for f in dataclasses.fields(out)
        if isinstance(value := getattr(out, f.name), torch.Tensor)
    })


class PairScorer(Protocol):
    """What scores pair batches: a model in this process (:class:`ModelScorer`) or a
    learner, wherever its ranks are (``rltune.runtime.protocols.Learner``)."""

    def pair_outputs(self, batch: TrainBatch, field: str, *, adapters_off: bool = False) -> torch.Tensor:
        """``field`` of :data:`PAIR_FORWARDS` (``logprobs`` ``[B, C]``, ``scores`` ``[B]``)
        of every row of ``batch`` under the current weights, without gradients, at
        temperature 1, float32 on the CPU. ``adapters_off``: LoRA's adapters switched off,
        so that the model computes as its frozen base (nothing to switch on another model)."""
        ...

    def weights_fingerprint(self) -> str:
        """:func:`weights_fingerprint` of the current weights (of every shard, when sharded)."""
        ...


@dataclass(frozen=True)
class ModelScorer:
    """A :class:`PairScorer` over ``model`` in this process."""

    model: torch.nn.Module

    def pair_outputs(self, batch: TrainBatch, field: str, *, adapters_off: bool = False) -> torch.Tensor:
        with model_pairs(self.model, PAIR_FORWARDS[field], context=adapters_disabled if adapters_off else None) as run:
            return getattr(run(batch), field)

    def weights_fingerprint(self) -> str:
        return weights_fingerprint(self.model)


def learner_pair_outputs(learner: LocalLearner, batch: TrainBatch, field: str, adapters_off: bool) -> torch.Tensor:
    """:meth:`PairScorer.pair_outputs` of a :class:`~rltune.learner.learner.LocalLearner`
    (one rank of a group: its shard of the rows, every rank together), with its layout,
    micro-batch budget and precision."""
    with adapters_disabled(learner.model) if adapters_off else contextlib.nullcontext():
        return learner.predict(batch, PAIR_FORWARDS[field], field).cpu()


def learner_weights_fingerprint(learner: LocalLearner) -> str:
    """:func:`weights_fingerprint` of a learner's (or one rank's) weights, and its
    ``train.precision`` unless fp32: it scores pairs under that precision's autocast, so a
    reference cache written under another precision (or by a :class:`ModelScorer`, which
    computes in the weights' own dtype) is not taken for its own."""
    weights = weights_fingerprint(learner.model)
    return weights if learner.cfg.precision == "fp32" else f"{weights}|{learner.cfg.precision}"


def group_fingerprint(prints: Sequence[str]) -> str:
    """One fingerprint of a learner group's weights from its ranks' ``prints``: the one
    print when every rank holds the same weights (DDP: then a one-process run's reference
    cache fits), else sha256 over the list (each rank its own shard)."""
    if len(set(prints)) == 1:
        return prints[0]
    return hashlib.sha256(json.dumps(list(prints)).encode()).hexdigest()


def scorer_forward(scorer: PairScorer, field: str, *, adapters_off: bool = False) -> PairForward:
    """The :data:`PairForward` of ``scorer``'s ``field``."""
    def run(batch: TrainBatch) -> LogProbOutput | ScoreOutput:
        out = scorer.pair_outputs(batch, field, adapters_off=adapters_off)
        return LogProbOutput(logprobs=out) if field == "logprobs" else ScoreOutput(scores=out)
    return run


# ---------------------------------------------------------------- the frozen reference


def reference_seq_logps(
    model: torch.nn.Module,
    prompts: Sequence[Prompt],
    pad_id: int,
    *,
    budget: int,
    context: ContextFactory | None = None,
) -> torch.Tensor:
    """``[N, 2]`` float32 (on the CPU): the summed log-probs of each prompt's chosen and
    rejected response under ``model``, at temperature 1, in no-grad batches of at most
    ``budget`` padded tokens (:func:`pair_batches`). ``context(model)``, when given, is
    entered around the computation (e.g. LoRA adapters disabled, so ``model`` is its own
    frozen base)."""
    with model_pairs(model, context=context) as forward:
        return pair_seq_logps(forward, prompts, pad_id, budget=budget)


def pair_seq_logps(forward: PairForward, prompts: Sequence[Prompt], pad_id: int, *, budget: int) -> torch.Tensor:
    """``[N, 2]`` float32: each pair's (chosen, rejected) summed completion log-probs under
    ``forward`` (:data:`PairForward` with ``logprobs``), in batches of :func:`pair_batches`."""
    out = torch.zeros(len(prompts), 2)
    for rows, batch in pair_batches(prompts, pad_id, budget=budget):
        seq = sequence_logps(forward(batch), batch).float()
        out[torch.tensor(rows)] = torch.stack(chosen_rejected(seq), dim=1)
    return out


def pairs_fingerprint(prompts: Sequence[Prompt]) -> str:
    """sha256 of every pair's id and token ids (prompt, chosen, rejected), and its images'
    digests when it has images, in order."""
    h = hashlib.sha256()
    for p in prompts:
        row = [p.id, p.input_ids, p.meta["chosen_ids"], p.meta["rejected_ids"]]
        if p.images:  # the same tokens over other pictures are other pairs
            row.append([image.digest for image in p.images])
        h.update(json.dumps(row).encode())
        h.update(b"\n")
    return h.hexdigest()


@torch.no_grad()
def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of the model's state dict: every tensor's name, dtype, shape and bytes. A
    sharded model's tensors (DTensors) count with this process's shard only."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(f"{name}\n".encode())
        # safetensors' bytes: a header with dtype and shape, then the raw data (any dtype,
        # bfloat16 included, without going through numpy)
        h.update(save_tensors({"t": _local(tensor).detach().contiguous().cpu()}))
    return h.hexdigest()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(tensor, DTensor):
            return tensor.to_local()
    return tensor


@dataclass
class ReferenceLogps:
    """The reference's ``[N, 2]`` (chosen, rejected) log-probs of each split's pairs.

    ``reused`` says whether they were read from the run directory rather than computed.
    """

    splits: dict[str, torch.Tensor]
    fingerprint: str
    reused: bool


def load_or_compute_reference(
    path: str | Path,
    model: torch.nn.Module,
    splits: Mapping[str, Sequence[Prompt]],
    pad_id: int,
    *,
    budget: int,
    context: ContextFactory | None = None,
) -> ReferenceLogps:
    """The reference log-probs of every split, read from ``path`` (a safetensors file, one
    tensor per split) when it was written for the same data and reference model, else
    computed with :func:`reference_seq_logps` and written there
    (:func:`cached_reference`, keyed by :func:`weights_fingerprint` of ``model`` as passed
    in: call this before training changes it)."""
    return cached_reference(
        path, splits, weights_fingerprint(model),
        lambda prompts: reference_seq_logps(model, prompts, pad_id, budget=budget, context=context),
    )


def cached_reference(
    path: str | Path,
    splits: Mapping[str, Sequence[Prompt]],
    model_fingerprint: str,
    compute: Callable[[Sequence[Prompt]], torch.Tensor],
) -> ReferenceLogps:
    """Each split's ``[N, 2]`` reference log-probs, read from ``path`` when it was written
    for the same pairs and reference weights, else ``compute(prompts)`` per split and
    written there.

    The file's metadata holds a fingerprint: sha256 over the cache format, each split's
    name and :func:`pairs_fingerprint`, and ``model_fingerprint`` (the reference's weights,
    taken before training changes them). A resumed run therefore reuses the file, and a
    changed dataset, split or model recomputes it. The file is written to a temporary
    sibling and renamed, so it is complete or absent.
    """
    path = Path(path)
    key = {
        "format": _CACHE_FORMAT,
        "model": model_fingerprint,
        "splits": {name: pairs_fingerprint(ps) for name, ps in sorted(splits.items())},
    }
    fingerprint = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    cached = _read_cache(path, fingerprint, splits)
    if cached is not None:
        return ReferenceLogps(splits=cached, fingerprint=fingerprint, reused=True)
    computed = {name: compute(ps) for name, ps in splits.items()}
    _write_cache(path, computed, fingerprint)
    return ReferenceLogps(splits=computed, fingerprint=fingerprint, reused=False)


def _read_cache(
    path: Path, fingerprint: str, splits: Mapping[str, Sequence[Prompt]]
) -> dict[str, torch.Tensor] | None:
    if not path.is_file():
        return None
    with open_tensors(path, fix=_CACHE_FIX) as f:
        if (f.metadata() or {}).get("fingerprint") != fingerprint:
            return None
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    shapes_fit = set(tensors) == set(splits) and all(
        tuple(tensors[name].shape) == (len(ps), 2) for name, ps in splits.items()
    )
    return tensors if shapes_fit else None


def _write_cache(path: Path, tensors: dict[str, torch.Tensor], fingerprint: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp,
                  metadata={"fingerprint": fingerprint})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# ---------------------------------------------------------------- evaluation


def evaluate_pairs(
    model: torch.nn.Module,
    prompts: Sequence[Prompt],
    pad_id: int,
    *,
    forward: Callable[..., Any],
    rewards: RowRewards,
    budget: int,
    ref_logps: torch.Tensor | None = None,
) -> dict[str, float]:
    """Preference accuracy and mean margin of ``model`` on held-out pairs
    (:func:`pair_metrics` through ``forward``, the objective's ``Objective.forward``). Runs
    without gradients in eval mode and leaves the model's mode as it was."""
    with model_pairs(model, forward) as run:
        return pair_metrics(run, prompts, pad_id, rewards=rewards, budget=budget, ref_logps=ref_logps)


def pair_metrics(
    forward: PairForward,
    prompts: Sequence[Prompt],
    pad_id: int,
    *,
    rewards: RowRewards,
    budget: int,
    ref_logps: torch.Tensor | None = None,
) -> dict[str, float]:
    """Preference accuracy and mean margin on held-out pairs scored by ``forward``.

    ``rewards`` is the method's per-row reward (``PREFERENCE_METHODS``). With
    ``m_k = r(chosen_k) - r(rejected_k)`` over the N pairs::

        eval/pref/accuracy = #{k: m_k > 0} / N     (a tie counts as wrong, as in the losses)
        eval/pref/margin   = sum_k m_k / N

    DPO's rewards need ``ref_logps`` ``[N, 2]``. Batches of ``budget`` tokens.
    """
    margins = torch.zeros(len(prompts))
    for rows, batch in pair_batches(prompts, pad_id, budget=budget, ref_logps=ref_logps):
        chosen, rejected = chosen_rejected(rewards(forward(batch), batch).float())
        margins[torch.tensor(rows)] = chosen - rejected
    return {
        keys.eval_key(keys.PREF_ACCURACY): float((margins > 0).float().mean()),
        keys.eval_key(keys.PREF_MARGIN): float(margins.mean()),
    }
