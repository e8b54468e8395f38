"""Learning from preference pairs: the objectives of DPO, SimPO and reward-model training,
the frozen reference's log-probs computed once and cached with the run, and held-out
preference accuracy.

Batches come from :func:`~rltune.data.collate.collate_pairs`: rows ``2k`` and ``2k + 1``
are pair ``k``'s chosen and rejected response to the same prompt, so every objective here
has ``unit=2`` (a pair never straddles two micro-batches), normalises by the number of
pairs of the whole batch and weighs a micro-batch's metrics by its pairs.

Each method also names the per-row reward its loss compares, which evaluation uses:

===============  =============================================  ===========================
method           reward of a row                                loss on a pair (algos)
===============  =============================================  ===========================
``dpo``          ``beta * (log pi(y|x) - log pi_ref(y|x))``     ``dpo_loss``, any ``kind``
``simpo``        ``beta * log pi(y|x) / |y|``                   ``simpo_loss``
``reward_model`` the reward model's score                       ``bradley_terry_loss``
===============  =============================================  ===========================

``log pi(y|x)`` sums the completion's token log-probs, EOS included.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as save_tensors
from safetensors.torch import save_file

from rltune.algos import ALGORITHMS, bradley_terry_loss, dpo_loss, masked_mean, simpo_loss
from rltune.config.schema import AlgoConfig
from rltune.data.collate import collate_pairs
from rltune.data.records import Prompt, TrainBatch
from rltune.learner.objectives import Objective, batch_vision, through_forward
from rltune.metrics import keys
from rltune.models.logprobs import LogProbOutput, completion_logprobs
from rltune.models.safetensors_io import open_tensors
from rltune.models.reward_model import sequence_scores

Metrics = dict[str, torch.Tensor]
RowRewards = Callable[[Any, TrainBatch], torch.Tensor]
"""``(forward output, micro-batch) -> [B]``: the reward of every row."""
ContextFactory = Callable[[torch.nn.Module], contextlib.AbstractContextManager]
"""``model -> context manager`` under which ``model`` computes as the reference (e.g. its
LoRA adapters disabled)."""

REFERENCE_FILE = "reference_logps.safetensors"
_CACHE_FIX = "it only caches the reference log-probs: delete it and they are computed again"
_CACHE_FORMAT = 1  # bump when what the cache holds, or how it is computed, changes


# ---------------------------------------------------------------- per-row quantities


def sequence_logps(out: LogProbOutput, mb: TrainBatch) -> torch.Tensor:
    """``[B]`` completion log-prob of each row: its token log-probs summed over the loss mask."""
    return (out.logprobs * mb.loss_mask).sum(dim=-1)


def mean_logps(out: LogProbOutput, mb: TrainBatch) -> torch.Tensor:
    """``[B]`` per-token average of each row's completion log-probs (SimPO's length
    normalisation); 0 for a row with no loss token."""
    return sequence_logps(out, mb) / mb.loss_mask.sum(dim=-1).clamp(min=1.0)


def chosen_rejected(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x[0::2], x[1::2])``: the chosen and the rejected rows of interleaved pairs."""
    if x.shape[0] % 2:
        raise ValueError(f"{x.shape[0]} rows are not whole (chosen, rejected) pairs")
    return x[0::2], x[1::2]


