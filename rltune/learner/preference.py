"""Learning from preference pairs: the objectives of DPO, SimPO and reward-model training,
and the per-row reward each method compares. The reference's cached log-probs and
held-out preference accuracy are in :mod:`rltune.learner.pair_scoring`.

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

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rltune.algos import ALGORITHMS, bradley_terry_loss, dpo_loss, masked_mean, simpo_loss
from rltune.config.schema import AlgoConfig
from rltune.data.records import TrainBatch
from rltune.learner.objectives import Objective, through_forward
from rltune.metrics import keys
from rltune.models.logprobs import LogProbOutput
from rltune.models.reward_model import sequence_scores

Metrics = dict[str, torch.Tensor]
RowRewards = Callable[[Any, TrainBatch], torch.Tensor]
"""``(forward output, micro-batch) -> [B]``: the reward of every row."""


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
