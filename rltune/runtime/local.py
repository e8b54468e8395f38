"""The local runtime: every piece in this process, the generator sharing the learner's module."""

from __future__ import annotations

import copy
import difflib
import random
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch

from rltune.algos import ALGORITHMS, Algorithm
from rltune.checkpoint.export import export_hf
from rltune.config import Config, ConfigError, save_resolved_config
from rltune.data.loaders import load_prompts
from rltune.data.collate import collate_sft
from rltune.data.sampler import PromptSampler
from rltune.learner.learner import LocalLearner, predict
from rltune.learner.objectives import Objective, build_objective, logprobs_only, value_objective
from rltune.models.load import load_model, load_tokenizer, resolve_model, router_aux_loss_coef
from rltune.learner.preference import PREFERENCE_METHODS, preference_method
from rltune.models.lora import adapters_disabled, apply_lora, is_lora
from rltune.models.value import load_critic
from rltune.rewards.scorer import LocalScorer, build_reward_fns
from rltune.data.chat import encode_prompt
from rltune.envs.episodes import EpisodeGenerator
from rltune.envs.loading import load_env_factory
from rltune.envs.tool_format import turn_glue
from rltune.rollout.hf import HFGenerator, eos_ids
from rltune.runtime.kl import KLCoefficient
from rltune.runtime.loop import Run, rollouts_ahead, train
from rltune.runtime.preference import PreferenceParts, build_preference_parts, load_preference_model
from rltune.runtime.rundir import prepare_run_dir


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


class Roles(Protocol):
    """Where a run's generator, scorer and policy learner live when not in this process
    (``runtime.mode: ray``: ``rltune.runtime.ray.run.RayRoles``). Everything else (data,
    sampler, reference, critic, the loop) :func:`build_run` builds the same for every
    runtime."""

    def learner(self, cfg: Config, model_dir: str) -> Any: ...
    def generator(self, cfg: Config, model_dir: str) -> Any: ...
    def scorer(self, cfg: Config) -> Any: ...
    def run_state(self, generators: dict[str, torch.Generator]) -> Any: ...


