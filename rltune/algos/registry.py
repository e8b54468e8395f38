"""The algorithms rltune can run, as data: what each needs and which math it uses.

The registry is the one place that knows what an algorithm is: the config holds no list
of algorithm names, and the run checks the config against the entry
(:func:`config_problems`) before it loads anything.

A new algorithm is a new entry here and, at most, a new small function in this package
(see docs/algorithms.md, "Adding an algorithm"). Hyper-parameter defaults that differ by
algorithm (DAPO's clip-higher, GSPO's narrow clip, ...) are presets of the config
(``rltune.config.schema.ALGO_PRESETS``), so several entries share their math.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from rltune.algos.advantages import group_advantages, group_baseline, reinforce_pp_advantages, rloo_advantages
from rltune.algos.losses import gspo_policy_loss, ppo_policy_loss, sft_loss
from rltune.algos.preference import bradley_terry_loss, dpo_loss, simpo_loss
from rltune.algos.value import gae


@dataclass(frozen=True)
class Algorithm:
    """What the runtime must provide for one algorithm.

    ``online``: it generates rollouts every step (else it learns from a fixed dataset).
    ``needs_reference``: it always needs a frozen reference model (e.g. DPO).
    ``uses_reference_when_kl``: it needs the reference model only for a KL penalty, so the
    runtime loads one exactly when ``kl_coef > 0`` (see ``requires_reference``).
    ``needs_critic``: it trains a value model (PPO with GAE).
    ``advantage``: the advantage estimator, or None when the loss needs no advantages.
    ``baseline``: applied to the sequence rewards before a token-level estimator
    (REINFORCE++ with a group baseline), or None.
    ``loss``: the loss function, ``(... ) -> (loss, metrics)``.
    ``advantage_kwargs(algo_cfg)``: the estimator's hyper-parameters from the ``algo``
    config section. A sequence estimator is called as
    ``advantage(rewards [B], group_size, valid=valid [B], **advantage_kwargs(algo_cfg))``.
    ``loss_kwargs(algo_cfg, max_len)``: an online policy loss's hyper-parameters
    (``max_len`` is ``rollout.max_new_tokens``); it is called as
    ``loss(logprobs, old_logprobs, advantages, mask, is_weights=, denominator=, **kwargs)``.
    ``group_baseline``: its baseline is the other samples of the same prompt, so a group
    needs at least two (``algo.group_size >= 2``).
    ``token_rewards``: its rewards are per token, so a KL penalty can go into the reward
    (``algo.kl_in_reward``).
    ``sequence_ratio``: one importance ratio per sequence (GSPO), so the loss averages per
    sequence and a token-level dual clip does not apply.
    ``pairs``: it learns from preference pairs (chosen, rejected), not from prompts.
    """

    name: str
    online: bool
    needs_reference: bool
    uses_reference_when_kl: bool
    needs_critic: bool
    advantage: Callable | None
    loss: Callable
    baseline: Callable | None = None
    advantage_kwargs: Callable[[Any], dict[str, Any]] = lambda cfg: {}
    loss_kwargs: Callable[[Any, int | None], dict[str, Any]] = lambda cfg, max_len: {}
    group_baseline: bool = False
    token_rewards: bool = False
    sequence_ratio: bool = False
    pairs: bool = False

    def requires_reference(self, kl_coef: float) -> bool:
        """Whether a reference model must be loaded for this ``kl_coef``."""
        return self.needs_reference or (self.uses_reference_when_kl and kl_coef > 0)


def ppo_loss_kwargs(cfg: Any, max_len: int | None) -> dict[str, Any]:
    """``ppo_policy_loss``'s keys of the ``algo`` section."""
    return dict(
        clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip,
        aggregation=cfg.aggregation, max_len=max_len,
    )


def gspo_loss_kwargs(cfg: Any, max_len: int | None) -> dict[str, Any]:
    """``gspo_policy_loss``'s keys of the ``algo`` section."""
    return dict(clip_low=cfg.clip_low, clip_high=cfg.clip_high)


def group_advantage_kwargs(cfg: Any) -> dict[str, Any]:
    """``group_advantages``' keys of the ``algo`` section."""
    return {"scale": cfg.adv_scale, "eps": cfg.adv_eps}


