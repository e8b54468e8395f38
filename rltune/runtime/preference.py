"""The parts of an offline preference run (``algo.name`` dpo, simpo or reward_model):
pair data, objective, collate and held-out evaluation, wired from the config.

The loop draws prompts as for SFT and calls ``parts.collate(prompts)`` instead of
``collate_sft``; ``parts.evaluate()`` gives the held-out preference metrics. The runtime
scores the pairs (DPO's reference log-probs, the held-out metrics) on the learner itself
(:func:`score_preference_pairs`), wherever its ranks are, so a Ray driver holds no copy
of the model; :func:`build_preference_parts` is the same in one process, on a model here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rltune.config.schema import Config
from rltune.data.collate import collate_pairs
from rltune.data.loaders import PromptSet, load_prompts
from rltune.data.records import Prompt, TrainBatch
from rltune.learner.objectives import Objective
from rltune.learner.pair_scoring import (
    REFERENCE_FILE,
    ModelScorer,
    PairScorer,
    ReferenceLogps,
    cached_reference,
    pair_metrics,
    pair_seq_logps,
    scorer_forward,
)
from rltune.learner.preference import preference_method
from rltune.models.chunked import set_logprob_chunk_tokens
from rltune.models.load import load_model
from rltune.models.reward_model import load_reward_model
from rltune.models.vision import freeze_vision, is_vision_language
from rltune.parallel.layout import layout_for


@dataclass(frozen=True)
class PreferencePairs:
    """A preference run's pairs, loaded and checked: ``eval_prompts`` at most
    ``eval.max_prompts`` (None without ``data.eval``)."""

    train_prompts: list[Prompt]
    eval_prompts: list[Prompt] | None
    pad_id: int
    data_warnings: list[str] = field(default_factory=list)


@dataclass
class PreferenceParts:
    """What a preference run trains and how it feeds and judges it.

    ``collate(prompts)`` makes the interleaved pair batch (with the cached reference
    log-probs for DPO); ``evaluate()`` returns ``eval/pref/accuracy`` and
    ``eval/pref/margin`` of the scorer's current weights on the eval split, or ``{}``
    without one. ``reference`` is the DPO reference cache (None for the reference-free
    methods). ``model``: the model in this process (:func:`build_preference_parts`), None
    when the learner holds it.
    """

    objective: Objective
    train_prompts: list[Prompt]
    eval_prompts: list[Prompt] | None
    collate: Callable[[Sequence[Prompt]], TrainBatch]
    evaluate: Callable[[], dict[str, float]]
    reference: ReferenceLogps | None = None
    data_warnings: list[str] = field(default_factory=list)
    model: torch.nn.Module | None = None


def load_preference_pairs(
    cfg: Config,
    tokenizer: Any,
    *,
    processor: Any = None,
    check_rows: Callable[[list[Prompt], list[Prompt] | None], None] | None = None,
) -> PreferencePairs:
    """The pairs of ``data.train`` and ``data.eval``. ``processor``: a vision-language
    model's processor, which renders the prompts and their images (:func:`load_prompts`).
    ``check_rows(train, eval)`` is called on them as they load."""
    vl = {"processor": processor, "model": cfg.model.path}
    train_set = load_prompts(cfg.data.train, cfg.data, tokenizer, with_pairs=True, **vl)
    eval_set = load_prompts(cfg.data.eval, cfg.data, tokenizer, with_pairs=True, **vl) if cfg.data.eval else None
    eval_prompts = eval_set.prompts[: cfg.eval.max_prompts] if eval_set else None
    if check_rows is not None:
        check_rows(train_set.prompts, eval_prompts)
    return PreferencePairs(train_set.prompts, eval_prompts, tokenizer.pad_token_id, skip_warnings(train_set, eval_set))


def score_preference_pairs(cfg: Config, pairs: PreferencePairs, scorer: PairScorer, run_dir: Path) -> PreferenceParts:
    """Wire ``pairs`` to ``scorer``, which scores them without gradients (the learner, or
    a :class:`ModelScorer`). For DPO the reference is the scorer's model as it is now,
    with LoRA's adapters off: its log-probs of every train and eval pair are read from or
    written to ``run_dir / reference_logps.safetensors``, so call this before any training
    step or checkpoint restore. Held-out evaluation scores with the scorer's weights at
    the time of the call."""
    method = preference_method(cfg.algo.name)
    # one call per global batch: a Ray group cuts it over its data ranks (tp and pp peers
    # share rows), each of which then scores about one micro-batch of it
    ranks = layout_for(cfg, cfg.runtime.placement.learners).data_world if cfg.runtime.mode == "ray" else 1
    budget = cfg.train.micro_batch_tokens * ranks
    reference = None
    if method.needs_reference:
        splits = {"train": pairs.train_prompts, **({"eval": pairs.eval_prompts} if pairs.eval_prompts else {})}
        frozen = scorer_forward(scorer, "logprobs", adapters_off=True)
        reference = cached_reference(
            Path(run_dir) / REFERENCE_FILE, splits, scorer.weights_fingerprint(),
            partial(pair_seq_logps, frozen, pad_id=pairs.pad_id, budget=budget),
        )
    evaluate = partial(
        _evaluate, pairs.eval_prompts, pairs.pad_id, scorer_forward(scorer, "scores" if method.scores else "logprobs"),
        rewards=method.rewards(cfg.algo), budget=budget, ref_logps=reference.splits.get("eval") if reference else None,
    )
    return PreferenceParts(
        objective=method.objective(cfg.algo),
        train_prompts=pairs.train_prompts,
        eval_prompts=pairs.eval_prompts,
        collate=_PairCollate(pairs.pad_id, reference.splits["train"] if reference else None,
                             {p.id: i for i, p in enumerate(pairs.train_prompts)}),
        evaluate=evaluate,
        reference=reference,
        data_warnings=pairs.data_warnings,
    )


def build_preference_parts(
    cfg: Config,
    *,
    model_dir: str,
    tokenizer: Any,
    run_dir: Path,
    processor: Any = None,
    model: torch.nn.Module | None = None,
    device: torch.device | None = None,
) -> PreferenceParts:
    """Load the pairs and the model for ``cfg.algo.name`` in this process and wire them
    (:func:`score_preference_pairs` with a :class:`ModelScorer`): the model is the causal
    LM in ``model_dir`` (dpo, simpo) or a reward model on it (reward_model, a new score
    head seeded with ``train.seed``), unless ``model`` is given (e.g. already wrapped with
    LoRA, whose base with adapters off is then DPO's reference). ``device``: where the
    model computes (None: where it is). ``parts.model`` is that model: train it, and
    ``parts.evaluate()`` scores its weights as they are then."""
    pairs = load_preference_pairs(cfg, tokenizer, processor=processor)
    if model is None:
        model = load_preference_model(cfg, model_dir)
    if device is not None:
        model.to(device)
    return replace(score_preference_pairs(cfg, pairs, ModelScorer(model), run_dir), model=model)


@dataclass(frozen=True)
class _PairCollate:
    """The interleaved pair batch of ``prompts``, with their cached reference log-probs
    (``ref``: one row per train pair, ``row_of`` a pair's row) when there are some."""

    pad_id: int
    ref: torch.Tensor | None
    row_of: dict[str, int]

    def __call__(self, prompts: Sequence[Prompt]) -> TrainBatch:
        ref = None if self.ref is None else self.ref[torch.tensor([self.row_of[p.id] for p in prompts])]
        return collate_pairs(prompts, self.pad_id, ref)


def _evaluate(eval_prompts: list[Prompt] | None, pad_id: int, forward: Any, **kwargs: Any) -> dict[str, float]:
    if not eval_prompts:
        return {}
    return pair_metrics(forward, eval_prompts, pad_id, **kwargs)


def load_preference_model(cfg: Config, model_dir: str) -> torch.nn.Module:
    """The model ``cfg.algo.name`` trains: a reward model on ``model_dir`` (a new score head
    seeded with ``train.seed``) for reward_model, else the causal LM itself."""
    common = dict(dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code)
    if preference_method(cfg.algo.name).scores:
        return load_reward_model(model_dir, seed=cfg.train.seed, **common)
    model = load_model(model_dir, **common)
    set_logprob_chunk_tokens(model, cfg.train.logprob_chunk_tokens)  # the policy's and the reference's passes
    if cfg.model.freeze_vision and is_vision_language(model):
        freeze_vision(model)
    return model


def skip_warnings(*sets: PromptSet | None) -> list[str]:
    """One console line per data source that had bad rows skipped (``data.on_bad_row: skip``)."""
    return [
        f"data: skipped {s.skipped} bad rows of {s.source}; first: {s.skip_examples[0]}"
        for s in sets if s is not None and s.skipped
    ]