def build_run(cfg: Config, *, config_dir: Path | None = None, roles: Roles | None = None) -> Run:
    """Load model, data and rewards for ``cfg`` and wire them into a :class:`Run`: in this
    process, or with the generator, scorer and learner that ``roles`` starts elsewhere."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    seed_everything(cfg.train.seed)
    # every input a user can get wrong is checked before the model's weights are loaded
    algorithm = lookup_algorithm(cfg.algo.name)
    reward_fns = build_reward_fns(cfg.reward, base_dir=str(config_dir) if config_dir else None)
    make_env = load_env_factory(cfg.env.name, cfg.env.kwargs, base_dir=config_dir) if cfg.env.name else None
    if algorithm.online and not reward_fns and cfg.env.name is None:
        raise ConfigError(f"algo.name={cfg.algo.name} generates rollouts and needs at least one entry in `reward`")
    run_dir = Path(cfg.log.dir) / cfg.name
    # before anything is written there: an old run is never overwritten or mixed with this one
    moved = prepare_run_dir(cfg, run_dir)
    model_dir = resolve_model(cfg.model.path)
    tokenizer = load_tokenizer(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    if cfg.algo.name in PREFERENCE_METHODS:
        parts = _preference_parts(cfg, model_dir, tokenizer, run_dir)
        model, train_prompts, eval_prompts = parts.model, parts.train_prompts, parts.eval_prompts
        objective, warnings = parts.objective, parts.data_warnings
    else:
        train_set = load_prompts(cfg.data.train, cfg.data, tokenizer, with_completion=not algorithm.online)
        eval_set = load_prompts(cfg.data.eval, cfg.data, tokenizer) if cfg.data.eval else None
        model = load_policy(cfg, model_dir) if roles is None else None
        train_prompts = train_set.prompts
        eval_prompts = eval_set.prompts if eval_set and (reward_fns or cfg.env.name) else None
        objective = build_objective(algorithm, cfg.algo, max_len=cfg.rollout.max_new_tokens)
        warnings = [
            f"data: skipped {part.skipped} bad rows of {part.source}; first: {part.skip_examples[0]}"
            for part in (train_set, eval_set) if part is not None and part.skipped
        ]
    updates = cfg.algo.epochs * cfg.algo.minibatches
    rng = torch.Generator().manual_seed(cfg.train.seed)
    minibatch_rng = torch.Generator().manual_seed(cfg.train.seed + 1)
    generators = {"sampling": rng, "minibatch": minibatch_rng}
    if roles is None:
        learner = LocalLearner(model, objective, cfg.train, **learner_options(cfg, algorithm, model))
        # preference runs are judged without generating (a reward model cannot)
        generator = None if cfg.algo.name in PREFERENCE_METHODS else make_generator(cfg, model_dir, model, tokenizer, rng, make_env)
        scorer, state = _scorer(cfg, reward_fns), LocalState(generators=generators)
    else:
        del generators["sampling"]  # each generator actor samples with its own stream
        learner = roles.learner(cfg, model_dir)
        generator = roles.generator(cfg, model_dir) if algorithm.online else None
        scorer = roles.scorer(cfg) if reward_fns or cfg.env.name else None
        state = roles.run_state(generators)
    save_resolved_config(cfg, run_dir)
    run = Run(
        cfg=cfg,
        algorithm=algorithm,
        run_dir=run_dir,
        generator=generator,
        scorer=scorer,
        learner=learner,
        sampler=PromptSampler(len(train_prompts), seed=cfg.train.seed, shuffle=cfg.data.shuffle),
        train_prompts=train_prompts,
        eval_prompts=eval_prompts,
        pad_id=tokenizer.pad_token_id,
        tokenizer=tokenizer,
        shared_weights=roles is None and cfg.rollout.engine == "hf",  # vLLM holds its own copy
        state=state,
        collate=None if algorithm.online else partial(collate_sft, pad_id=tokenizer.pad_token_id),
        data_warnings=warnings,
        notes=[moved] if moved else [],
    )
    if cfg.algo.name in PREFERENCE_METHODS:
        run.collate = parts.collate
        run.evaluate_model = partial(_evaluate_preferences, parts, local=roles is None)
    if algorithm.online and algorithm.requires_reference(cfg.algo.kl_coef):
        run.reference_logprobs = _reference_fn(cfg, model_dir, model)
    if algorithm.needs_critic:
        run.critic = _build_critic(cfg, model_dir, updates)
    if cfg.algo.kl_in_reward:
        run.kl = KLCoefficient(cfg.algo.kl_coef, cfg.algo.kl_target, cfg.algo.kl_horizon)
    if cfg.runtime.max_staleness > 0:
        if run.shared_weights:
            # the producer generates on its own copy while the learner updates the original
            run.generator = make_generator(cfg, model_dir, copy.deepcopy(model).eval(), tokenizer, rng, make_env)
            run.shared_weights = False
        run.rollouts = rollouts_ahead(run, cfg.runtime.max_staleness)
    return run


def learner_options(cfg: Config, algorithm: Algorithm, model: torch.nn.Module) -> dict:
    """The policy learner's keyword arguments besides model, objective and ``cfg.train``
    (shared by every runtime that builds one)."""
    aux_coef = cfg.model.router_aux_loss_coef
    return {
        "temperature": cfg.rollout.temperature if algorithm.online else 1.0,
        "aux_loss_coef": router_aux_loss_coef(model) if aux_coef is None else aux_coef,
        "updates_per_step": cfg.algo.epochs * cfg.algo.minibatches,
    }


def lookup_algorithm(name: str) -> Algorithm:
    """The registry entry ``algo.name`` names; a ConfigError naming the closest on a typo."""
    if name in ALGORITHMS:
        return ALGORITHMS[name]
    close = difflib.get_close_matches(name, ALGORITHMS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"algo.name: unknown algorithm {name!r}{hint}; known: {', '.join(ALGORITHMS)}")


def load_policy(cfg: Config, model_dir: str) -> torch.nn.Module:
    model = load_model(model_dir, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code)
    return apply_lora(model, cfg.model.lora) if cfg.model.lora is not None else model


def learner_model(cfg: Config, model_dir: str) -> torch.nn.Module:
    """The model the learner trains, as :func:`build_run` loads it: the policy, or for a
    preference method its model (a reward model for reward_model), LoRA as configured."""
    if cfg.algo.name in PREFERENCE_METHODS:
        model = load_preference_model(cfg, model_dir)
        return apply_lora(model, cfg.model.lora) if cfg.model.lora is not None else model
    return load_policy(cfg, model_dir)


def learner_objective(cfg: Config, algorithm: Algorithm) -> Objective:
    """The learner's objective: the preference method's, or the policy learner's."""
    if cfg.algo.name in PREFERENCE_METHODS:
        return preference_method(cfg.algo.name).objective(cfg.algo)
    return build_objective(algorithm, cfg.algo, max_len=cfg.rollout.max_new_tokens)


