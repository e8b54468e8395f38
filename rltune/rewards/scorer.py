"""Scoring rollouts with the configured reward functions: concurrently, with a per-call
timeout, a cache, and errors kept as data.

The pieces: :mod:`rltune.rewards.calls` (one call and what its result means),
:mod:`rltune.rewards.results` (the combined reward and the typed statistics),
:mod:`rltune.rewards.executors` (where calls run) and :mod:`rltune.rewards.round` (one
``score()`` call: de-duplication, the cache, submitting and collecting).

Each reward function is called as ``fn(prompt, completion, **meta)`` with
``meta = {**prompt.meta, **kwargs}``: keyword arguments from the config override dataset
fields of the same name (so a recipe can pin, e.g., a ``pattern`` for every row). Each
call gets its own copies of the mutable parts (:mod:`rltune.rewards.arguments`), so a
reward that changes them changes neither the data nor other calls. The other forms
(``@batched``, ``async def``) are in :mod:`rltune.rewards.contract`.

The combined reward of a sample is the weighted sum ``r = sum_k w_k * r_k`` over the
reward functions. If *any* function gives no score for a sample (it returned None, raised,
timed out, or returned something that is not a finite number), the sample's ``reward`` is
None: a partial sum would silently score the sample as if the failed term were 0. Such
samples are masked out of the advantage downstream and counted in ``reward/errors``. A
failing user function never makes the scorer raise: errors are data.

How calls run (``pool``):

- ``thread`` (default): per-sample and batched functions in a pool of ``max_workers``
  threads; right for functions that wait (HTTP, subprocesses such as the code sandbox) or
  release the GIL. A call past its timeout is abandoned: it is scored as an error at once
  and its thread is left to finish on its own (Python cannot stop a thread), and a new
  thread takes its place, so the pool keeps its width. The threads are daemons:
  a call that never returns does not keep the process from exiting.
- ``process``: per-sample functions in ``max_workers`` worker processes (right for
  CPU-bound Python, e.g. symbolic maths); a call past its timeout has its worker killed
  and replaced, and a worker that dies (a segfault, ``os._exit``) is an error for the
  sample it was on, never the end of the run. Functions are loaded in the workers from
  their spec (or pickled by reference when built in code). Batched functions still run in
  a thread of this process.
- ``async def`` functions, of either form, run on one event loop in a thread of this
  process, all at once; their timeout cancels the coroutine.

Identical (function, prompt, completion) calls are made once per round and their values
cached across rounds (``cache_size`` entries, least recently used dropped; errors are not
cached, so a transient failure is retried next time).
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from rltune.data.records import Prompt, Rollout
from rltune.metrics import keys
from rltune.rewards.calls import RewardFn, Sample
from rltune.rewards.contract import is_batched, is_verifier
from rltune.rewards.executors import Executors
from rltune.rewards.executors.processes import check_shippable
from rltune.rewards.loading import RewardLoadError, load_reward_fn
from rltune.rewards.results import ScoreStats, fill, score_stats
from rltune.rewards.round import RewardCache, Round

if TYPE_CHECKING:  # only for annotations: scoring needs none of the config machinery
    from rltune.config.schema import RewardFnConfig

__all__ = ["LocalScorer", "RewardFn", "ScoreStats", "build_reward_fns"]


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
        # the config refused reserved names it could see; the function's own name shows here
        problem = keys.reward_name_problem(name, runtime_rewards=())
        if problem is not None:
            raise RewardLoadError(f"reward spec {config.fn!r}: {problem}; give it another `name:`")
        if name in specs_by_name:
            raise RewardLoadError(
                f"two reward functions are named {name!r} ({specs_by_name[name]!r} and "
                f"{config.fn!r}); give each a distinct `name:` in the reward config"
            )
        if not math.isfinite(config.weight):
            raise RewardLoadError(f"reward {name!r}: weight {config.weight} is not finite")
        _check_kwargs(fn, dict(config.kwargs), name=name, spec=config.fn)
        specs_by_name[name] = config.fn
        reward_fns.append(
            RewardFn(
                name, fn, config.weight, dict(config.kwargs), timeout_s=config.timeout_s,
                cache=config.cache, spec=config.fn, base_dir=base_dir,
                accuracy=is_verifier(fn) if config.accuracy is None else config.accuracy,
            )
        )
    return reward_fns


class LocalScorer:
    """Scores rollouts on this machine (see the module docstring for ``pool``). With
    ``max_workers == 1`` and ``pool == "thread"`` calls still run in one worker thread, so
    that a hung call can time out. Results never depend on the pool or its width."""

    def __init__(
        self,
        reward_fns: Sequence[RewardFn],
        *,
        max_workers: int = 4,
        pool: Literal["thread", "process"] = "thread",
        cache_size: int = 100_000,
    ) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if pool not in ("thread", "process"):
            raise ValueError(f"pool must be 'thread' or 'process', got {pool!r}")
        self.reward_fns = list(reward_fns)
        if pool == "process":
            check_shippable(self.reward_fns)
        self.max_workers = max_workers
        self.pool = pool
        self.cache = RewardCache(cache_size)
        self.executors = Executors(self.reward_fns, pool=pool, width=max_workers)

    @property
    def accuracy_names(self) -> tuple[str, ...]:
        """The rewards whose share of 1.0 scores is logged as accuracy."""
        return tuple(f.name for f in self.reward_fns if f.accuracy)

    def step_metrics(self) -> dict[str, float]:
        """Nothing to report per step beyond :meth:`score`'s statistics (the Scorer
        protocol's hook; a pool of remote scorers reports its restarts here)."""
        return {}

    def score(self, prompts: Mapping[str, Prompt], rollouts: list[Rollout]) -> ScoreStats:
        """Fill ``rewards``, ``reward``, ``reward_error`` and ``dropped`` of every rollout,
        in place.

        ``prompts`` maps ``Rollout.prompt_id`` to its prompt; a missing id is a bug in the
        caller and raises KeyError before any reward function runs.
        """
        missing = sorted({r.prompt_id for r in rollouts if r.prompt_id not in prompts})
        if missing:
            raise KeyError(f"rollouts refer to prompt ids not passed to score(): {missing[:5]}")
        samples = [Sample(prompts[r.prompt_id], r.text, r.turns) for r in rollouts]
        round_ = Round(self.reward_fns, samples, self.cache)
        outcomes = round_.run(self.executors.for_fn)
        for i, rollout in enumerate(rollouts):
            fill(rollout, self.reward_fns, [outcomes[k][i] for k in range(len(self.reward_fns))])
        return score_stats(self.reward_fns, rollouts, outcomes, calls=round_.calls, cache_hits=round_.cache_hits)

    def close(self) -> None:
        """Stop the worker threads, processes and event loop (idempotent)."""
        self.executors.close()

    def __enter__(self) -> "LocalScorer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _default_name(fn: Callable[..., Any], *, spec: str) -> str:
    """The function's ``__name__``; for callables without a real one (a lambda, a
    ``functools.partial``, an object with ``__call__``) the name written in the spec."""
    name = getattr(fn, "__name__", None)
    if isinstance(name, str) and name.isidentifier():
        return name
    return spec.rpartition(":")[2].strip()


