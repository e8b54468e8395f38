"""The parts of an offline preference run (``algo.name`` dpo, simpo or reward_model):
model, objective, pair data, collate and held-out evaluation, wired from the config.

The loop draws prompts as for SFT and calls ``parts.collate(prompts)`` instead of
``collate_sft``; ``parts.evaluate(model)`` gives the held-out preference metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
    ContextFactory,
    ReferenceLogps,
    evaluate_pairs,
    load_or_compute_reference,
)
from rltune.learner.preference import preference_method
from rltune.models.chunked import set_logprob_chunk_tokens
from rltune.models.load import load_model
from rltune.models.reward_model import load_reward_model
from rltune.models.vision import freeze_vision, is_vision_language


@dataclass
class PreferenceParts:
    """What a preference run trains and how it feeds and judges it.

    ``collate(prompts)`` makes the interleaved pair batch (with the cached reference
    log-probs for DPO); ``evaluate(model)`` returns ``eval/pref/accuracy`` and
    ``eval/pref/margin`` on the eval split, or ``{}`` without one. ``reference`` is the
    DPO reference cache (None for the reference-free methods).
    """

    model: torch.nn.Module
    objective: Objective
    train_prompts: list[Prompt]
    eval_prompts: list[Prompt] | None
    collate: Callable[[Sequence[Prompt]], TrainBatch]
    evaluate: Callable[[torch.nn.Module], dict[str, float]]
    reference: ReferenceLogps | None = None
    data_warnings: list[str] = field(default_factory=list)


def build_preference_parts(
    cfg: Config,
    *,
    model_dir: str,
    tokenizer: Any,
    run_dir: Path,
    processor: Any = None,
    reference_context: ContextFactory | None = None,
    model: torch.nn.Module | None = None,
    device: torch.device | None = None,
    check_rows: Callable[[list[Prompt], list[Prompt] | None], None] | None = None,
) -> PreferenceParts:
    """Load the pair data and the model for ``cfg.algo.name`` and wire them.

    The model is the causal LM in ``model_dir`` (dpo, simpo) or a reward model on it
    (reward_model, a new score head seeded with ``train.seed``), unless ``model`` is
    given (e.g. already wrapped with LoRA). For DPO the reference is that model as it is
    now, under ``reference_context`` when given; its log-probs of every train and eval
    pair are read from or written to ``run_dir / reference_logps.safetensors``, so call
    this before any training step or checkpoint restore. ``processor``: a vision-language
    model's processor, which renders the prompts and their images (:func:`load_prompts`).
    ``device``: where the model computes (None: where it is). ``check_rows(train, eval)``
    is called on the loaded pairs before the model loads or any reference is computed.
    """
    method = preference_method(cfg.algo.name)
    vl = {"processor": processor, "model": cfg.model.path}
    train_set = load_prompts(cfg.data.train, cfg.data, tokenizer, with_pairs=True, **vl)
    eval_set = load_prompts(cfg.data.eval, cfg.data, tokenizer, with_pairs=True, **vl) if cfg.data.eval else None
    eval_prompts = eval_set.prompts[: cfg.eval.max_prompts] if eval_set else None
    if check_rows is not None:
        check_rows(train_set.prompts, eval_prompts)
    if model is None:
        model = load_preference_model(cfg, model_dir)
    if device is not None:
        model.to(device)
    pad_id = tokenizer.pad_token_id
    budget = cfg.train.micro_batch_tokens
    reference = None
    if method.needs_reference:
        splits = {"train": train_set.prompts, **({"eval": eval_prompts} if eval_prompts else {})}
        reference = load_or_compute_reference(
            Path(run_dir) / REFERENCE_FILE, model, splits, pad_id, budget=budget,
            context=reference_context,
        )
    objective = method.objective(cfg.algo)
    evaluate = partial(
        _evaluate, eval_prompts, pad_id, forward=objective.forward, rewards=method.rewards(cfg.algo),
        budget=budget, ref_logps=reference.splits.get("eval") if reference else None,
    )
    return PreferenceParts(
        model=model,
        objective=objective,
        train_prompts=train_set.prompts,
        eval_prompts=eval_prompts,
        collate=_PairCollate(pad_id, reference.splits["train"] if reference else None,
                             {p.id: i for i, p in enumerate(train_set.prompts)}),
        evaluate=evaluate,
        reference=reference,
        data_warnings=skip_warnings(train_set, eval_set),
    )


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


def _evaluate(eval_prompts: list[Prompt] | None, pad_id: int, model: torch.nn.Module, **kwargs: Any) -> dict[str, float]:
    if not eval_prompts:
        return {}
    return evaluate_pairs(model, eval_prompts, pad_id, **kwargs)


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
