"""One builder for every runtime: :func:`build_run` checks the inputs, loads the data,
asks a :class:`~rltune.runtime.roles.Roles` for each role the algorithm needs, and wires
them into a :class:`~rltune.runtime.parts.Run` with its batch source and evaluation.

Roles are built in one order whatever the runtime (learner, generator, scorer, reference,
critic), so every random draw at start-up happens in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rltune.algos import Algorithm, config_problems
from rltune.algos.registry import critic_warmup_note
from rltune.config import Config, ConfigError, save_resolved_config
from rltune.config.ignored import ray_keys_note, ray_threads_note, unused_setting_problems
from rltune.data.collate import collate_sft
from rltune.data.loaders import load_prompts
from rltune.data.records import Prompt
from rltune.data.sampler import PromptSampler
from rltune.envs.loading import load_env_factory
from rltune.models.load import ModelLoadError, load_processor, load_tokenizer, resolve_model
from rltune.rewards.scorer import RewardFn, build_reward_fns
from rltune.runtime.collect import Collector
from rltune.runtime.evaluate import Evaluation, GeneratedEvaluation, PreferenceEvaluation
from rltune.runtime.kl import KLCoefficient
from rltune.runtime.parts import Progress, Run, RunData, RunRoles, RunSpec
from rltune.runtime.preference import (
    PreferenceParts,
    PreferencePairs,
    load_preference_pairs,
    score_preference_pairs,
    skip_warnings,
)
from rltune.runtime.roles import (
    EnvFactory, Roles, check_critic_vocabulary, dense_router_loss_message, is_preference,
    lookup_algorithm, model_positions, model_vocab_size, plays_episodes, seed_everything, tokenizer_ids,
)
from rltune.parallel.layout import expert_count, model_config_of
from rltune.runtime.rollouts import thread_shares
from rltune.runtime.rundir import prepare_run_dir
from rltune.runtime.sources import AheadOfLearner, BatchSource, Experience, Offline, OnPolicy

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, ProcessorMixin


@dataclass(frozen=True)
class _Inputs:
    """What a user can get wrong, checked before any model weights are loaded."""

    algorithm: Algorithm
    reward_fns: list[RewardFn]
    make_env: EnvFactory | None

    @property
    def judged(self) -> bool:
        """Samples can be scored (rewards, or an environment's own)."""
        return bool(self.reward_fns) or self.make_env is not None


def build_run(cfg: Config, roles: Roles, *, config_dir: Path | None = None) -> Run:
    """Load model, data and rewards for ``cfg`` and wire them into a :class:`Run`, each role
    built by ``roles`` (``LocalRoles``: in this process; ``RayRoles``: as Ray actors)."""
    learner_threads, producer_threads = _thread_shares(cfg)
    if learner_threads:
        torch.set_num_threads(learner_threads)
    seed_everything(cfg.train.seed)
    inputs = _check_inputs(cfg, config_dir)
    run_dir = Path(cfg.log.dir) / cfg.name
    # before anything is written there: an old run is never overwritten or mixed with this one
    moved = prepare_run_dir(cfg, run_dir)
    model_dir = resolve_model(cfg.model.path)
    # a vision-language model's processor renders its prompts; its tokenizer is the run's
    processor = load_processor(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    tokenizer = processor.tokenizer if processor is not None else load_tokenizer(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    _check_vocabulary(model_dir, tokenizer)
    _check_router_loss(cfg, model_dir)
    if inputs.algorithm.needs_critic:
        check_critic_vocabulary(cfg, model_dir, tokenizer)
    pairs = _preference_pairs(cfg, model_dir, tokenizer, processor) if is_preference(cfg) else None
    data = _run_data(cfg, inputs, tokenizer, processor, pairs)
    _check_positions(cfg, model_dir, inputs.algorithm.online, data)
    sampling = torch.Generator().manual_seed(cfg.train.seed)
    minibatch = torch.Generator().manual_seed(cfg.train.seed + 1)
    run_roles = _build_roles(cfg, roles, inputs, model_dir, data, sampling)
    roles.started()
    # the learner scores the pairs (no copy of the model here); DPO's reference is its
    # starting weights, taken before any checkpoint is restored into it
    preference = score_preference_pairs(cfg, pairs, run_roles.learner, run_dir) if pairs is not None else None
    save_resolved_config(cfg, run_dir)
    return Run(
        spec=RunSpec(cfg, inputs.algorithm, run_dir, notes=tuple(
            n for n in (moved, _bf16_weights_note(cfg), critic_warmup_note(inputs.algorithm, cfg), ray_keys_note(cfg),
                        ray_threads_note(cfg))
            if n)),
        data=data,
        roles=run_roles,
        source=_batch_source(cfg, inputs.algorithm, data, run_roles, preference, producer_threads),
        evaluation=_evaluation(cfg, data, run_roles, preference),
        progress=Progress(streams=roles.streams({"sampling": sampling, "minibatch": minibatch}), minibatch_rng=minibatch),
    )


def _bf16_weights_note(cfg: Config) -> str | None:
    """A line when the trained weights themselves are bf16 (``model.dtype: bfloat16``): with
    no fp32 master copy an update below about 1/256 of a weight rounds away. (LoRA's
    adapters are fp32 over the frozen bf16 weights.)"""
    if cfg.model.dtype != "bfloat16" or cfg.train.steps == 0 or cfg.model.lora is not None:
        return None
    return ("note: model.dtype=bfloat16 trains bf16 weights with no fp32 copy, so updates smaller than about "
            "1/256 of a weight round away; for bf16 arithmetic on fp32 weights set model.dtype: float32 and "
            "train.precision: bf16")


def _check_router_loss(cfg: Config, model_dir: str) -> None:
    """``model.router_aux_loss_coef`` on a dense model, refused here from its config alone:
    on Ray the learner actors would otherwise refuse it as they load the model (an actor's
    death each time, and restarts). The learner checks again (:func:`aux_loss_coef`)."""
    coef = cfg.model.router_aux_loss_coef
    if not coef:
        return
    config = model_config_of(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    if not expert_count(config):
        arch = (config.architectures or [type(config).__name__])[0]
        raise ModelLoadError(dense_router_loss_message(coef, arch))


def _check_vocabulary(model_dir: str, tokenizer: "PreTrainedTokenizerBase") -> None:
    """A ModelLoadError when ``tokenizer`` has ids past the rows of the model's embedding
    (:func:`~rltune.runtime.roles.model_vocab_size`): a prompt or completion holding one
    would index past it. More rows than ids is normal (a vocabulary padded to a round size)."""
    rows, ids = model_vocab_size(model_dir), tokenizer_ids(tokenizer)
    if rows is not None and ids > rows:
        raise ModelLoadError(
            f"model.path: the tokenizer in {model_dir} has {ids} token ids but the model's embedding has {rows} rows "
            f"(vocab_size in {Path(model_dir) / 'config.json'}), so a token with an id from {rows} up would index past "
            f"it; save the model's own tokenizer there, or resize the model's embeddings to {ids} rows "
            f"(`model.resize_token_embeddings({ids})`) and save the model again"
        )


def _check_positions(cfg: Config, model_dir: str, online: bool, data: RunData) -> None:
    """A ConfigError when the run's sequences need more positions than the model has
    (:func:`~rltune.runtime.roles.model_positions`). A generated sequence (online: the
    train prompts with ``rollout.max_new_tokens``; held-out evaluation by generating: the
    eval prompts with its new tokens) would fail or, on the CPU's decoder that reserves
    its cache up front, exhaust memory. An offline row (SFT's prompt and completion, a
    preference pair's prompt and longer response) would train on positions past the
    model's (an IndexError for learned positions). A preference run's pairs are checked
    as they load (:func:`_check_pairs`). With an environment, a prompt is checked with its
    first turn (at most ``env.max_total_tokens``); the turns after it end their episode
    at the positions as they are played (:class:`~rltune.envs.episodes.EpisodeGenerator`)."""
    limit = _position_limit(model_dir)
    if limit is None or is_preference(cfg):
        return
    budget = cfg.env.max_total_tokens if cfg.env.name is not None else None
    if online:
        key, new = _first_turn(f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}", cfg.rollout.max_new_tokens, budget)
        _check_generated(data.train_prompts, key, "prompts", new, limit)
    else:
        _check_rows(data.train_prompts, f"data.train={cfg.data.train}", limit)
    if data.eval_prompts is None:
        return
    new = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    key, new = _first_turn(f"eval.max_new_tokens={new}" if cfg.eval.max_new_tokens else
                           f"eval.max_new_tokens (unset: rollout.max_new_tokens={new})", new, budget)
    _check_generated(data.eval_prompts[: cfg.eval.max_prompts], key, f"eval prompts (data.eval={cfg.data.eval})", new,
                     limit, fix="lower eval.max_new_tokens or data.max_prompt_tokens")


def _first_turn(key: str, new_tokens: int, budget: int | None) -> tuple[str, int]:
    """The key and count of a first turn's new tokens: ``new_tokens``, or an environment's
    ``budget`` (``env.max_total_tokens``) where that is smaller."""
    if budget is None or budget >= new_tokens:
        return key, new_tokens
    return f"env.max_total_tokens={budget} (the first turn's budget)", budget


def _check_pairs(cfg: Config, model_dir: str, train: list[Prompt], held_out: list[Prompt] | None) -> None:
    """:func:`_check_positions` for a preference run's pairs, called as they load: before
    the model loads and DPO's reference log-probs are computed and written."""
    limit = _position_limit(model_dir)
    if limit is None:
        return
    _check_rows(train, f"data.train={cfg.data.train}", limit)
    if held_out is not None:
        _check_rows(held_out, f"data.eval={cfg.data.eval}", limit)


def _position_limit(model_dir: str) -> tuple[int, str] | None:
    """The model's positions and where they are read from, for the messages; None when
    they cannot be judged (:func:`~rltune.runtime.roles.model_positions`)."""
    limit = model_positions(model_dir)
    return None if limit is None else (limit, f"max_position_embeddings in {Path(model_dir) / 'config.json'}")


def _check_generated(prompts: list[Prompt], key: str, what: str, new_tokens: int, limit: tuple[int, str], *,
                     fix: str = "lower rollout.max_new_tokens or data.max_prompt_tokens") -> None:
    """A ConfigError when the longest of ``prompts`` followed by ``new_tokens`` generated
    tokens needs more positions than ``limit`` (the count, and where it is read from)."""
    longest = max((len(p.input_ids) for p in prompts if p.input_ids is not None), default=0)
    if longest + new_tokens > limit[0]:
        raise ConfigError(
            f"{key} after {what} of up to {longest} tokens needs {longest + new_tokens} positions, but the model "
            f"has {limit[0]} ({limit[1]}); {fix}"
        )


def _check_rows(prompts: list[Prompt], key: str, limit: tuple[int, str]) -> None:
    """A ConfigError when rows of offline data (prompt and target completion, or prompt and
    the longer of a pair's responses) are longer than ``limit`` positions."""
    def response(p: Prompt) -> int:
        meta = p.meta
        return len(meta["completion_ids"]) if "completion_ids" in meta else max(
            len(meta.get("chosen_ids", ())), len(meta.get("rejected_ids", ())))

    lengths = {p.id: (len(p.input_ids), response(p)) for p in prompts if p.input_ids is not None}
    over = [i for i, (prompt, resp) in lengths.items() if prompt + resp > limit[0]]
    if over:
        worst = max(over, key=lambda i: sum(lengths[i]))
        prompt, resp = lengths[worst]
        what = "completion" if any("completion_ids" in p.meta for p in prompts) else "longer response"
        raise ConfigError(
            f"{key}: {len(over)} row(s) are longer than the model's {limit[0]} positions ({limit[1]}); the longest, "
            f"{worst}, has {prompt} prompt + {resp} {what} tokens = {prompt + resp}; shorten or drop the rows over "
            f"{limit[0]} tokens (prompt and {what} together), or use a model with more positions"
        )


def _thread_shares(cfg: Config) -> tuple[int | None, int | None]:
    """Torch threads ``(learner, producer)`` of this process; None leaves torch's default.

    A local run with rollouts ahead of the learner generates in a producer thread while the
    learner learns, so the two get disjoint shares of the cores (:func:`thread_shares`:
    ``rollout.threads``, default half; ``train.threads``, default the rest). Otherwise the
    process runs one side at a time (``train.threads``), or generates in Ray actors."""
    if cfg.runtime.mode != "local" or cfg.runtime.max_staleness == 0:
        return cfg.train.threads, None
    return thread_shares(torch.get_num_threads(), cfg.train.threads, cfg.rollout.threads)


def _check_inputs(cfg: Config, config_dir: Path | None) -> _Inputs:
    algorithm = lookup_algorithm(cfg.algo.name)
    problems = config_problems(algorithm, cfg)  # what the registry says this algorithm needs
    problems += setting_problems(algorithm, cfg)
    if problems:
        raise ConfigError("; ".join(problems))
    reward_fns = build_reward_fns(cfg.reward, base_dir=str(config_dir) if config_dir else None)
    make_env = load_env_factory(cfg.env.name, cfg.env.kwargs, base_dir=config_dir) if cfg.env.name else None
    return _Inputs(algorithm, reward_fns, make_env)


def setting_problems(algorithm: Algorithm, cfg: Config) -> list[str]:
    """Settings set away from their defaults that this run would not read, one line each
    (:func:`rltune.config.ignored.unused_setting_problems`): among them an environment in
    a run that never plays episodes (a preference method scores held-out pairs and never
    generates; SFT generates only to evaluate on ``data.eval``)."""
    why = (" (it learns from preference pairs and never generates, not even to evaluate); set env.name: null"
           if is_preference(cfg) else
           " without data.eval (it learns from a fixed dataset and generates only to evaluate on data.eval); "
           "set data.eval, or env.name: null")
    return unused_setting_problems(cfg, plays_episodes=plays_episodes(algorithm, cfg), algorithm=algorithm.name,
                                   why_no_episodes=why)


def _preference_pairs(cfg: Config, model_dir: str, tokenizer: "PreTrainedTokenizerBase",
                      processor: "ProcessorMixin | None") -> PreferencePairs:
    """DPO, SimPO, reward model: the pairs, checked against the model's positions as they
    load. The learner scores them once it is built (:func:`score_preference_pairs`)."""
    return load_preference_pairs(cfg, tokenizer, processor=processor, check_rows=partial(_check_pairs, cfg, model_dir))


def _run_data(cfg: Config, inputs: _Inputs, tokenizer: "PreTrainedTokenizerBase",
              processor: "ProcessorMixin | None", pairs: PreferencePairs | None) -> RunData:
    if pairs is not None:
        train, held_out, warnings = pairs.train_prompts, pairs.eval_prompts, pairs.data_warnings
    else:
        # a row's other fields reach per-sample rewards as keywords beside prompt and completion
        vl = {"processor": processor, "model": cfg.model.path,
              "fields_are_keywords": any(not rf.batched for rf in inputs.reward_fns)}
        train_set = load_prompts(cfg.data.train, cfg.data, tokenizer, with_completion=not inputs.algorithm.online, **vl)
        eval_set = load_prompts(cfg.data.eval, cfg.data, tokenizer, **vl) if cfg.data.eval else None
        train = train_set.prompts
        held_out = eval_set.prompts if eval_set and inputs.judged else None
        warnings = skip_warnings(train_set, eval_set)
    sampler = PromptSampler(len(train), seed=cfg.train.seed, shuffle=cfg.data.shuffle)
    return RunData(train, held_out, sampler, tokenizer, tokenizer.pad_token_id, tuple(warnings))


def _build_roles(cfg: Config, roles: Roles, inputs: _Inputs, model_dir: str, data: RunData,
                 sampling: torch.Generator) -> RunRoles:
    """The roles the algorithm needs, in one order. A generator when the run generates:
    online algorithms, and held-out evaluation by generating (SFT with rewards)."""
    algorithm = inputs.algorithm
    learner = roles.learner(cfg, model_dir, algorithm)
    generator = None
    if not is_preference(cfg) and (algorithm.online or data.eval_prompts is not None):
        generator = roles.generator(cfg, model_dir, data.tokenizer, sampling, inputs.make_env)
    scorer = roles.scorer(cfg, inputs.reward_fns) if inputs.judged else None
    needs_reference = algorithm.online and algorithm.requires_reference(cfg.algo.kl_coef)
    return RunRoles(
        learner=learner,
        generator=generator,
        scorer=scorer,
        reference=roles.reference(cfg, model_dir) if needs_reference else None,
        critic=roles.critic(cfg, model_dir) if algorithm.needs_critic else None,
        kl=KLCoefficient(cfg.algo.kl_coef, cfg.algo.kl_target, cfg.algo.kl_horizon) if cfg.algo.kl_in_reward else None,
        shared_weights=generator is not None and roles.shares_weights(cfg),
    )


def _batch_source(cfg: Config, algorithm: Algorithm, data: RunData, roles: RunRoles,
                  preference: PreferenceParts | None, producer_threads: int | None) -> BatchSource:
    n = cfg.train.prompts_per_step
    if not algorithm.online:
        collate = preference.collate if preference is not None else partial(collate_sft, pad_id=data.pad_id)
        return Offline(data, collate, roles, n)
    if roles.generator is None or roles.scorer is None:
        raise ValueError(f"algo.name={cfg.algo.name} generates: the run needs a generator and a scorer")
    collector = Collector(cfg, data, roles.generator, roles.scorer)
    experience = Experience(algorithm, cfg.algo, data.pad_id, roles)
    if cfg.runtime.max_staleness > 0:
        return AheadOfLearner(collector, experience, max_staleness=cfg.runtime.max_staleness, prompts_per_step=n,
                              threads=producer_threads)
    return OnPolicy(collector, experience, n)


def _evaluation(cfg: Config, data: RunData, roles: RunRoles, preference: PreferenceParts | None) -> Evaluation | None:
    """Preference methods score held-out pairs with the learner's model (they do not
    generate); the others generate on ``eval_prompts`` and score with the run's rewards."""
    if preference is not None:
        return PreferenceEvaluation(preference)
    if data.eval_prompts is None or roles.generator is None or roles.scorer is None:
        return None
    return GeneratedEvaluation(roles.generator, roles.scorer, data.eval_prompts, cfg.eval, cfg.rollout)