def _check_kwargs(fn: Callable[..., Any], kwargs: dict[str, Any], *, name: str, spec: str) -> None:
    """Config kwargs are known at load time, so check them now instead of failing on
    every sample. Dataset meta keys are only known per row and are checked by the call."""
    reserved = sorted({"prompt", "completion"} & kwargs.keys())
    if reserved:
        raise RewardLoadError(f"reward {name!r}: kwargs may not be named {reserved}")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = None
    if params is not None:
        _check_kwarg_names(params, kwargs, batched=is_batched(fn), name=name)
    check = getattr(fn, "check_kwargs", None)  # a function's own check of its config values
    if check is None:
        return
    try:
        check(kwargs)
    except ValueError as err:  # the hook's way to refuse a value: its message says why
        raise RewardLoadError(f"reward {name!r}: {err}") from None
    except Exception as err:  # a bug in the hook (a KeyError, a TypeError): name where
        raise RewardLoadError(
            f"reward {name!r} (spec {spec!r}): its check_kwargs hook raised {type(err).__name__}: {err} "
            "(a check_kwargs hook refuses a value by raising ValueError)"
        ) from err


def _check_kwarg_names(params: list[inspect.Parameter], kwargs: dict[str, Any], *, batched: bool, name: str) -> None:
    if batched:  # it gets the config's kwargs only: a required one missing fails every call
        missing = [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY
                   and p.default is inspect.Parameter.empty and p.name not in kwargs]
        if missing:
            raise RewardLoadError(f"reward {name!r}: kwargs {missing} are required (a batched reward gets "
                                  "only the config's kwargs, no dataset fields)")
    # ``**_`` takes the dataset's other fields and ignores them: the config's kwargs must
    # still be named parameters (a typo would be ignored too)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD and p.name != "_" for p in params):
        return
    accepted = {p.name for p in params if p.kind not in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_KEYWORD)}
    accepted -= {"prompt", "completion", "prompts", "completions"}
    unknown = sorted(kwargs.keys() - accepted)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(accepted), n=1)
        raise RewardLoadError(
            f"reward {name!r}: kwargs {unknown} are not parameters of the function "
            f"(it accepts {sorted(accepted)})"
            + (f"; did you mean {close[0]!r}?" if close else "; add `**meta` to its signature to accept any")
        )
