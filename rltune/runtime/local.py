"""The local runtime: every piece in this process, the generator sharing the learner's module."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rltune.algos import ALGORITHMS
from rltune.checkpoint.export import export_hf
from rltune.config import Config, save_resolved_config
from rltune.data.loaders import load_prompts
from rltune.data.records import TrainBatch
from rltune.data.sampler import PromptSampler
from rltune.learner.learner import LocalLearner
from rltune.learner.objectives import build_objective
from rltune.models.load import load_model, load_tokenizer, resolve_model, router_aux_loss_coef
from rltune.models.logprobs import completion_logprobs
from rltune.rewards.scorer import LocalScorer, build_reward_fns
from rltune.rollout.hf import HFGenerator
from rltune.runtime.loop import Run, train


@dataclass
class LocalState:
    """RNG streams a checkpoint must carry besides the global ones."""

    generators: dict[str, torch.Generator] = field(default_factory=dict)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed)


def build_run(cfg: Config, *, config_dir: Path | None = None) -> Run:
    """Load model, data and rewards for ``cfg`` and wire them into a :class:`Run`."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    seed_everything(cfg.train.seed)
    algorithm = ALGORITHMS[cfg.algo.name]
    # every input a user can get wrong is checked before the model's weights are loaded
    reward_fns = build_reward_fns(cfg.reward, base_dir=str(config_dir) if config_dir else None)
    model_dir = resolve_model(cfg.model.path)
    tokenizer = load_tokenizer(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    train_set = load_prompts(cfg.data.train, cfg.data, tokenizer, with_completion=not algorithm.online)
    eval_set = load_prompts(cfg.data.eval, cfg.data, tokenizer) if cfg.data.eval else None
    model = load_model(model_dir, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code)
    aux_coef = cfg.model.router_aux_loss_coef
    if aux_coef is None:
        aux_coef = router_aux_loss_coef(model)
    learner = LocalLearner(
        model, build_objective(algorithm, cfg.algo), cfg.train,
        temperature=cfg.rollout.temperature if algorithm.online else 1.0,
        aux_loss_coef=aux_coef,
    )
    rng = torch.Generator().manual_seed(cfg.train.seed)
    run_dir = Path(cfg.log.dir) / cfg.name
    save_resolved_config(cfg, run_dir)
    run = Run(
        cfg=cfg,
        algorithm=algorithm,
        run_dir=run_dir,
        generator=HFGenerator(model, tokenizer, rng=rng),
        scorer=LocalScorer(reward_fns) if reward_fns else None,
        learner=learner,
        sampler=PromptSampler(len(train_set.prompts), seed=cfg.train.seed, shuffle=cfg.data.shuffle),
        train_prompts=train_set.prompts,
        eval_prompts=eval_set.prompts if eval_set and reward_fns else None,
        pad_id=tokenizer.pad_token_id,
        tokenizer=tokenizer,
        shared_weights=True,
        state=LocalState(generators={"sampling": rng}),
        data_warnings=[
            f"data: skipped {part.skipped} bad rows of {part.source}; first: {part.skip_examples[0]}"
            for part in (train_set, eval_set) if part is not None and part.skipped
        ],
    )
    if algorithm.requires_reference(cfg.algo.kl_coef):
        reference = load_model(model_dir, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code)
        run.reference_logprobs = _reference_fn(reference, cfg.rollout.temperature, cfg.train.micro_batch_tokens)
    return run


def _reference_fn(reference: torch.nn.Module, temperature: float, budget: int):
    """Log-probs of a batch under the frozen reference, in row chunks within ``budget``."""
    reference.eval().requires_grad_(False)

    @torch.no_grad()
    def logprobs(batch: TrainBatch) -> torch.Tensor:
        rows = max(1, budget // batch.input_ids.shape[1])
        parts = [
            completion_logprobs(
                reference, batch.input_ids[i : i + rows], batch.attention_mask[i : i + rows],
                batch.prompt_len, temperature=temperature,
            ).logprobs
            for i in range(0, len(batch), rows)
        ]
        return torch.cat(parts)

    return logprobs


def run_local(cfg: Config, *, config_dir: Path | None = None) -> Run:
    """Train ``cfg`` in this process and export the final model."""
    run = build_run(cfg, config_dir=config_dir)
    train(run)
    if cfg.checkpoint.final:
        export_hf(run.learner.model, run.tokenizer, run.run_dir / "final")
    return run
