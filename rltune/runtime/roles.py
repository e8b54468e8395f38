"""The role factories every runtime builds from, and the :class:`Roles` protocol.

A run is made of the same roles wherever they run: a generator, a scorer, the policy
learner, and when the algorithm needs them the reference model (the KL term) and PPO's
critic. :func:`rltune.runtime.build.build_run` asks a :class:`Roles` for each;
``runtime/local.py`` (:class:`~rltune.runtime.local.LocalRoles`) builds them in this
process and ``runtime/ray/roles.py`` (``RayRoles``) as Ray actors. Both build the models,
objectives and samplers with the functions below, so the two start identical.
"""

from __future__ import annotations

import difflib
import json
import random
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from rltune.algos import ALGORITHMS, Algorithm
from rltune.checkpoint.meaning import is_preference, plays_episodes
from rltune.config import Config, ConfigError
from rltune.data.chat import encode_prompt
from rltune.data.records import TrainBatch
from rltune.envs.episodes import EpisodeGenerator
from rltune.envs.tool_format import turn_glue
from rltune.learner.distributed import to_device
from rltune.learner.learner import LocalLearner, predict
from rltune.learner.objectives import Objective, build_objective, logprobs_only, value_objective
from rltune.learner.parallel import NoParallelism
from rltune.learner.preference import preference_method
from rltune.learner.precision import generator_precision, vllm_dtype
from rltune.models.autocast import autocast_for
from rltune.models.chunked import set_logprob_chunk_tokens
from rltune.models.load import (
    TOKENIZER_FILES, ModelLoadError, is_moe, load_model, load_tokenizer, resolve_model, router_aux_loss_coef,
)
from rltune.models.lora import apply_lora, is_lora
from rltune.models.routing import install_routing
from rltune.models.vision import freeze_vision, is_vision_language
from rltune.models.value import load_critic
from rltune.rewards.scorer import LocalScorer, RewardFn
from rltune.rollout.hf import HFGenerator, eos_ids
from rltune.runtime.preference import load_preference_model
from rltune.runtime.protocols import Critic, Generator, Learner, Reference, Scorer, Streams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rltune.envs.base import Environment

EnvFactory = Callable[[], "Environment"]


class Roles(Protocol):
    """Where a run's roles live. Each method builds one role for ``cfg``; the builder calls
    them in the order listed, once each, and only for the roles the run has."""

    def learner(self, cfg: Config, model_dir: str, algorithm: Algorithm) -> Learner:
        """The policy learner (a preference method's model, which also scores its pairs:
        ``Learner.pair_outputs``)."""
        ...

    def generator(self, cfg: Config, model_dir: str, tokenizer: "PreTrainedTokenizerBase",
                  rng: torch.Generator, make_env: EnvFactory | None) -> Generator:
        """The sampler; ``rng`` is the run's sampling stream (local runtime)."""
        ...

    def shares_weights(self, cfg: Config) -> bool:
        """Whether the generator runs on the learner's own module (nothing to publish)."""
        ...

    def scorer(self, cfg: Config, reward_fns: list[RewardFn]) -> Scorer: ...
    def reference(self, cfg: Config, model_dir: str) -> Reference: ...
    def critic(self, cfg: Config, model_dir: str) -> Critic: ...
    def streams(self, generators: dict[str, torch.Generator]) -> Streams:
        """The RNG streams a checkpoint carries: ``generators`` and those of remote roles."""
        ...

    def started(self) -> None:
        """Waits until every role built so far is ready to be called (remote roles may
        start together); raises the first start-up error."""
        ...


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed)


def lookup_algorithm(name: str) -> Algorithm:
    """The registry entry ``algo.name`` names; a ConfigError naming the closest on a typo."""
    if name in ALGORITHMS:
        return ALGORITHMS[name]
    close = difflib.get_close_matches(name, ALGORITHMS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"algo.name: unknown algorithm {name!r}{hint}; known: {', '.join(ALGORITHMS)}")