def _preference_parts(cfg: Config, model_dir: str, tokenizer, run_dir: Path) -> PreferenceParts:
    """DPO, SimPO, reward model: the model (LoRA-wrapped when configured, so that DPO's
    reference is the base with adapters off), pairs, objective and held-out evaluation.
    DPO's reference log-probs are computed here, before any checkpoint is restored."""
    model = None
    if cfg.model.lora is not None:
        model = learner_model(cfg, model_dir)
    return build_preference_parts(
        cfg, model_dir=model_dir, tokenizer=tokenizer, run_dir=run_dir,
        reference_context=adapters_disabled if model is not None else None, model=model,
    )


def _evaluate_preferences(parts: PreferenceParts, learner: Any, *, local: bool) -> dict[str, float]:
    """Held-out preference metrics of the learner's model: its own module here, or, with
    the learner elsewhere, the driver's copy (``parts.model``) with its newest weights."""
    if local:
        return parts.evaluate(learner.model)
    if not parts.eval_prompts:
        return {}
    parts.model.load_state_dict(learner.fetch_weights())
    return parts.evaluate(parts.model)


def _build_critic(cfg: Config, model_dir: str, updates: int) -> LocalLearner:
    """PPO's critic: the policy's body with a value head, its own AdamW at ``critic_lr``."""
    critic = load_critic(
        cfg.model.critic_path or model_dir, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code
    )
    lr = cfg.algo.critic_lr if cfg.algo.critic_lr is not None else cfg.train.lr
    return LocalLearner(critic, value_objective(cfg.algo), cfg.train.model_copy(update={"lr": lr}), updates_per_step=updates)


def _reference_fn(cfg: Config, model_dir: str, policy: torch.nn.Module | None):
    """``(TrainBatch) -> [B, C]`` log-probs under the frozen reference: the initial policy.

    With LoRA the reference is the policy's own module with its adapters switched off (no
    second copy in memory); otherwise a second, frozen copy of ``model_dir``."""
    kwargs = dict(field="logprobs", budget=cfg.train.micro_batch_tokens, temperature=cfg.rollout.temperature)
    if policy is not None and is_lora(policy):

        def logprobs(batch):
            training = policy.training
            with adapters_disabled(policy):
                out = predict(policy.eval(), logprobs_only, batch, **kwargs)
            policy.train(training)
            return out

        return logprobs
    reference = load_model(model_dir, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code)
    reference.eval().requires_grad_(False)
    return partial(predict, reference, logprobs_only, **kwargs)


def make_generator(cfg: Config, model_dir: str, model, tokenizer, rng: torch.Generator, make_env):
    """The sampler ``rollout.engine`` names: rltune's on ``model``, or a vLLM engine with
    its own copy of ``model_dir`` (``model`` unused; may be None). With an environment,
    episodes of it played by the sampler."""
    if cfg.rollout.engine == "vllm":
        from rltune.rollout.vllm import VLLMGenerator, engine_args

        sampler = VLLMGenerator(
            model_dir, tokenizer, dtype=cfg.model.dtype, rng=rng, seed=int(rng.initial_seed()),
            trust_remote_code=cfg.model.trust_remote_code, engine_args=engine_args(cfg.rollout.vllm),
        )
        stops = sampler.eos_ids
    else:
        sampler = HFGenerator(model, tokenizer, rng=rng)
        stops = eos_ids(model, tokenizer)
    if make_env is None:
        return sampler
    return EpisodeGenerator(
        sampler, tokenizer, make_env,
        glue=turn_glue(tokenizer, use_chat_template=cfg.data.chat_template),
        encode=partial(
            encode_prompt, tokenizer, system_prompt=cfg.data.system_prompt,
            use_chat_template=cfg.data.chat_template,
        ),
        max_turns=cfg.env.max_turns, max_total_tokens=cfg.env.max_total_tokens,
        eos_ids=stops,
    )


def _scorer(cfg: Config, reward_fns: list) -> LocalScorer | None:
    if not reward_fns and cfg.env.name is None:
        return None
    r = cfg.runtime
    return LocalScorer(
        reward_fns, max_workers=r.reward_workers, pool=r.reward_pool, cache_size=r.reward_cache_size
    )


def run_local(cfg: Config, *, config_dir: Path | None = None) -> Run:
    """Train ``cfg`` in this process and export the final model."""
    run = build_run(cfg, config_dir=config_dir)
    try:
        train(run)
    finally:
        if run.scorer is not None:
            run.scorer.close()
    if cfg.checkpoint.final:
        export_hf(run.learner.model, run.tokenizer, run.run_dir / "final")
    return run
