"""Metric names: every key a run logs is built here, and every reader parses keys here.

A key is ``/``-separated segments. The families:

- ``reward/mean``, ``reward/std``, ``reward/errors``, ``reward/timeouts``,
  ``reward/dropped``: statistics of the combined reward (:data:`REWARD_STATS`);
- ``reward/NAME``: reward function NAME's mean, ``reward/errors/NAME`` its failures,
  ``time/reward/NAME`` its seconds, ``perf/reward_calls/NAME`` its calls;
- ``accuracy`` and ``accuracy/NAME``: the verifiers' share of correct samples;
- ``time/PHASE`` (:data:`TIME_PHASES`) and ``time/step``: seconds per step;
- ``eval/KEY``: ``KEY`` measured on the held-out prompts (``eval/reward/mean``,
  ``eval/pref/accuracy``, ...);
- ``critic/KEY``: PPO's critic's learner metrics;
- the fixed names below (``kl``, ``length/mean``, ``groups/kept_frac``, ...).

A reward function's name is a segment of these keys, so it may not be one of
:data:`REWARD_STATS` nor one of the rewards the runtime adds itself to the run
(:data:`RUNTIME_REWARDS`), and may not contain ``/`` (:func:`reward_name_problem`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

SEP = "/"

# ------------------------------------------------------------------ reward

REWARD = "reward"
REWARD_STATS = frozenset({"mean", "std", "min", "max", "errors", "timeouts", "dropped"})
"""``reward/<stat>`` keys that are statistics of the combined reward, not a reward function."""
ENV_REWARD = "env"
"""The ``Rollout.rewards`` entry of an environment's own step rewards."""
OVERLONG_REWARD = "overlong"
"""The ``Rollout.rewards`` entry of DAPO's token-level overlong penalty (``algo.overlong_buffer``)."""
RUNTIME_REWARDS = frozenset({ENV_REWARD, OVERLONG_REWARD})
"""Reward names the runtime writes into ``Rollout.rewards`` beside the reward functions'."""
RESERVED_REWARD_NAMES = REWARD_STATS | RUNTIME_REWARDS


def reward_key(name: str) -> str:
    """``reward/NAME``: reward function NAME's mean, or a statistic of :data:`REWARD_STATS`."""
    return f"{REWARD}{SEP}{name}"


REWARD_MEAN = reward_key("mean")
REWARD_STD = reward_key("std")
REWARD_ERRORS = reward_key("errors")
REWARD_TIMEOUTS = reward_key("timeouts")
REWARD_DROPPED = reward_key("dropped")


def reward_errors_key(name: str) -> str:
    """``reward/errors/NAME``: the samples reward function NAME failed on."""
    return f"{REWARD_ERRORS}{SEP}{name}"


def reward_name_problem(name: str, *, runtime_rewards: Collection[str] = RUNTIME_REWARDS) -> str | None:
    """Why ``name`` cannot name a reward function, or None when it can. ``runtime_rewards``:
    the rewards of :data:`RUNTIME_REWARDS` the run adds itself (a run without an
    environment, say, adds no ``env``)."""
    if not name:
        return "a reward function's name must not be empty"
    if SEP in name:
        return f"the name {name!r} contains {SEP!r}, which separates the segments of metric keys"
    if name in REWARD_STATS:
        return (f"the name {name!r} is reserved: {reward_key(name)} is a statistic of the combined "
                f"reward ({', '.join(sorted(REWARD_STATS))} are)")
    if name in runtime_rewards:
        return (f"the name {name!r} is reserved: this run adds a reward of that name itself "
                f"({', '.join(sorted(RUNTIME_REWARDS))} are the runtime's own)")
    return None


def reward_names(keys: Iterable[str]) -> list[str]:
    """The reward functions among ``keys``, sorted: the ``reward/NAME`` keys that are not a
    statistic of the combined reward (:data:`REWARD_STATS`) and not nested."""
    prefix = REWARD + SEP
    names = {key[len(prefix):] for key in keys if key.startswith(prefix)}
    return sorted(n for n in names if SEP not in n and n not in REWARD_STATS)


# ------------------------------------------------------------------ accuracy