def pair_count(batch: TrainBatch) -> torch.Tensor:
    """Number of pairs in ``batch`` (0-dim float): the denominator and the metric weight."""
    return torch.tensor(float(len(batch) // 2))


def _ref_seq_logps(mb: TrainBatch) -> torch.Tensor:
    if mb.ref_seq_logps is None:
        raise ValueError(
            "DPO needs the reference model's sequence log-probs in TrainBatch.ref_seq_logps; "
            "collate the pairs with the cached reference (collate_pairs(..., ref_logps=))"
        )
    return mb.ref_seq_logps


# ---------------------------------------------------------------- objectives


def dpo_objective(cfg: AlgoConfig) -> Objective:
    """DPO and its variants (``algo.dpo_kind``, ``algo.beta``, ``algo.label_smoothing``) on
    summed completion log-probs against the cached reference's (``ref_seq_logps``)."""

    def loss(out: LogProbOutput, mb: TrainBatch, denominator: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        chosen, rejected = chosen_rejected(sequence_logps(out, mb))
        ref_chosen, ref_rejected = chosen_rejected(_ref_seq_logps(mb).to(chosen.device))
        total, metrics = dpo_loss(
            chosen, rejected, ref_chosen, ref_rejected, beta=cfg.beta, kind=cfg.dpo_kind,
            label_smoothing=cfg.label_smoothing, denominator=denominator,
        )
        return total, {**metrics, **_logp_metrics(chosen, rejected, out, mb)}

    return Objective(loss=loss, aggregation="pair-mean", unit=2, count=pair_count, weight=pair_count)


def simpo_objective(cfg: AlgoConfig) -> Objective:
    """SimPO (``algo.beta``, ``algo.simpo_gamma``) on per-token average log-probs; no
    reference model."""

    def loss(out: LogProbOutput, mb: TrainBatch, denominator: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        chosen, rejected = chosen_rejected(mean_logps(out, mb))
        total, metrics = simpo_loss(
            chosen, rejected, beta=cfg.beta, gamma=cfg.simpo_gamma, denominator=denominator
        )
        sums = chosen_rejected(sequence_logps(out, mb))
        return total, {**metrics, **_logp_metrics(*sums, out, mb)}

    return Objective(loss=loss, aggregation="pair-mean", unit=2, count=pair_count, weight=pair_count)


def reward_model_objective(cfg: AlgoConfig) -> Objective:
    """Bradley-Terry loss on a sequence-classification model's scores (:func:`score_forward`)."""

    def loss(out: ScoreOutput, mb: TrainBatch, denominator: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        chosen, rejected = chosen_rejected(out.scores)
        return bradley_terry_loss(chosen, rejected, denominator=denominator)

    return Objective(
        loss=loss, aggregation="pair-mean", forward=score_forward, unit=2, count=pair_count,
        weight=pair_count,
    )


def _logp_metrics(
    chosen: torch.Tensor, rejected: torch.Tensor, out: LogProbOutput, mb: TrainBatch
) -> Metrics:
    """TRL's ``logps/chosen`` and ``logps/rejected`` (means over pairs of the summed
    log-probs) and the policy's entropy over the completion tokens."""
    metrics = {"logps/chosen": chosen.detach().mean(), "logps/rejected": rejected.detach().mean()}
    if out.entropy is not None:
        metrics[keys.ENTROPY] = masked_mean(out.entropy, mb.loss_mask)
    return metrics


@dataclass
class ScoreOutput:
    """What :func:`score_forward` returns: ``scores`` ``[B]`` float32, differentiable."""

    scores: torch.Tensor
    aux_loss: torch.Tensor | None = None


def score_forward(
    model: torch.nn.Module, mb: TrainBatch, *, temperature: float, router_logits: bool
) -> ScoreOutput:
    """The reward model's score of every row (``temperature`` and ``router_logits`` do not
    apply to a score). Through the model's forward, so a DDP or FSDP2 learner group
    synchronises it."""
    return ScoreOutput(scores=through_forward(model, sequence_scores, mb.input_ids, mb.attention_mask))


# ---------------------------------------------------------------- implied rewards


def dpo_rewards(cfg: AlgoConfig) -> RowRewards:
    """DPO's implicit reward ``beta * (log pi - log pi_ref)`` of each row."""
    return lambda out, mb: cfg.beta * (sequence_logps(out, mb) - _ref_seq_logps(mb).to(out.logprobs.device))


def simpo_rewards(cfg: AlgoConfig) -> RowRewards:
    """SimPO's reward ``beta * mean token log-prob`` of each row."""
    return lambda out, mb: cfg.beta * mean_logps(out, mb)


def score_rewards(cfg: AlgoConfig) -> RowRewards:
    """The reward model's score of each row."""
    return lambda out, mb: out.scores


@dataclass(frozen=True)
class PreferenceMethod:
    """What one preference algorithm trains and how it judges a pair."""

    objective: Callable[[AlgoConfig], Objective]
    rewards: Callable[[AlgoConfig], RowRewards]
    needs_reference: bool
    """It compares against the frozen reference's cached log-probs (the registry entry's
    ``needs_reference``)."""
    scores: bool
    """It trains a reward model (a sequence scorer), not the causal LM."""


_BY_LOSS: dict[Callable, tuple[Callable[[AlgoConfig], Objective], Callable[[AlgoConfig], RowRewards], bool]] = {
    dpo_loss: (dpo_objective, dpo_rewards, False),
    simpo_loss: (simpo_objective, simpo_rewards, False),
    bradley_terry_loss: (reward_model_objective, score_rewards, True),
}
"""The learner's side of each preference loss of the registry: (objective, implied
rewards, trains a scorer)."""


class _PreferenceMethods(Mapping[str, PreferenceMethod]):
    """``algo.name`` -> :class:`PreferenceMethod` for every entry of the registry that
    learns from pairs (``Algorithm.pairs``), read from the registry at each lookup, so
    which algorithms are preference methods is said there only."""

    def __getitem__(self, name: str) -> PreferenceMethod:
        algorithm = ALGORITHMS.get(name)
        if algorithm is None or not algorithm.pairs:
            raise KeyError(name)
        if algorithm.loss not in _BY_LOSS:
            raise ValueError(f"algo.name={name!r} learns from pairs with {algorithm.loss.__name__}, which "
                             f"has no preference objective here; known losses: {[f.__name__ for f in _BY_LOSS]}")
        objective, rewards, scores = _BY_LOSS[algorithm.loss]
        return PreferenceMethod(objective, rewards, needs_reference=algorithm.needs_reference, scores=scores)

    def __iter__(self) -> Iterator[str]:
        return iter([name for name, algorithm in ALGORITHMS.items() if algorithm.pairs])

    def __len__(self) -> int:
        return sum(1 for _ in self)


PREFERENCE_METHODS: Mapping[str, PreferenceMethod] = _PreferenceMethods()


def preference_method(name: str) -> PreferenceMethod:
    if name not in PREFERENCE_METHODS:
        raise ValueError(
            f"algo.name={name!r} does not learn from preference pairs; "
            f"expected one of {sorted(PREFERENCE_METHODS)}"
        )
    return PREFERENCE_METHODS[name]


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


def _to_device(batch: TrainBatch, device: torch.device) -> TrainBatch:
    return TrainBatch(
        input_ids=batch.input_ids.to(device),
        attention_mask=batch.attention_mask.to(device),
        prompt_len=batch.prompt_len,
        loss_mask=batch.loss_mask.to(device),
        ref_seq_logps=None if batch.ref_seq_logps is None else batch.ref_seq_logps.to(device),
        vision=batch.vision,  # moved by the forward that takes them
    )


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
    out = torch.zeros(len(prompts), 2)
    device = next(model.parameters()).device
    enter = context(model) if context is not None else contextlib.nullcontext()
    with enter, _inference(model):
        for rows, batch in pair_batches(prompts, pad_id, budget=budget):
            batch = _to_device(batch, device)
            logps = completion_logprobs(
                model, batch.input_ids, batch.attention_mask, batch.prompt_len, vision=batch_vision(batch)
            ).logprobs
            seq = sequence_logps(LogProbOutput(logprobs=logps), batch).float().cpu()
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
    """sha256 of the model's state dict: every tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(f"{name}\n".encode())
        # safetensors' bytes: a header with dtype and shape, then the raw data (any dtype,
        # bfloat16 included, without going through numpy)
        h.update(save_tensors({"t": tensor.detach().contiguous().cpu()}))
    return h.hexdigest()


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
    computed with :func:`reference_seq_logps` and written there.

    The file's metadata holds a fingerprint: sha256 over the cache format, each split's
    name and :func:`pairs_fingerprint`, and :func:`weights_fingerprint` of ``model`` as
    passed in (call this before training changes it). A resumed run therefore reuses the
    file, and a changed dataset, split or model recomputes it. The file is written to a
    temporary sibling and renamed, so it is complete or absent.
    """
    path = Path(path)
    key = {
        "format": _CACHE_FORMAT,
        "model": weights_fingerprint(model),
        "splits": {name: pairs_fingerprint(ps) for name, ps in sorted(splits.items())},
    }
    fingerprint = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    cached = _read_cache(path, fingerprint, splits)
    if cached is not None:
        return ReferenceLogps(splits=cached, fingerprint=fingerprint, reused=True)
    computed = {
        name: reference_seq_logps(model, ps, pad_id, budget=budget, context=context)
        for name, ps in splits.items()
    }
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
    """Preference accuracy and mean margin of ``model`` on held-out pairs.

    ``forward`` is the objective's (``Objective.forward``), ``rewards`` the method's
    per-row reward (:data:`PREFERENCE_METHODS`). With ``m_k = r(chosen_k) - r(rejected_k)``
    over the N pairs::

        eval/pref/accuracy = #{k: m_k > 0} / N     (a tie counts as wrong, as in the losses)
        eval/pref/margin   = sum_k m_k / N

    DPO's rewards need ``ref_logps`` ``[N, 2]``. Runs without gradients in eval mode, in
    batches of ``budget`` tokens, and leaves the model's mode as it was.
    """
    margins = torch.zeros(len(prompts))
    device = next(model.parameters()).device
    with _inference(model):
        for rows, batch in pair_batches(prompts, pad_id, budget=budget, ref_logps=ref_logps):
            batch = _to_device(batch, device)
            out = forward(model, batch, temperature=1.0, router_logits=False)
            chosen, rejected = chosen_rejected(rewards(out, batch).float())
            margins[torch.tensor(rows)] = (chosen - rejected).cpu()
    return {
        keys.eval_key(keys.PREF_ACCURACY): float((margins > 0).float().mean()),
        keys.eval_key(keys.PREF_MARGIN): float(margins.mean()),
    }
