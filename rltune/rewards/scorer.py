"""Scoring rollouts with the configured reward functions, in one process.

Each reward function is called as ``fn(prompt, completion, **meta)`` with
``meta = {**prompt.meta, **kwargs}``: keyword arguments from the config override dataset
fields of the same name (so a recipe can pin, e.g., a ``pattern`` for every row).

The combined reward of a sample is the weighted sum ``r = sum_k w_k * r_k`` over the
reward functions. If *any* function gives no score for a sample (it returned None, raised,
or returned something that is not a finite number), the sample's ``reward`` is None: a
partial sum would silently score the sample as if the failed term were 0. Such samples are
masked out of the advantage downstream and counted in ``reward/errors``. A failing user
function never makes the scorer raise: errors are data.
"""

from __future__ import annotations

import inspect
import math
import numbers
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from rltune.data.records import Prompt, Rollout
from rltune.rewards.loading import RewardLoadError, load_reward_fn

if TYPE_CHECKING:  # only for annotations: scoring needs none of the config machinery
    from rltune.config.schema import RewardFnConfig

_MAX_SHOWN = 80  # characters of a bad return value or exception message kept in errors


@dataclass(frozen=True)
class RewardFn:
    """One configured reward function: called as ``fn(prompt, completion, **meta)``."""

    name: str
    fn: Callable[..., Any]
    weight: float = 1.0
    kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class ScoreStats:
    """What one :meth:`LocalScorer.score` call saw.

    ``errors``: samples whose combined reward is None. ``per_fn_mean``: mean of each
    function's non-None values (NaN when it scored none). ``per_fn_errors``: samples each
    function failed on. ``seconds``: total time spent inside each function, summed over
    calls (with threads this can exceed the wall time of the step).
    """

    errors: int
    per_fn_mean: dict[str, float]
    per_fn_errors: dict[str, int]
    seconds: dict[str, float]


@dataclass(frozen=True)
class _Outcome:
    value: float | None
    error: str | None
    seconds: float


def build_reward_fns(
    configs: Sequence[RewardFnConfig], *, base_dir: str | None = None
) -> list[RewardFn]:
    """Load every configured reward function (see :func:`load_reward_fn`; relative file
    paths are looked up in ``base_dir``, then the working directory). A function's name
    (in ``Rollout.rewards`` and metrics) is the config's ``name``, else its ``__name__``.

    Raises :class:`RewardLoadError` for a spec that does not load, a non-finite weight,
    config ``kwargs`` the function cannot accept, or two functions with the same name.
    """
    reward_fns: list[RewardFn] = []
    specs_by_name: dict[str, str] = {}
    for config in configs:
        fn = load_reward_fn(config.fn, base_dir=base_dir)
        name = config.name if config.name is not None else _default_name(fn, spec=config.fn)
        if not name:
            raise RewardLoadError(f"reward spec {config.fn!r}: `name:` must not be empty")
        if name in specs_by_name:
            raise RewardLoadError(
                f"two reward functions are named {name!r} ({specs_by_name[name]!r} and "
                f"{config.fn!r}); give each a distinct `name:` in the reward config"
            )
        if not math.isfinite(config.weight):
            raise RewardLoadError(f"reward {name!r}: weight {config.weight} is not finite")
        _check_kwargs(fn, dict(config.kwargs), name=name)
        specs_by_name[name] = config.fn
        reward_fns.append(RewardFn(name, fn, config.weight, dict(config.kwargs)))
    return reward_fns