ACCURACY = "accuracy"
"""The share of samples every verifier scored that all of them scored correct."""


def accuracy_key(name: str) -> str:
    """``accuracy/NAME``: the share of the samples verifier NAME scored that it scored 1.0."""
    return f"{ACCURACY}{SEP}{name}"


def is_accuracy_key(key: str) -> bool:
    return key == ACCURACY or key.startswith(ACCURACY + SEP)


# ------------------------------------------------------------------ time

TIME = "time"
TIME_PHASES = ("generate", "score", "experience", "learn", "sync")
"""The phases of an online step, in order; each is timed as ``time/PHASE``."""


def time_key(phase: str) -> str:
    """``time/PHASE``: seconds of one phase of the step (``time/step``: the whole step)."""
    return f"{TIME}{SEP}{phase}"


TIME_STEP = time_key("step")
TIME_WEIGHT_LOAD = time_key("weight_load")


def reward_time_key(name: str) -> str:
    """``time/reward/NAME``: seconds spent in reward function NAME's calls."""
    return time_key(reward_key(name))


# ------------------------------------------------------------------ eval

EVAL = "eval"


def eval_key(key: str) -> str:
    """``eval/KEY``: ``KEY`` measured on the held-out prompts."""
    return f"{EVAL}{SEP}{key}"


def is_eval_key(key: str) -> bool:
    return key.startswith(EVAL + SEP)


PREF_ACCURACY = "pref/accuracy"
"""Preference methods: the share of held-out pairs the chosen side wins."""
PREF_MARGIN = "pref/margin"
"""Preference methods: the mean held-out reward margin of chosen over rejected."""
EVAL_REWARD_MEAN = eval_key(REWARD_MEAN)
_HELD_OUT = (eval_key(REWARD + SEP), eval_key("pref" + SEP))
_NOT_HELD_OUT_SCORES = frozenset({eval_key(REWARD_STD), eval_key(REWARD_ERRORS)})


def held_out_scores(keys: Iterable[str], *, with_mean: bool = True) -> list[str]:
    """The held-out scores among ``keys``, in their order: ``eval/reward/*`` (the mean and
    each reward function's) and ``eval/pref/*``, without the reward's std and error count;
    ``with_mean=False`` leaves out ``eval/reward/mean`` too."""
    skip = _NOT_HELD_OUT_SCORES if with_mean else _NOT_HELD_OUT_SCORES | {EVAL_REWARD_MEAN}
    return [k for k in keys if k.startswith(_HELD_OUT) and k not in skip]


def held_out_label(key: str) -> str:
    """A held-out score's short name: ``eval/reward/NAME`` -> ``NAME``, ``eval/pref/X`` -> ``pref/X``."""
    return key.removeprefix(EVAL + SEP).removeprefix(REWARD + SEP)


# ------------------------------------------------------------------ other families


def critic_key(key: str) -> str:
    """``critic/KEY``: a metric of PPO's critic's update."""
    return f"critic{SEP}{key}"


def restarts_key(role: str) -> str:
    """``faults/ROLE_restarts``: actors of ROLE (``generator``, ``scorer``) replaced this step."""
    return f"faults{SEP}{role}_restarts"


MOE_LOAD_MAX = "moe/load_max"
MOE_LOAD_MIN = "moe/load_min"
MOE_EXPERT_LOAD = "moe/expert_load"
MOE_ROUTER_AGREEMENT = "moe/router_agreement"
"""The share of (attended completion token, MoE layer) routes whose top-k expert set, as
the generator recorded it, equals the one the learner's router picks itself
(:mod:`rltune.models.routing`)."""
GENERATION = "gen"


def generation_key(key: str) -> str:
    """``gen/KEY``: ``KEY`` measured by the generator (``gen/moe/load_max``: the expert
    load of the tokens it generated and read)."""
    return f"{GENERATION}{SEP}{key}"


GEN_MOE_LOAD_MAX = generation_key(MOE_LOAD_MAX)
GEN_MOE_LOAD_MIN = generation_key(MOE_LOAD_MIN)
GEN_MOE_EXPERT_LOAD = generation_key(MOE_EXPERT_LOAD)