def online_algorithm(
    name: str,
    advantage: Callable,
    loss: Callable = ppo_policy_loss,
    *,
    loss_kwargs: Callable[[Any, int | None], dict[str, Any]] = ppo_loss_kwargs,
    needs_critic: bool = False,
    **kw: Any,
) -> Algorithm:
    """An entry for an algorithm that generates every step; the reference model is loaded
    when ``algo.kl_coef > 0``. ``kw``: ``advantage_kwargs``, ``baseline``."""
    return Algorithm(
        name=name, online=True, needs_reference=False, uses_reference_when_kl=True,
        needs_critic=needs_critic, advantage=advantage, loss=loss, loss_kwargs=loss_kwargs, **kw,
    )


def offline_algorithm(name: str, loss: Callable, *, needs_reference: bool = False, pairs: bool = False) -> Algorithm:
    """An entry for an algorithm that learns from a fixed dataset (of preference pairs
    with ``pairs``)."""
    return Algorithm(
        name=name, online=False, needs_reference=needs_reference, uses_reference_when_kl=False,
        needs_critic=False, advantage=None, loss=loss, pairs=pairs,
    )


ALGORITHMS: dict[str, Algorithm] = {
    # GRPO (Shao et al. 2024): group-relative advantages, clipped PPO surrogate, no critic.
    "grpo": online_algorithm("grpo", group_advantages, advantage_kwargs=group_advantage_kwargs, group_baseline=True),
    # Dr. GRPO (Liu et al. 2025): GRPO without std scaling and with a constant normaliser.
    "dr_grpo": online_algorithm(
        "dr_grpo", group_advantages, advantage_kwargs=group_advantage_kwargs, group_baseline=True,
    ),
    # DAPO (Yu et al. 2025): clip-higher, token-mean loss, dynamic sampling, overlong penalty.
    "dapo": online_algorithm("dapo", group_advantages, advantage_kwargs=group_advantage_kwargs, group_baseline=True),
    # GSPO (Zheng et al. 2025): group advantages, sequence-level importance ratio.
    "gspo": online_algorithm(
        "gspo", group_advantages, gspo_policy_loss,
        advantage_kwargs=group_advantage_kwargs, loss_kwargs=gspo_loss_kwargs,
        group_baseline=True, sequence_ratio=True,
    ),
    # RLOO (Ahmadian et al. 2024): leave-one-out baseline within the group.
    "rloo": online_algorithm("rloo", rloo_advantages, group_baseline=True),
    # REINFORCE++ (Hu 2025): token-level returns whitened over the batch, no critic.
    "reinforce_pp": online_algorithm("reinforce_pp", reinforce_pp_advantages, token_rewards=True),
    # REINFORCE++ with the group mean subtracted from each reward first.
    "reinforce_pp_baseline": online_algorithm(
        "reinforce_pp_baseline", reinforce_pp_advantages, baseline=group_baseline,
        group_baseline=True, token_rewards=True,
    ),
    # PPO (Schulman et al. 2017; Ouyang et al. 2022): a critic and GAE.
    "ppo": online_algorithm("ppo", gae, needs_critic=True, token_rewards=True),
    # Supervised fine-tuning: token-mean NLL on a fixed dataset.
    "sft": offline_algorithm("sft", sft_loss),
    # DPO (Rafailov et al. 2023) and its IPO / hinge / robust variants: frozen reference.
    "dpo": offline_algorithm("dpo", dpo_loss, needs_reference=True, pairs=True),
    # SimPO (Meng et al. 2024): length-normalised, reference-free.
    "simpo": offline_algorithm("simpo", simpo_loss, pairs=True),
    # Reward model: Bradley-Terry on a scalar head.
    "reward_model": offline_algorithm("reward_model", bradley_terry_loss, pairs=True),
}


_BUILT_IN = dict(ALGORITHMS)
"""The entries above, as rltune defines them (their key rules are known)."""


