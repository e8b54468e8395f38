"""What scoring produces: each sample's combined reward, and the statistics of a round as
typed metrics.

The combined reward of a sample is the weighted sum ``r = sum_k w_k * r_k`` over the
reward functions (plus an episode's ``env`` reward). If *any* function gives no score for
a sample (it returned None, raised, timed out, or returned something that is not a finite
number), the sample's ``reward`` is None: a partial sum would silently score the sample as
if the failed term were 0. Such samples are masked out of the advantage downstream and
counted in ``reward/errors``.

:class:`ScoreStats` holds every statistic with its reduction (:mod:`rltune.metrics.types`):
the stats of several scorers (the shards of a step scored by several actors) combine by
aggregating those metrics, and the sums over a step's refill rounds the same way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from rltune.data.records import Rollout
from rltune.metrics import keys
from rltune.metrics.types import Mean, Metric, Sum, reduce
from rltune.rewards.calls import Outcome, RewardFn, expected_reward, finite_reward


def fill(rollout: Rollout, reward_fns: Sequence[RewardFn], outcomes: Sequence[Outcome]) -> None:
    """The rollout's rewards: each function's value, an episode's ``env`` reward, and the
    sum (weighted functions plus the env reward), None when any part failed."""
    rollout.rewards = {rf.name: o.value for rf, o in zip(reward_fns, outcomes)}
    errors = [o.error for o in outcomes if o.error is not None and not o.dropped]
    drops = [o.error for o in outcomes if o.dropped]
    episode = rollout.turns is not None or rollout.env_error is not None
    if episode:
        rollout.rewards[keys.ENV_REWARD] = rollout.env_reward
        if rollout.env_error is not None:
            errors.insert(0, rollout.env_error)
    elif not reward_fns:
        errors.append("no reward function is configured and the sample is not an episode")
    rollout.dropped = bool(drops) and not errors
    rollout.reward_error = errors[0] if errors else (drops[0] if drops else None)
    total = None
    if not (errors or drops):
        total = sum(rf.weight * o.value for rf, o in zip(reward_fns, outcomes))
        total += rollout.env_reward or 0.0 if episode else 0.0
        if finite_reward(total) is None:  # each part in range, their weighted sum not
            rollout.reward_error, total = f"the weighted sum {total:.3g} is not {expected_reward(total)}", None
    rollout.reward = total


@dataclass(frozen=True)
class FnStats:
    """One reward function's part of a round.

    ``mean``: of the values it gave, weighted by how many (weight 0, value NaN: none).
    ``errors``: samples it failed on (not drops). ``seconds``: time spent in its calls,
    summed (with concurrency this can exceed the wall time). ``calls``: calls made, after
    de-duplication and the cache.
    """

    mean: Mean
    errors: Sum
    seconds: Sum
    calls: Sum


@dataclass(frozen=True)
class ScoreStats:
    """What one scoring call saw, as typed metrics.

    ``per_fn``: each function's :class:`FnStats`, in the configured order. ``errors``:
    samples whose combined reward is None for a failure (not a deliberate drop).
    ``dropped``: samples a reward dropped (:class:`~rltune.rewards.contract.SampleDropped`).
    ``cache_hits``/``timeouts``: over all functions.
    """

    per_fn: Mapping[str, FnStats]
    errors: Sum
    dropped: Sum
    cache_hits: Sum
    timeouts: Sum

    def metrics(self) -> dict[str, Metric]:
        """The step metrics: ``time/reward/NAME`` (seconds), ``perf/reward_calls/NAME``,
        ``reward/errors/NAME`` and the totals ``perf/reward_cache_hits``,
        ``reward/timeouts``, ``reward/dropped``, all sums. ``time/`` and ``perf/`` metrics
        depend on the machine and on this process's cache (a resumed run starts with an
        empty one), not on the training state."""
        out: dict[str, Metric] = {}
        for name, fn in self.per_fn.items():
            out[keys.reward_time_key(name)] = fn.seconds
            out[keys.perf_reward_calls_key(name)] = fn.calls
            out[keys.reward_errors_key(name)] = fn.errors
        out[keys.PERF_REWARD_CACHE_HITS] = self.cache_hits
        out[keys.REWARD_TIMEOUTS] = self.timeouts
        out[keys.REWARD_DROPPED] = self.dropped
        return out

    @staticmethod
    def combine(parts: Sequence["ScoreStats"]) -> "ScoreStats":
        """The stats of several scoring calls over disjoint samples as one: every metric
        aggregated by its own reduction (counts and seconds summed, means weighted by how
        many values each had). The functions are those of the first part."""
        if not parts:
            return ScoreStats({}, Sum(0.0), Sum(0.0), Sum(0.0), Sum(0.0))
        per_fn = {name: FnStats(**_combined([p.per_fn[name] for p in parts])) for name in parts[0].per_fn}
        return ScoreStats(per_fn=per_fn, **_combined(parts, skip=("per_fn",)))


def score_stats(
    reward_fns: Sequence[RewardFn], rollouts: Sequence[Rollout], outcomes: Sequence[Sequence[Outcome]],
    *, calls: Mapping[str, int], cache_hits: int,
) -> ScoreStats:
    """The stats of one round: ``outcomes[k][i]`` is function ``k``'s on rollout ``i``,
    ``calls`` the calls made per function."""
    per_fn = {}
    for rf, mine in zip(reward_fns, outcomes):
        values = [o.value for o in mine if o.value is not None]
        per_fn[rf.name] = FnStats(
            mean=Mean(sum(values) / len(values), float(len(values))) if values else Mean(math.nan, 0.0),
            errors=Sum(float(sum(1 for o in mine if o.value is None and not o.dropped))),
            seconds=Sum(sum(o.seconds for o in mine)),
            calls=Sum(float(calls[rf.name])),
        )
    dropped = sum(1 for r in rollouts if r.dropped)
    return ScoreStats(
        per_fn,
        errors=Sum(float(sum(1 for r in rollouts if r.reward is None) - dropped)),
        dropped=Sum(float(dropped)),
        cache_hits=Sum(float(cache_hits)),
        timeouts=Sum(float(sum(1 for mine in outcomes for o in mine if o.timed_out))),
    )


def _combined(records: Sequence[Any], skip: tuple[str, ...] = ()) -> dict[str, Metric]:
    """Records of one dataclass whose fields are typed metrics, combined field by field."""
    names = [f.name for f in fields(records[0]) if f.name not in skip]
    out = reduce({name: _addable(getattr(r, name)) for name in names} for r in records)
    return {name: out[name] for name in names}


def _addable(metric: Metric) -> Metric:
    """A mean of nothing (weight 0, value NaN) adds nothing, rather than a NaN."""
    return Mean(0.0, 0.0) if isinstance(metric, Mean) and not metric.weight else metric