def moe_expert_load_key(expert: int) -> str:
    """``moe/load/eI``: expert I's share of its layer's routing choices, times the number
    of experts."""
    return f"moe{SEP}load{SEP}e{expert}"


def perf_reward_calls_key(name: str) -> str:
    """``perf/reward_calls/NAME``: calls made to reward function NAME."""
    return f"perf{SEP}reward_calls{SEP}{name}"


PERF_REWARD_CACHE_HITS = "perf/reward_cache_hits"

KL = "kl"
KL_COEF = "kl_coef"
APPROX_KL = "approx_kl"
LOSS = "loss"


def loss_part_key(part: str) -> str:
    """``loss/PART``: one term of the loss (``loss/policy``, ``loss/kl``), summed over a
    step's micro-batches like the loss."""
    return f"{LOSS}{SEP}{part}"


def is_loss_part_key(key: str) -> bool:
    return key.startswith(LOSS + SEP)


TOKENS = "tokens"
LR = "lr"
POLICY_VERSION = "policy_version"
LOGPROB_MISMATCH = "logprob_mismatch"
ENTROPY = "entropy"
GRAD_NORM = "grad_norm"
SKIPPED_OVERFLOW = "train/skipped_overflow"
"""``train.precision: fp16``: steps skipped because the scaled gradient overflowed (summed)."""
LOSS_SCALE = "train/loss_scale"
"""``train.precision: fp16``: the loss scale the next backward multiplies by."""
CLIP_FRAC = "clip_frac"
SAMPLES_PER_S = "samples_per_s"
TOKENS_PER_S = "tokens_per_s"
LENGTH_MEAN = "length/mean"
LENGTH_MAX = "length/max"
LENGTH_CLIPPED_FRAC = "length/clipped_frac"
HIST_REWARD = "hist/reward"
HIST_LENGTH = "hist/length"
GROUPS_ZERO_STD_FRAC = "groups/zero_std_frac"
GROUPS_KEPT_FRAC = "groups/kept_frac"
GROUPS_REFILL_ROUNDS = "groups/refill_rounds"
STALENESS_MEAN = "staleness/mean"
STALENESS_MAX = "staleness/max"
ASYNC_QUEUE = "async/queue"
ASYNC_DROPPED_STALE = "async/dropped_stale"
ASYNC_GENERATOR_IDLE_FRAC = "async/generator_idle_frac"
ASYNC_LEARNER_IDLE_FRAC = "async/learner_idle_frac"
LEARN_EMPTY_BATCH = "learn/empty_batch"
LEARN_SKIPPED_FRAC = "learn/skipped_frac"
"""``algo.skip_zero_advantage``: the share of the step's samples the learner did not run
forward and backward (their advantage was zero at every token)."""
LEARN_REPLAYED_FRAC = "learn/replayed_frac"
"""``train.reuse_rollout_mb``: the share of the step's training rows whose forward took
the generator's kept products (``rltune/models/replay.py``) instead of running them."""
ENV_TURNS = "env/turns"
ENV_TOOL_CALLS = "env/tool_calls"
ENV_TOOL_CALL_FRAC = "env/tool_call_frac"
ENV_MASKED_FRAC = "env/masked_frac"
ENV_ERRORS = "env/errors"


def for_dashboard() -> Mapping[str, object]:
    """What the dashboard's page needs to read metric keys, served as ``/api/keys`` (so the
    page holds no second list of names)."""
    return {
        "sep": SEP,
        "reward": REWARD,
        "reward_stats": sorted(REWARD_STATS),
        "reward_mean": REWARD_MEAN,
        "eval_reward_mean": EVAL_REWARD_MEAN,
        "time_phases": [[time_key(p), p] for p in TIME_PHASES],
        "kl": KL,
        "approx_kl": APPROX_KL,
        "grad_norm": GRAD_NORM,
        "entropy": ENTROPY,
        "length_mean": LENGTH_MEAN,
        "length_max": LENGTH_MAX,
        "samples_per_s": SAMPLES_PER_S,
        "tokens_per_s": TOKENS_PER_S,
        "loss": LOSS,
    }