def config_problems(algorithm: Algorithm, cfg: Any) -> list[str]:
    """What in a run config (``rltune.config.Config``) ``algorithm`` cannot run with, one
    line each; empty when nothing. The checks that depend on which algorithm it is live
    here, next to what each algorithm is, so a registered algorithm is checked the same
    as a built-in one."""
    a, name = cfg.algo, algorithm.name
    problems = []
    if algorithm.online and not cfg.reward and cfg.env.name is None:
        problems.append(f"algo.name={name} needs at least one entry in `reward` (or an `env` whose steps give rewards)")
    if not algorithm.online and cfg.runtime.max_staleness > 0:
        problems.append(f"runtime.max_staleness is for algorithms that generate; {name} does not")
    if algorithm.group_baseline and a.group_size < 2:
        problems.append(f"algo.group_size must be >= 2 for {name} (the group is the baseline)")
    if a.kl_in_reward and not algorithm.token_rewards:
        token = ", ".join(sorted(k for k, entry in ALGORITHMS.items() if entry.token_rewards))
        problems.append(
            f"algo.kl_in_reward needs per-token rewards ({token}); "
            f"for {name} put the KL in the loss (kl_in_reward: false)"
        )
    if algorithm.sequence_ratio and a.aggregation != "seq-mean-token-mean":
        problems.append(
            f"algo.name={name} averages one ratio per sequence; algo.aggregation must be "
            f"seq-mean-token-mean, not {a.aggregation}"
        )
    if algorithm.sequence_ratio and a.dual_clip is not None:
        problems.append(f"algo.dual_clip applies to token ratios; {name} clips one ratio per sequence")
    if algorithm.online:
        problems.extend(generation_problems(algorithm, cfg))
    problems.extend(minibatch_problems(algorithm, cfg))
    if a.skip_zero_advantage:
        problems.extend(skip_zero_advantage_problems(algorithm, cfg))
    problems.extend(unused_key_problems(algorithm, cfg))
    return problems


def generation_problems(algorithm: Algorithm, cfg: Any) -> list[str]:
    """What an online ``algorithm`` cannot learn with under ``cfg``: settings that would
    fail only after a step's generation, or let it learn nothing."""
    a, name = cfg.algo, algorithm.name
    problems = []
    if cfg.rollout.temperature <= 0:
        problems.append(
            f"rollout.temperature={cfg.rollout.temperature}: algo.name={name} learns from the log-probs of its "
            "samples at the sampling temperature, and greedy decoding has none; set rollout.temperature > 0 "
            "(greedy evaluation is eval.temperature: 0)"
        )
    limit_key, limit = overlong_limit(cfg)
    if a.overlong_buffer > limit:
        problems.append(
            f"algo.overlong_buffer={a.overlong_buffer} is longer than {limit_key}={limit}: the soft overlong "
            f"zone is the last overlong_buffer tokens before the limit; set overlong_buffer <= {limit}"
        )
    if a.dynamic_sampling and a.group_size < 2 and not algorithm.group_baseline:
        problems.append(
            f"algo.dynamic_sampling keeps only groups whose rewards differ, and a group of algo.group_size="
            f"{a.group_size} never has two: every batch would be empty; set group_size >= 2, or dynamic_sampling: false"
        )
    if cfg.reward and all(r.weight == 0 for r in cfg.reward) and cfg.env.name is None and not a.overlong_buffer:
        weights = ", ".join(f"reward[{i}].weight={r.weight}" for i, r in enumerate(cfg.reward))
        problems.append(
            f"every reward has weight 0 ({weights}) and no env gives rewards: every sample of algo.name={name} "
            "would score 0 and nothing would be learned; give a reward a nonzero weight"
        )
    if a.clip_low >= 1:
        problems.append(
            f"algo.clip_low={a.clip_low} puts the ratio's lower clip 1 - clip_low at or below 0, where a ratio "
            "never falls, so it would never clip; set clip_low below 1 (0.2 is PPO's)"
        )
    return problems


def minibatch_problems(algorithm: Algorithm, cfg: Any) -> list[str]:
    """``algo.minibatches`` above the units a step learns on (rows of an online batch,
    preference pairs, SFT examples): there would be fewer optimizer steps than asked, or
    empty ones. Judged on the nominal batch; dynamic sampling may learn on fewer rows."""
    a, n = cfg.algo, cfg.train.prompts_per_step
    if algorithm.online:
        units, what, made = n * a.group_size, "rows", f"train.prompts_per_step={n} x algo.group_size={a.group_size}"
    else:
        units, what, made = n, "pairs" if algorithm.pairs else "rows", f"train.prompts_per_step={n}"
    if a.minibatches <= units:
        return []
    return [f"algo.minibatches={a.minibatches} is more than the {units} {what} a step learns on ({made}); "
            f"set minibatches <= {units}, or raise train.prompts_per_step"]


# The built-in preference methods' own keys; a registered preference method may read any.
_PREFERENCE_KEYS = {"dpo": {"beta", "dpo_kind", "label_smoothing"}, "simpo": {"beta", "simpo_gamma"}, "reward_model": set()}