def learner_options(cfg: Config, algorithm: Algorithm, model: torch.nn.Module) -> dict:
    """The policy learner's keyword arguments besides model, objective and ``cfg.train``
    (shared by every runtime that builds one)."""
    return {
        "temperature": cfg.rollout.temperature if algorithm.online else 1.0,
        "aux_loss_coef": aux_loss_coef(cfg, model),
        "updates_per_step": cfg.algo.epochs * cfg.algo.minibatches,
        "skip_zero_advantage": cfg.algo.skip_zero_advantage,
    }


def aux_loss_coef(cfg: Config, model: torch.nn.Module) -> float:
    """The router load-balancing loss weight the learner adds for ``model`` (as it holds
    it, LoRA included): ``model.router_aux_loss_coef``, else the model config's, 0 for a
    dense model. A dense model with a weight set is refused, like ``model.moe`` on one
    (:func:`load_policy`): it has no router whose loss the weight would scale."""
    coef = cfg.model.router_aux_loss_coef
    if coef and not (hasattr(model, "config") and is_moe(model)):
        base = model.get_base_model() if is_lora(model) else model
        raise ModelLoadError(dense_router_loss_message(coef, type(base).__name__))
    return router_aux_loss_coef(model) if coef is None else coef


def dense_router_loss_message(coef: float, model_class: str) -> str:
    """Why ``model.router_aux_loss_coef`` cannot apply to a dense model of ``model_class``."""
    return (f"model.router_aux_loss_coef: {coef} needs a mixture-of-experts model (it weighs the routers' "
            f"load-balancing loss); {model_class}: it has no experts (a dense model). Turn the option off "
            f"for this model (router_aux_loss_coef: null)")


def load_policy(cfg: Config, model_dir: str) -> torch.nn.Module:
    """The policy as the learner and the generators hold it: a vision-language model's
    vision tower and projector frozen (``model.freeze_vision``), an MoE model's routers
    installed for routing replay and aux-free balancing (``model.moe``) before any
    adapter, wrapper or checkpoint; a dense model with either option is refused here
    (and with ``model.router_aux_loss_coef``, by :func:`aux_loss_coef`)."""
    model = load_model(model_dir, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code)
    set_logprob_chunk_tokens(model, cfg.train.logprob_chunk_tokens)
    if cfg.model.freeze_vision and is_vision_language(model):
        freeze_vision(model)
    moe = cfg.model.moe
    install_routing(model, replay=moe.routing_replay == "rollout", aux_free_bias=moe.aux_free_bias)
    if cfg.model.lora is None:
        return model
    return apply_lora(model, cfg.model.lora, language_model_only=cfg.model.freeze_vision)


def learner_model(cfg: Config, model_dir: str) -> torch.nn.Module:
    """The model the learner trains: the policy, or for a preference method its model (a
    reward model for reward_model), LoRA as configured."""
    if is_preference(cfg):
        model = load_preference_model(cfg, model_dir)
        if cfg.model.lora is None:
            return model
        return apply_lora(model, cfg.model.lora, language_model_only=cfg.model.freeze_vision)
    return load_policy(cfg, model_dir)


def learner_objective(cfg: Config, algorithm: Algorithm) -> Objective:
    """The learner's objective: the preference method's, or the policy learner's."""
    if is_preference(cfg):
        return preference_method(cfg.algo.name).objective(cfg.algo)
    return build_objective(algorithm, cfg.algo, max_len=cfg.rollout.max_new_tokens)


def load_reference_model(cfg: Config, model_dir: str, device: torch.device | None = None) -> torch.nn.Module:
    """A second, frozen copy of the starting policy (``model_dir``) for the KL term, on
    ``device`` (None: where it loads, the CPU)."""
    reference = load_model(model_dir, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code)
    set_logprob_chunk_tokens(reference, cfg.train.logprob_chunk_tokens)
    if device is not None:
        reference.to(device)
    return reference.eval().requires_grad_(False)


def model_logprobs(model: torch.nn.Module, batch: TrainBatch, options: dict) -> torch.Tensor:
    """``[B, C]`` log-probs of ``batch`` under ``model`` (no grad), computed on the model's
    device under the autocast of ``options["precision"]`` (:func:`reference_options`) and
    returned on the CPU, where the run's batches are."""
    device = next(model.parameters()).device
    kwargs = {key: value for key, value in options.items() if key != "precision"}
    autocast = partial(autocast_for, options.get("precision", "fp32"), device.type)
    return predict(model, logprobs_only, to_device(batch, device), autocast=autocast, **kwargs).cpu()


