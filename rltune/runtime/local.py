"""The local runtime: every piece in this process, the generator sharing the learner's module."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from rltune.algos import ALGORITHMS
from rltune.checkpoint.export import export_hf
from rltune.config import Config, save_resolved_config
from rltune.data.loaders import load_prompts
from rltune.data.collate import collate_sft
from rltune.data.sampler import PromptSampler
from rltune.learner.learner import LocalLearner, predict
from rltune.learner.objectives import build_objective, logprob_forward, value_objective
from rltune.models.load import load_model, load_tokenizer, resolve_model, router_aux_loss_coef
from rltune.models.lora import adapters_disabled, apply_lora, is_lora
from rltune.models.value import load_critic
from rltune.rewards.scorer import LocalScorer, build_reward_fns
from rltune.rollout.hf import HFGenerator
from rltune.runtime.kl import KLCoefficient
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
    if cfg.model.lora is not None:
        model = apply_lora(model, cfg.model.lora)
    aux_coef = cfg.model.router_aux_loss_coef
    if aux_coef is None:
        aux_coef = router_aux_loss_coef(model)
    updates = cfg.algo.epochs * cfg.algo.minibatches
    learner = LocalLearner(
        model, build_objective(algorithm, cfg.algo, max_len=cfg.rollout.max_new_tokens), cfg.train,
        temperature=cfg.rollout.temperature if algorithm.online else 1.0,
        aux_loss_coef=aux_coef, updates_per_step=updates,
    )
    rng = torch.Generator().manual_seed(cfg.train.seed)
    minibatch_rng = torch.Generator().manual_seed(cfg.train.seed + 1)
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
        state=LocalState(generators={"sampling": rng, "minibatch": minibatch_rng}),
        collate=None if algorithm.online else partial(collate_sft, pad_id=tokenizer.pad_token_id),
        data_warnings=[
            f"data: skipped {part.skipped} bad rows of {part.source}; first: {part.skip_examples[0]}"
            for part in (train_set, eval_set) if part is not None and part.skipped
        ],
    )
    if algorithm.requires_reference(cfg.algo.kl_coef):
        run.reference_logprobs = _reference_fn(cfg, model_dir, model)
    if algorithm.needs_critic:
        run.critic = _build_critic(cfg, model_dir, updates)
    if cfg.algo.kl_in_reward:
        run.kl = KLCoefficient(cfg.algo.kl_coef, cfg.algo.kl_target, cfg.algo.kl_horizon)
    return run


def _build_critic(cfg: Config, model_dir: str, updates: int) -> LocalLearner:
    """PPO's critic: the policy's body with a value head, its own AdamW at ``critic_lr``."""
    critic = load_critic(
        cfg.model.critic_path or model_dir, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code
    )
    lr = cfg.algo.critic_lr if cfg.algo.critic_lr is not None else cfg.train.lr
    return LocalLearner(critic, value_objective(cfg.algo), cfg.train.model_copy(update={"lr": lr}), updates_per_step=updates)


def _reference_fn(cfg: Config, model_dir: str, policy: torch.nn.Module):
    """``(TrainBatch) -> [B, C]`` log-probs under the frozen reference: the initial policy.

    With LoRA the reference is the policy's own module with its adapters switched off (no
    second copy in memory); otherwise a second, frozen copy of ``model_dir``."""
    kwargs = dict(field="logprobs", budget=cfg.train.micro_batch_tokens, temperature=cfg.rollout.temperature)
    if is_lora(policy):

        def logprobs(batch):
            training = policy.training
            with adapters_disabled(policy):
                out = predict(policy.eval(), logprob_forward, batch, **kwargs)
            policy.train(training)
            return out

        return logprobs
    reference = load_model(model_dir, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code)
    reference.eval().requires_grad_(False)
    return partial(predict, reference, logprob_forward, **kwargs)


def run_local(cfg: Config, *, config_dir: Path | None = None) -> Run:
    """Train ``cfg`` in this process and export the final model."""
    run = build_run(cfg, config_dir=config_dir)
    train(run)
    if cfg.checkpoint.final:
        export_hf(run.learner.model, run.tokenizer, run.run_dir / "final")
    return run