def _reads_preference_key(key: str) -> Callable[[Algorithm, Any], str | None]:
    def reads(algorithm: Algorithm, a: Any) -> str | None:
        if not algorithm.pairs:
            return "it does not learn from preference pairs"
        used = _PREFERENCE_KEYS.get(algorithm.name)
        return None if used is None or key in used else "its loss has no such term"
    return reads


def _grpo_advantages(algorithm: Algorithm, a: Any) -> str | None:
    return None if algorithm.advantage_kwargs is group_advantage_kwargs else "its advantages are not GRPO's"


def _online(algorithm: Algorithm, a: Any) -> str | None:
    return None if algorithm.online else "it learns from a fixed dataset and does not generate"


def _divides_by_std(algorithm: Algorithm, a: Any) -> str | None:
    return _grpo_advantages(algorithm, a) or (
        None if a.adv_scale == "std" else f"adv_scale is {a.adv_scale}: its advantages are not divided by the std")


def _kl_term(algorithm: Algorithm, a: Any) -> str | None:
    return _online(algorithm, a) or ("kl_coef is 0: there is no KL term" if a.kl_coef == 0 else None) or (
        "the KL in the reward is k1" if a.kl_in_reward else None)


def _kl_in_reward(algorithm: Algorithm, a: Any) -> str | None:
    # without per-token rewards kl_in_reward: true is refused by config_problems itself
    if not algorithm.token_rewards or a.kl_coef > 0:
        return None
    return "kl_coef is 0: there is no KL to put in the reward"


def _kl_horizon(algorithm: Algorithm, a: Any) -> str | None:
    if not a.kl_in_reward:
        return "it adapts the KL in the reward (kl_in_reward: true)"
    return None if a.kl_target is not None else "kl_target is not set: the KL coefficient does not adapt"


# When each ``algo`` key is read: None when ``algorithm`` with ``algo`` section ``a`` reads
# it, else why not; a rule may depend on the other keys' values (``kl_kind`` is read only
# with a KL term). ``algo.epochs`` and ``algo.minibatches`` are read by every algorithm.
_KEY_USE: dict[str, Callable[[Algorithm, Any], str | None]] = {
    "group_size": _online,
    "adv_scale": _grpo_advantages,
    "adv_eps": _divides_by_std,
    "clip_low": _online,
    "clip_high": _online,
    "dual_clip": _online,
    "aggregation": _online,
    "kl_coef": _online,
    "kl_kind": _kl_term,
    "kl_in_reward": _kl_in_reward,
    "kl_target": lambda al, a: None if a.kl_in_reward else "it adapts the KL in the reward (kl_in_reward: true)",
    "kl_horizon": _kl_horizon,
    "gamma": lambda al, a: None if al.token_rewards else "it has no per-token returns",
    "lam": lambda al, a: None if al.needs_critic else "it has no critic (GAE)",
    "value_clip": lambda al, a: None if al.needs_critic else "it has no critic",
    "critic_lr": lambda al, a: None if al.needs_critic else "it has no critic",
    "critic_warmup_steps": lambda al, a: None if al.needs_critic else (
        "it has no critic to warm up: the policy would not learn for those steps"),
    "dynamic_sampling": _online,
    "max_refill_rounds": lambda al, a: _online(al, a) or (None if a.dynamic_sampling else "dynamic_sampling is off"),
    "overlong_buffer": _online,
    "overlong_penalty": lambda al, a: _online(al, a) or (None if a.overlong_buffer else "overlong_buffer is 0"),
    "importance_correction": _online,
    "importance_cap": lambda al, a: _online(al, a) or (
        None if a.importance_correction != "none" else "importance_correction is none"
    ),
    **{key: _reads_preference_key(key) for key in ("beta", "dpo_kind", "label_smoothing", "simpo_gamma")},
}


def unread_keys(algorithm: Algorithm, cfg: Any) -> dict[str, str]:
    """The dotted keys of ``cfg`` that ``algorithm`` does not read, each with why, whatever
    their values. An entry registered by the user (not one of the built-in ones) may read
    any ``algo`` key through its own functions, so only ``model.critic_path`` is judged
    for it."""
    built_in = _BUILT_IN.get(algorithm.name) is algorithm
    unread = {f"algo.{key}": why for key, rule in _KEY_USE.items()
              if built_in and (why := rule(algorithm, cfg.algo)) is not None}
    if not algorithm.needs_critic:
        unread["model.critic_path"] = "it has no critic"
    return unread