def reference_options(cfg: Config) -> dict:
    """Keyword arguments of :func:`rltune.learner.learner.predict` for reference log-probs,
    and ``train.precision``: the reference computes under the learner's autocast, as the
    policy's log-probs are, so that the KL measures how far the policy has moved, not the
    two precisions' rounding (before the first update it is 0; a float32 reference sat
    ~1e-2 a token from a 1B-class bf16 policy on a GPU, ``docs/performance.md``)."""
    return dict(field="logprobs", budget=cfg.train.micro_batch_tokens, temperature=cfg.rollout.temperature,
                precision=cfg.train.precision)


def critic_learner(cfg: Config, model_dir: str, device: torch.device | None = None) -> LocalLearner:
    """PPO's critic: the policy's body with a value head, its own AdamW at ``critic_lr``,
    on ``device`` (None: where it loads, the CPU)."""
    try:
        critic = load_critic(
            critic_dir(cfg, model_dir), dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code
        )
    except ModelLoadError as err:
        if cfg.model.critic_path is None:
            raise
        # the loader's fixes name the policy's key; here the directory came from the critic's
        raise ModelLoadError(f"model.critic_path: {err}".replace("`model.path`", "`model.critic_path`")) from err
    if cfg.model.freeze_vision and is_vision_language(critic.body):
        freeze_vision(critic.body)  # model.freeze_vision holds for the critic's tower and projector too
    lr = cfg.algo.critic_lr if cfg.algo.critic_lr is not None else cfg.train.lr
    updates = cfg.algo.epochs * cfg.algo.minibatches
    return LocalLearner(critic, value_objective(cfg.algo), cfg.train.model_copy(update={"lr": lr}),
                        parallelism=NoParallelism(device), updates_per_step=updates)


def critic_dir(cfg: Config, model_dir: str) -> str:
    """The directory PPO's critic starts from: ``model.critic_path`` (a ``builtin:`` name
    built as for ``model.path``), else the policy's ``model_dir``."""
    return resolve_model(cfg.model.critic_path) if cfg.model.critic_path else model_dir


def check_critic_vocabulary(cfg: Config, model_dir: str, tokenizer: "PreTrainedTokenizerBase") -> None:
    """A ModelLoadError when the critic of ``model.critic_path`` cannot read the policy's
    tokens: its embedding (``vocab_size`` of its ``config.json``) has fewer rows than the
    policy's ``tokenizer`` has ids, or its directory holds a tokenizer that lacks one of
    the policy's tokens or numbers one otherwise (the same ids would be other tokens); a
    superset of the policy's vocabulary (a token added after it) reads the same. Without ``model.critic_path`` the
    critic is the policy's own model and nothing is checked here."""
    if cfg.model.critic_path is None:
        return
    try:
        critic = critic_dir(cfg, model_dir)
    except ModelLoadError as err:
        raise ModelLoadError(f"model.critic_path: {err}".replace("`model.path`", "`model.critic_path`")) from err
    fix = ("set model.critic_path to a model with the policy's tokenizer, or leave it unset to start the critic "
           "from model.path")
    ids, rows = tokenizer_ids(tokenizer), model_vocab_size(critic)
    if rows is not None and rows < ids:
        raise ModelLoadError(
            f"model.critic_path: the critic's embedding has {rows} rows (vocab_size in {Path(critic) / 'config.json'}) "
            f"but the policy's tokenizer (model.path: {model_dir}) has {ids} ids, so ids from {rows} up would index "
            f"past it; {fix}"
        )
    if not any((Path(critic) / name).is_file() for name in TOKENIZER_FILES):
        return  # no tokenizer of its own: its rows are read as the policy's ids
    try:
        own = load_tokenizer(critic, trust_remote_code=cfg.model.trust_remote_code).get_vocab()
    except ModelLoadError as err:
        raise ModelLoadError(f"model.critic_path: {err}") from err
    policy = tokenizer.get_vocab()
    if any(own.get(token) != i for token, i in policy.items()):  # a superset (an added [PAD]) reads the same
        raise ModelLoadError(
            f"model.critic_path: the tokenizer in {critic} differs from the policy's (model.path: {model_dir}): "
            f"{_vocab_difference(own, policy)}, so the critic would value other tokens than the policy "
            f"generates; {fix}"
        )