class LocalScorer:
    """Scores rollouts in this process: a plain loop, or a thread pool of ``max_workers``
    threads (useful when reward functions wait on I/O or release the GIL). Both give the
    same results; only the timing differs.
    """

    def __init__(self, reward_fns: Sequence[RewardFn], *, max_workers: int = 1) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if not reward_fns:
            raise ValueError("LocalScorer needs at least one reward function")
        self.reward_fns = list(reward_fns)
        self.max_workers = max_workers

    def score(self, prompts: Mapping[str, Prompt], rollouts: list[Rollout]) -> ScoreStats:
        """Fill ``rewards``, ``reward`` and ``reward_error`` of every rollout, in place.

        ``prompts`` maps ``Rollout.prompt_id`` to its prompt; a missing id is a bug in the
        caller and raises KeyError before any reward function runs.
        """
        missing = sorted({r.prompt_id for r in rollouts if r.prompt_id not in prompts})
        if missing:
            raise KeyError(f"rollouts refer to prompt ids not passed to score(): {missing[:5]}")
        jobs = [(rf, prompts[r.prompt_id], r.text) for r in rollouts for rf in self.reward_fns]
        if self.max_workers > 1 and len(jobs) > 1:
            with ThreadPoolExecutor(self.max_workers, thread_name_prefix="reward") as pool:
                outcomes = list(pool.map(lambda job: _call_one(*job), jobs))
        else:
            outcomes = [_call_one(*job) for job in jobs]
        n_fns = len(self.reward_fns)
        for i, rollout in enumerate(rollouts):
            _fill(rollout, self.reward_fns, outcomes[i * n_fns : (i + 1) * n_fns])
        return _stats(self.reward_fns, rollouts, outcomes)


def _call_one(rf: RewardFn, prompt: Prompt, completion: str) -> _Outcome:
    """One call of one reward function; every failure becomes an error message."""
    meta = {**prompt.meta, **rf.kwargs}
    start = time.perf_counter()
    try:
        value = rf.fn(prompt, completion, **meta)
    except Exception as exc:  # user code: any failure is "no score", reported by name
        elapsed = time.perf_counter() - start
        message = _shorten(str(exc))
        return _Outcome(None, f"{rf.name}: {type(exc).__name__}: {message}", elapsed)
    elapsed = time.perf_counter() - start
    if value is None:
        return _Outcome(None, f"{rf.name}: returned None", elapsed)
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        return _Outcome(
            None,
            f"{rf.name}: returned {type(value).__name__} {_shorten(repr(value))} "
            "(expected a finite number)",
            elapsed,
        )
    return _Outcome(float(value), None, elapsed)


def _fill(rollout: Rollout, reward_fns: Sequence[RewardFn], outcomes: Sequence[_Outcome]) -> None:
    rollout.rewards = {rf.name: o.value for rf, o in zip(reward_fns, outcomes)}
    errors = [o.error for o in outcomes if o.error is not None]
    rollout.reward_error = errors[0] if errors else None
    if errors:
        rollout.reward = None
    else:
        rollout.reward = sum(rf.weight * o.value for rf, o in zip(reward_fns, outcomes))


def _stats(
    reward_fns: Sequence[RewardFn], rollouts: Sequence[Rollout], outcomes: Sequence[_Outcome]
) -> ScoreStats:
    n_fns = len(reward_fns)
    per_fn_mean: dict[str, float] = {}
    per_fn_errors: dict[str, int] = {}
    seconds: dict[str, float] = {}
    for k, rf in enumerate(reward_fns):
        mine = outcomes[k::n_fns]
        values = [o.value for o in mine if o.value is not None]
        per_fn_mean[rf.name] = sum(values) / len(values) if values else math.nan
        per_fn_errors[rf.name] = len(mine) - len(values)
        seconds[rf.name] = sum(o.seconds for o in mine)
    errors = sum(1 for r in rollouts if r.reward is None)
    return ScoreStats(errors, per_fn_mean, per_fn_errors, seconds)


def _default_name(fn: Callable[..., Any], *, spec: str) -> str:
    """The function's ``__name__``; for callables without a real one (a lambda, a
    ``functools.partial``, an object with ``__call__``) the name written in the spec."""
    name = getattr(fn, "__name__", None)
    if isinstance(name, str) and name.isidentifier():
        return name
    return spec.rpartition(":")[2].strip()


def _check_kwargs(fn: Callable[..., Any], kwargs: dict[str, Any], *, name: str) -> None:
    """Config kwargs are known at load time, so check them now instead of failing on
    every sample. Dataset meta keys are only known per row and are checked by the call."""
    reserved = sorted({"prompt", "completion"} & kwargs.keys())
    if reserved:
        raise RewardLoadError(f"reward {name!r}: kwargs may not be named {reserved}")
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    accepted = {p.name for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    unknown = sorted(kwargs.keys() - accepted)
    if unknown:
        raise RewardLoadError(
            f"reward {name!r}: kwargs {unknown} are not parameters of the function "
            f"(it accepts {sorted(accepted)}); add `**meta` to its signature to accept any"
        )


def _shorten(text: str) -> str:
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."