def unused_key_problems(algorithm: Algorithm, cfg: Any) -> list[str]:
    """The keys set away from ``algorithm``'s defaults that it would not read, one line
    each: a value that would be ignored is refused, not silently dropped (``algo.kl_coef``
    on SFT, ``model.critic_path`` without a critic). A key left at its default, or set to
    it, is not reported; the defaults are those of ``algo.name`` (its preset included)."""
    defaults = type(cfg.algo)(name=cfg.algo.name)
    problems = []
    for key, why in unread_keys(algorithm, cfg).items():
        section, field = key.split(".")
        value = getattr(getattr(cfg, section), field)
        if value == (getattr(defaults, field) if section == "algo" else None):
            continue
        shown = key if section == "model" else f"{key}={value}"
        problems.append(f"{shown} does not apply to algo.name={algorithm.name} ({why}); remove it")
    return problems


def critic_warmup_note(algorithm: Algorithm, cfg: Any) -> str | None:
    """A line for the console when ``algo.critic_warmup_steps`` covers every step of the
    run: only the critic learns, the policy stays as it was (a short smoke run of a recipe
    with a warm-up, so a note rather than a refusal)."""
    a = cfg.algo
    if not (algorithm.needs_critic and 0 < cfg.train.steps <= a.critic_warmup_steps):
        return None
    return (f"note: algo.critic_warmup_steps={a.critic_warmup_steps} covers all {cfg.train.steps} steps of this "
            f"run: only the critic learns, and the policy stays as it was (set algo.critic_warmup_steps below "
            f"train.steps to train it)")


def overlong_limit(cfg: Any) -> tuple[str, int]:
    """The length DAPO's overlong penalty measures a sample against, and its key: a
    completion's ``rollout.max_new_tokens``, or with a multi-turn environment the episode's
    ``env.max_total_tokens`` (an episode's completion holds every turn and observation,
    and that budget is where it is cut); a one-turn episode is cut at the smaller of the two."""
    if cfg.env.name is not None and cfg.env.max_turns > 1:
        return "env.max_total_tokens", cfg.env.max_total_tokens
    if cfg.env.name is not None and cfg.env.max_total_tokens < cfg.rollout.max_new_tokens:
        return "env.max_total_tokens", cfg.env.max_total_tokens  # one turn, cut by the budget first
    return "rollout.max_new_tokens", cfg.rollout.max_new_tokens


def skip_zero_advantage_problems(algorithm: Algorithm, cfg: Any) -> list[str]:
    """Why ``algo.skip_zero_advantage`` would change ``algorithm``'s update under ``cfg``.

    A skipped row (advantage zero at every token) adds nothing to a policy-gradient loss,
    so leaving it out is exact only when no other term of the loss reads it
    (``rltune/learner/selective.py``): a KL-to-reference term in the loss, a loss with no
    advantages (SFT, preference methods), and an MoE router's load-balancing loss or
    aux-free bias (computed from every routed token) all do. PPO's value loss is its
    critic's own learner, which runs every row, so PPO's policy may skip."""
    name, a = algorithm.name, cfg.algo
    if not algorithm.online:
        return [f"algo.skip_zero_advantage skips samples by their advantage; {name} learns from a "
                "fixed dataset without advantages (set skip_zero_advantage: false)"]
    problems = []
    if a.kl_coef > 0 and not a.kl_in_reward:
        problems.append(
            f"algo.skip_zero_advantage with a KL term in the loss (algo.kl_coef={a.kl_coef}): a sample "
            "with zero advantage still has a KL gradient, so skipping it would change the update; "
            "set kl_coef: 0" + (", or kl_in_reward: true" if algorithm.token_rewards else "")
        )
    if cfg.model.router_aux_loss_coef is not None and cfg.model.router_aux_loss_coef > 0:
        problems.append(
            "algo.skip_zero_advantage with model.router_aux_loss_coef > 0: the router's "
            "load-balancing loss reads every row's routing, so skipping a row would change the "
            "update; set router_aux_loss_coef: 0"
        )
    if cfg.model.moe.aux_free_bias > 0:
        problems.append(
            "algo.skip_zero_advantage with model.moe.aux_free_bias > 0: the routing bias moves by "
            "the expert load of every row the learner runs, so skipping rows would change it; "
            "set aux_free_bias: 0"
        )
    return problems