def _vocab_difference(critic: dict[str, int], policy: dict[str, int]) -> str:
    """One of the policy's tokens that the critic's vocabulary lacks or numbers otherwise."""
    only = sorted(set(policy) - set(critic))
    if only:
        return f"{len(critic)} and {len(policy)} tokens, {only[0]!r} only in the policy's"
    token = min(t for t in policy if critic[t] != policy[t])
    return f"token {token!r} is id {critic[token]} in the critic's and {policy[token]} in the policy's"


def tokenizer_ids(tokenizer: "PreTrainedTokenizerBase") -> int:
    """How many embedding rows ``tokenizer``'s ids need: its size, or its highest id + 1."""
    return max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)


def model_positions(model_dir: str) -> int | None:
    """The positions the model in ``model_dir`` has (``max_position_embeddings`` of its
    ``config.json``, a vision-language model's text config's); None when it cannot be
    read here (a remote-code model's own files) or the model has ``rope_scaling``, which
    may go past it."""
    config, text = _model_config(model_dir)
    limit = text.get("max_position_embeddings")
    if not isinstance(limit, int) or text.get("rope_scaling") or config.get("rope_scaling"):
        return None
    return limit


def model_vocab_size(model_dir: str) -> int | None:
    """The rows of the input embedding of the model in ``model_dir`` (``vocab_size`` of its
    ``config.json``, a vision-language model's text config's when it has one); None when
    it cannot be read here."""
    config, text = _model_config(model_dir)
    rows = text.get("vocab_size", config.get("vocab_size"))
    return rows if isinstance(rows, int) and not isinstance(rows, bool) else None


def _model_config(model_dir: str) -> tuple[dict, dict]:
    """``(config, text config)`` of ``model_dir``'s ``config.json`` (the text config is the
    config itself but for a vision-language model); empty when it cannot be read."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}, {}
    if not isinstance(config, dict):
        return {}, {}
    return config, config["text_config"] if isinstance(config.get("text_config"), dict) else config


def make_generator(cfg: Config, model_dir: str, model: torch.nn.Module | None,
                   tokenizer: "PreTrainedTokenizerBase", rng: torch.Generator,
                   make_env: EnvFactory | None) -> EpisodeGenerator | HFGenerator:
    """The sampler ``rollout.engine`` names: rltune's on ``model``, or a vLLM engine with
    its own copy of ``model_dir`` (``model`` unused; may be None). With an environment,
    episodes of it played by the sampler."""
    if cfg.rollout.engine == "vllm":
        from rltune.rollout.vllm import VLLMGenerator, engine_args

        sampler = VLLMGenerator(
            model_dir, tokenizer, dtype=vllm_dtype(cfg), rng=rng, seed=int(rng.initial_seed()),
            trust_remote_code=cfg.model.trust_remote_code, engine_args=engine_args(cfg.rollout.vllm),
            tensor_parallel_size=cfg.rollout.vllm.tensor_parallel_size,
        )
        stops = sampler.eos_ids
    else:
        sampler = HFGenerator(model, tokenizer, rng=rng, precision=generator_precision(cfg),
                              compile=cfg.rollout.compile)
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
        eos_ids=stops, max_prompt_tokens=cfg.data.max_prompt_tokens, max_positions=model_positions(model_dir),
    )


def local_scorer(cfg: Config, reward_fns: list[RewardFn]) -> LocalScorer:
    """The run's reward functions scored in this process (``runtime.reward_*``)."""
    r = cfg.runtime
    return LocalScorer(reward_fns, max_workers=r.reward_workers, pool=r.reward_pool, cache_size=r.reward_cache_size)


__all__ = [
    "Roles", "aux_loss_coef", "check_critic_vocabulary", "critic_dir", "critic_learner", "is_preference",
    "learner_model", "learner_objective", "learner_options", "load_policy", "load_reference_model", "local_scorer",
    "lookup_algorithm", "make_generator", "model_logprobs", "model_positions", "model_vocab_size", "plays_episodes",
    "reference_options", "seed_everything", "tokenizer_ids",
]
