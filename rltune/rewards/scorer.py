"""Scoring rollouts with the configured reward functions: concurrently, with a per-call
timeout, a cache, and errors kept as data.

Each reward function is called as ``fn(prompt, completion, **meta)`` with
``meta = {**prompt.meta, **kwargs}``: keyword arguments from the config override dataset
fields of the same name (so a recipe can pin, e.g., a ``pattern`` for every row). The other
forms (``@batched``, ``async def``) are in :mod:`rltune.rewards.contract`.

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
  and its thread is left to finish on its own (Python cannot stop a thread), so the pool
  gets a new thread in its place, so the pool keeps its width. The threads are daemons:
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

import asyncio
import hashlib
import inspect
import json
import math
import multiprocessing
import numbers
import queue
import pickle  # only to check a function can reach a worker process
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_connections
from typing import TYPE_CHECKING, Any, Literal

from rltune.data.records import Prompt, Rollout
from rltune.rewards.contract import SampleDropped, is_batched, is_verifier
from rltune.rewards.loading import RewardLoadError, load_reward_fn

if TYPE_CHECKING:  # only for annotations: scoring needs none of the config machinery
    from rltune.config.schema import RewardFnConfig

_MAX_SHOWN = 80  # characters of a bad return value or exception message kept in errors
_POLL_S = 0.05  # how often running calls are checked against their timeout


@dataclass(frozen=True)
class RewardFn:
    """One configured reward function (any form of :mod:`rltune.rewards.contract`).

    ``timeout_s``: the most one call may take (None: no limit); a batched call is one
    call. ``cache``: reuse values of identical calls (turn off for a reward that is not a
    function of its inputs, e.g. one that samples). ``spec``/``base_dir``: where it was
    loaded from, so worker processes can load it too.
    """

    name: str
    fn: Callable[..., Any]
    weight: float = 1.0
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None
    cache: bool = True
    spec: str | None = None
    base_dir: str | None = None
    accuracy: bool = False
    """A pass/fail verifier: the share of its samples scoring 1.0 is logged as accuracy."""

    @property
    def batched(self) -> bool:
        return is_batched(self.fn)

    @property
    def is_async(self) -> bool:
        fn = self.fn
        call = getattr(fn, "__call__", None)
        return inspect.iscoroutinefunction(fn) or (
            not inspect.isfunction(fn) and inspect.iscoroutinefunction(call)
        )


@dataclass
class ScoreStats:
    """What one :meth:`LocalScorer.score` call saw.

    ``errors``: samples whose combined reward is None for a failure (not a deliberate
    drop). ``dropped``: samples a reward dropped (:class:`SampleDropped`). ``per_fn_mean``:
    mean of each function's values (NaN when it scored none). ``per_fn_errors``: samples
    each function failed on. ``seconds``: time spent in each function's calls, summed (with
    concurrency this can exceed the wall time). ``calls``: calls made per function (after
    de-duplication and the cache). ``cache_hits``/``timeouts``: over all functions.
    """

    errors: int
    per_fn_mean: dict[str, float]
    per_fn_errors: dict[str, int]
    seconds: dict[str, float]
    calls: dict[str, int] = field(default_factory=dict)
    dropped: int = 0
    cache_hits: int = 0
    timeouts: int = 0

    def metrics(self) -> dict[str, float]:
        """The step metrics: ``time/reward/NAME`` (seconds), ``perf/reward_calls/NAME``,
        ``reward/errors/NAME`` and the totals ``perf/reward_cache_hits``,
        ``reward/timeouts``, ``reward/dropped``. ``time/`` and ``perf/`` metrics depend on
        the machine and on this process's cache (a resumed run starts with an empty one),
        not on the training state."""
        out: dict[str, float] = {}
        for name in self.seconds:
            out[f"time/reward/{name}"] = self.seconds[name]
            out[f"perf/reward_calls/{name}"] = float(self.calls.get(name, 0))
            out[f"reward/errors/{name}"] = float(self.per_fn_errors[name])
        out["perf/reward_cache_hits"] = float(self.cache_hits)
        out["reward/timeouts"] = float(self.timeouts)
        out["reward/dropped"] = float(self.dropped)
        return out


@dataclass(frozen=True)
class _Outcome:
    value: float | None
    error: str | None
    seconds: float
    dropped: bool = False
    timed_out: bool = False


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
        if not is_batched(fn):
            _check_kwargs(fn, dict(config.kwargs), name=name)
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
            _check_shippable(self.reward_fns)
        self.max_workers = max_workers
        self.pool = pool
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._threads: _DaemonThreads | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._processes: _ProcessPool | None = None

    @property
    def accuracy_names(self) -> tuple[str, ...]:
        """The rewards whose share of 1.0 scores is logged as accuracy."""
        return tuple(f.name for f in self.reward_fns if f.accuracy)

    def score(self, prompts: Mapping[str, Prompt], rollouts: list[Rollout]) -> ScoreStats:
        """Fill ``rewards``, ``reward``, ``reward_error`` and ``dropped`` of every rollout,
        in place.

        ``prompts`` maps ``Rollout.prompt_id`` to its prompt; a missing id is a bug in the
        caller and raises KeyError before any reward function runs.
        """
        missing = sorted({r.prompt_id for r in rollouts if r.prompt_id not in prompts})
        if missing:
            raise KeyError(f"rollouts refer to prompt ids not passed to score(): {missing[:5]}")
        samples = [_Sample(prompts[r.prompt_id], r.text, r.turns) for r in rollouts]
        round_ = _Round(self, samples)
        outcomes = round_.run()
        for i, rollout in enumerate(rollouts):
            _fill(rollout, self.reward_fns, [outcomes[k][i] for k in range(len(self.reward_fns))])
        stats = _stats(self.reward_fns, rollouts, outcomes)
        stats.calls, stats.cache_hits = round_.calls, round_.cache_hits
        return stats

    def close(self) -> None:
        """Stop the worker threads, processes and event loop (idempotent)."""
        if self._threads is not None:
            self._threads.shutdown()
            self._threads = None
        if self._processes is not None:
            self._processes.close()
            self._processes = None
        if self._loop is not None:
            loop, self._loop = self._loop, None
            try:
                asyncio.run_coroutine_threadsafe(_cancel_all(), loop).result(timeout=5.0)
            except Exception:  # noqa: BLE001 - a coroutine that ignores cancelling is left to the loop
                pass
            loop.call_soon_threadsafe(loop.stop)

    def __enter__(self) -> "LocalScorer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the resources a round uses, created on first need --------------------------------

    def _thread_pool(self) -> "_DaemonThreads":
        if self._threads is None:
            self._threads = _DaemonThreads(self.max_workers)
        return self._threads

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=_run_loop, args=(loop,), name="reward-async", daemon=True).start()
            self._loop = loop
        return self._loop

    def _process_pool(self) -> "_ProcessPool":
        if self._processes is None:
            shipped = [rf for rf in self.reward_fns if not rf.batched and not rf.is_async]
            self._processes = _ProcessPool(shipped, self.max_workers)
        return self._processes

    def _cached(self, key: tuple[str, str]) -> float | None:
        value = self._cache.get(key)
        if value is not None:
            self._cache.move_to_end(key)
        return value

    def _remember(self, key: tuple[str, str], value: float) -> None:
        if self.cache_size <= 0:
            return
        self._cache[key] = value
        self._cache.move_to_end(key)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)


class _DaemonThreads:
    """A fixed-width pool of daemon threads on one queue. Unlike ThreadPoolExecutor (whose
    threads the interpreter joins at exit), a call that never returns neither blocks exit
    nor, after :meth:`replace_one`, takes a slot from later calls."""

    def __init__(self, size: int) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.count = 0
        for _ in range(size):
            self.replace_one()

    def replace_one(self) -> None:
        """Start one more thread, in place of one stuck in a call that timed out."""
        self.count += 1
        threading.Thread(target=self._work, name=f"reward-{self.count}", daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self.jobs.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        for _ in range(self.count):
            self.jobs.put(None)

    def _work(self) -> None:
        while (item := self.jobs.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # delivered to the collector, which reports it
                future.set_exception(exc)


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        loop.close()


async def _cancel_all() -> None:
    """Cancel the loop's other tasks (calls abandoned at their timeout) and wait for them."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class _Round:
    """One ``score()`` call: which calls to make, making them, and collecting outcomes."""

    def __init__(self, scorer: LocalScorer, samples: list["_Sample"]) -> None:
        self.scorer = scorer
        self.samples = samples
        n = len(samples)
        self.outcomes: list[list[_Outcome | None]] = [[None] * n for _ in scorer.reward_fns]
        self.calls: dict[str, int] = {rf.name: 0 for rf in scorer.reward_fns}
        self.cache_hits = 0
        keys = [_sample_key(sample) for sample in samples]
        # per function: unique sample key -> the samples that share it
        self.groups: list[dict[str, list[int]]] = []
        for k, rf in enumerate(scorer.reward_fns):
            groups: dict[str, list[int]] = {}
            for i, key in enumerate(keys):
                if rf.cache and (value := scorer._cached((rf.name, key))) is not None:
                    self.outcomes[k][i] = _Outcome(value, None, 0.0)
                    self.cache_hits += 1
                    continue
                groups.setdefault(key if rf.cache else str(i), []).append(i)
            self.groups.append(groups)

    def run(self) -> list[list[_Outcome]]:
        pending: list[_Job] = []
        for k, rf in enumerate(self.scorer.reward_fns):
            groups = self.groups[k]
            if not groups:
                continue
            firsts = [members[0] for members in groups.values()]
            if rf.batched:
                pending.append(self._submit(k, rf, firsts))
                self.calls[rf.name] += 1
            else:
                pending.extend(self._submit(k, rf, [i]) for i in firsts)
                self.calls[rf.name] += len(firsts)
        self._collect(pending)
        return self.outcomes  # type: ignore[return-value]

    # -- submitting -----------------------------------------------------------------------

    def _submit(self, k: int, rf: RewardFn, rows: list[int]) -> "_Job":
        prompts = [self.samples[i].prompt for i in rows]
        texts = [self.samples[i].completion for i in rows]
        job = _Job(k, rf, rows)
        if rf.is_async:
            coro = (
                _call_async(rf, prompts, texts) if rf.batched
                else _call_async_one(rf, self.samples[rows[0]])
            )
            job.future = asyncio.run_coroutine_threadsafe(coro, self.scorer._event_loop())
            job.started = time.perf_counter()  # the loop starts every coroutine at once
            job.kind = "async"
        elif self.scorer.pool == "process" and not rf.batched:
            job.kind = "process"
            self.scorer._process_pool().submit(job, self.samples[rows[0]])
        else:
            job.kind = "thread"
            job.future = self.scorer._thread_pool().submit(_run_in_thread, job, [self.samples[i] for i in rows])
        return job

    # -- collecting -----------------------------------------------------------------------

    def _collect(self, jobs: list["_Job"]) -> None:
        futures = {j.future: j for j in jobs if j.future is not None}
        processes = self.scorer._processes if any(j.kind == "process" for j in jobs) else None
        remaining = {id(j): j for j in jobs}
        while remaining:
            if processes is not None:
                for job, result in processes.poll(_POLL_S):
                    self._finish(job, result)
                    remaining.pop(id(job), None)
            live = [f for f in futures if id(futures[f]) in remaining]
            if live:
                done, _ = wait(live, timeout=_POLL_S, return_when=FIRST_COMPLETED)
                for fut in done:
                    job = futures[fut]
                    self._finish(job, _future_result(fut, job))
                    remaining.pop(id(job), None)
            now = time.perf_counter()
            for job in list(remaining.values()):
                limit = job.rf.timeout_s
                if limit is None or job.started is None or now - job.started <= limit:
                    continue
                remaining.pop(id(job))
                self._finish(job, _timeout_result(job, limit))
                if job.kind == "async" and job.future is not None:
                    job.future.cancel()
                elif job.kind == "thread":
                    self.scorer._thread_pool().replace_one()
                elif job.kind == "process" and processes is not None:
                    processes.kill(job)

    def _finish(self, job: "_Job", result: list[_Outcome]) -> None:
        rf = job.rf
        for row, outcome in zip(job.rows, result):
            key = _sample_key(self.samples[row]) if rf.cache else str(row)
            members = self.groups[job.k][key]
            for i in members:
                self.outcomes[job.k][i] = outcome if i == row else _shared(outcome)
            if rf.cache and outcome.value is not None:
                self.scorer._remember((rf.name, key), outcome.value)


@dataclass(eq=False)
class _Job:
    k: int
    rf: RewardFn
    rows: list[int]
    kind: str = "thread"
    future: Any = None
    started: float | None = None
    """When the call began running (not when it was queued): its timeout counts from here."""


def _shared(outcome: _Outcome) -> _Outcome:
    """The outcome of a duplicate sample: same value or error, no time of its own."""
    return _Outcome(outcome.value, outcome.error, 0.0, outcome.dropped, outcome.timed_out)


def _future_result(fut: Future, job: _Job) -> list[_Outcome]:
    try:
        return fut.result()
    except BaseException as exc:  # a cancelled or crashed wrapper: still an error, not a raise
        return [_error_outcome(job.rf, exc, 0.0)] * len(job.rows)


def _timeout_result(job: _Job, limit: float) -> list[_Outcome]:
    what = "batched call" if job.rf.batched else "call"
    message = f"{job.rf.name}: timed out ({what} took over {limit:g} s)"
    return [_Outcome(None, message, limit, timed_out=True)] * len(job.rows)


@dataclass(frozen=True)
class _Sample:
    """What a reward sees of one rollout: its prompt, the completion (an episode's last
    turn) and, for episodes, the turns (given to per-sample rewards as ``turns``)."""

    prompt: Prompt
    completion: str
    turns: list[dict[str, Any]] | None = None

    def meta(self, rf: RewardFn) -> dict[str, Any]:
        turns = {} if self.turns is None else {"turns": self.turns}
        return {**self.prompt.meta, **turns, **rf.kwargs}


def _run_in_thread(job: _Job, samples: list[_Sample]) -> list[_Outcome]:
    job.started = time.perf_counter()
    if job.rf.batched:
        return _call_batch(job.rf, [s.prompt for s in samples], [s.completion for s in samples])
    return [_call_one(job.rf, samples[0])]


def _call_one(rf: RewardFn, sample: _Sample) -> _Outcome:
    """One call of one per-sample reward function; every failure becomes an error."""
    start = time.perf_counter()
    try:
        value = rf.fn(sample.prompt, sample.completion, **sample.meta(rf))
    except Exception as exc:  # user code: any failure is "no score", reported by name
        return _error_outcome(rf, exc, time.perf_counter() - start)
    return _checked(rf, value, time.perf_counter() - start)


async def _call_async_one(rf: RewardFn, sample: _Sample) -> list[_Outcome]:
    start = time.perf_counter()
    try:
        value = await rf.fn(sample.prompt, sample.completion, **sample.meta(rf))
    except Exception as exc:
        return [_error_outcome(rf, exc, time.perf_counter() - start)]
    return [_checked(rf, value, time.perf_counter() - start)]


def _call_batch(rf: RewardFn, prompts: list[Prompt], texts: list[str]) -> list[_Outcome]:
    start = time.perf_counter()
    try:
        values = rf.fn(prompts, texts, **rf.kwargs)
    except Exception as exc:
        return [_error_outcome(rf, exc, time.perf_counter() - start)] * len(prompts)
    return _batch_outcomes(rf, values, len(prompts), time.perf_counter() - start)


async def _call_async(rf: RewardFn, prompts: list[Prompt], texts: list[str]) -> list[_Outcome]:
    start = time.perf_counter()
    try:
        values = await rf.fn(prompts, texts, **rf.kwargs)
    except Exception as exc:
        return [_error_outcome(rf, exc, time.perf_counter() - start)] * len(prompts)
    return _batch_outcomes(rf, values, len(prompts), time.perf_counter() - start)


def _batch_outcomes(rf: RewardFn, values: Any, n: int, seconds: float) -> list[_Outcome]:
    """A batched function's result, checked: one entry per completion. Its time is
    shared out evenly, so per-function seconds add up to the call's."""
    try:
        values = list(values)
    except TypeError:
        values = None
    if values is None or len(values) != n:
        got = "a non-sequence" if values is None else f"{len(values)} values"
        error = _Outcome(None, f"{rf.name}: returned {got} for {n} completions", seconds / max(n, 1))
        return [error] * n
    each = seconds / n
    return [
        _error_outcome(rf, v, each) if isinstance(v, BaseException) else _checked(rf, v, each)
        for v in values
    ]


def _error_outcome(rf: RewardFn, exc: BaseException, seconds: float) -> _Outcome:
    if isinstance(exc, SampleDropped):
        return _Outcome(None, f"{rf.name}: dropped: {_shorten(str(exc))}", seconds, dropped=True)
    return _Outcome(None, f"{rf.name}: {type(exc).__name__}: {_shorten(str(exc))}", seconds)


def _checked(rf: RewardFn, value: Any, seconds: float) -> _Outcome:
    if value is None:
        return _Outcome(None, f"{rf.name}: returned None", seconds)
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        return _Outcome(
            None,
            f"{rf.name}: returned {type(value).__name__} {_shorten(repr(value))} "
            "(expected a finite number)",
            seconds,
        )
    return _Outcome(float(value), None, seconds)


def _sample_key(sample: _Sample) -> str:
    """What a reward can depend on: the prompt (id, content, meta), the completion and
    an episode's turns."""
    prompt = sample.prompt
    body = json.dumps(
        [prompt.id, prompt.text, prompt.messages, prompt.meta, sample.completion, sample.turns],
        sort_keys=True, default=repr, ensure_ascii=False,
    )
    return hashlib.blake2b(body.encode(), digest_size=16).hexdigest()


def _fill(rollout: Rollout, reward_fns: Sequence[RewardFn], outcomes: Sequence[_Outcome]) -> None:
    """The rollout's rewards: each function's value, an episode's ``env`` reward, and the
    sum (weighted functions plus the env reward), None when any part failed."""
    rollout.rewards = {rf.name: o.value for rf, o in zip(reward_fns, outcomes)}
    errors = [o.error for o in outcomes if o.error is not None and not o.dropped]
    drops = [o.error for o in outcomes if o.dropped]
    episode = rollout.turns is not None or rollout.env_error is not None
    if episode:
        rollout.rewards["env"] = rollout.env_reward
        if rollout.env_error is not None:
            errors.insert(0, rollout.env_error)
    elif not reward_fns:
        errors.append("no reward function is configured and the sample is not an episode")
    rollout.dropped = bool(drops) and not errors
    rollout.reward_error = errors[0] if errors else (drops[0] if drops else None)
    if errors or drops:
        rollout.reward = None
    else:
        total = sum(rf.weight * o.value for rf, o in zip(reward_fns, outcomes))
        rollout.reward = total + (rollout.env_reward or 0.0 if episode else 0.0)


def _stats(
    reward_fns: Sequence[RewardFn], rollouts: Sequence[Rollout], outcomes: Sequence[Sequence[_Outcome]]
) -> ScoreStats:
    per_fn_mean: dict[str, float] = {}
    per_fn_errors: dict[str, int] = {}
    seconds: dict[str, float] = {}
    for rf, mine in zip(reward_fns, outcomes):
        values = [o.value for o in mine if o.value is not None]
        per_fn_mean[rf.name] = sum(values) / len(values) if values else math.nan
        per_fn_errors[rf.name] = sum(1 for o in mine if o.value is None and not o.dropped)
        seconds[rf.name] = sum(o.seconds for o in mine)
    dropped = sum(1 for r in rollouts if r.dropped)
    errors = sum(1 for r in rollouts if r.reward is None) - dropped
    timeouts = sum(1 for mine in outcomes for o in mine if o.timed_out)
    return ScoreStats(errors, per_fn_mean, per_fn_errors, seconds, dropped=dropped, timeouts=timeouts)


# -- worker processes -----------------------------------------------------------------------


class _ProcessPool:
    """``size`` worker processes, each loading the per-sample reward functions once. A job
    goes to a worker once it is ready (its start-up does not count against the job's
    timeout); a worker past its job's timeout is killed and replaced."""

    def __init__(self, reward_fns: Sequence[RewardFn], size: int) -> None:
        self.context = multiprocessing.get_context("spawn")
        self.recipes = [_recipe(rf) for rf in reward_fns]
        self.idle: list[_Worker] = []
        self.starting: dict[Connection, _Worker] = {}
        self.busy: dict[Connection, _Worker] = {}
        self.queue: list[tuple[_Job, _Sample]] = []
        self.failed: list[tuple[_Job, list[_Outcome]]] = []
        self.broken: str | None = None
        for _ in range(size):
            self._spawn()

    def _spawn(self) -> None:
        parent, child = self.context.Pipe()
        process = self.context.Process(
            target=_worker_main, args=(child, self.recipes), name="reward-worker", daemon=True
        )
        process.start()
        child.close()
        self.starting[parent] = _Worker(process, parent)

    def submit(self, job: _Job, sample: _Sample) -> None:
        self.queue.append((job, sample))
        self._dispatch()

    def _dispatch(self) -> None:
        if self.broken is not None:
            self.failed += [(job, [_Outcome(None, f"{job.rf.name}: {self.broken}", 0.0)]) for job, _ in self.queue]
            self.queue = []
        while self.queue and self.idle:
            job, sample = self.queue.pop(0)
            worker = self.idle.pop()
            worker.job = job
            try:
                worker.conn.send((job.rf.name, sample))
            except (OSError, ValueError) as exc:  # a dead pipe, or an unpicklable prompt
                message = f"{job.rf.name}: could not hand the call to a reward worker: {exc}"
                self.failed.append((job, [_Outcome(None, message, 0.0)]))
                self._replace(worker)
                continue
            job.started = time.perf_counter()
            self.busy[worker.conn] = worker

    def poll(self, timeout: float) -> list[tuple[_Job, list[_Outcome]]]:
        """Jobs finished within ``timeout`` seconds, with their outcomes."""
        finished, self.failed = self.failed, []
        watched = [*self.busy, *self.starting]
        for conn in wait_connections(watched, timeout=timeout) if watched else []:
            if conn in self.starting:
                self._started(self.starting.pop(conn))
                continue
            worker = self.busy.pop(conn)
            job = worker.job
            try:
                outcome = conn.recv()
            except (EOFError, OSError):
                worker.process.join(timeout=1.0)
                code = worker.process.exitcode
                outcome = _Outcome(
                    None, f"{job.rf.name}: the reward worker process died (exit code {code})",
                    time.perf_counter() - (job.started or time.perf_counter()),
                )
                self._replace(worker)
            else:
                worker.job = None
                self.idle.append(worker)
            finished.append((job, [outcome]))
        self._dispatch()
        return finished + self.failed if self.failed and not finished else finished

    def _started(self, worker: "_Worker") -> None:
        try:
            status = worker.conn.recv()
        except (EOFError, OSError):
            worker.process.join(timeout=1.0)
            status = f"a reward worker process exited while starting (exit code {worker.process.exitcode})"
        if status == "ready":
            self.idle.append(worker)
        else:  # the functions do not load in a fresh process: no worker ever will
            self.broken = str(status)
            worker.process.kill()

    def kill(self, job: _Job) -> None:
        for conn, worker in list(self.busy.items()):
            if worker.job is job:
                del self.busy[conn]
                self._replace(worker)
        self._dispatch()

    def _replace(self, worker: "_Worker") -> None:
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(timeout=5.0)
        worker.conn.close()
        self._spawn()

    def close(self) -> None:
        for worker in [*self.idle, *self.busy.values(), *self.starting.values()]:
            try:
                worker.conn.send(None)
            except (OSError, ValueError):
                pass
            worker.process.join(timeout=1.0)
            if worker.process.is_alive():
                worker.process.kill()
        self.idle, self.busy, self.starting = [], {}, {}


@dataclass(eq=False)
class _Worker:
    process: Any
    conn: Connection
    job: _Job | None = None


def _recipe(rf: RewardFn) -> tuple[str, str | None, str | None, Any, Mapping[str, Any], float | None]:
    """What a worker needs to rebuild ``rf``: its spec when it has one (loaded in the
    worker), else the function itself (pickled by reference: a module-level function)."""
    return (rf.name, rf.spec, rf.base_dir, None if rf.spec else rf.fn, dict(rf.kwargs), rf.timeout_s)


def _check_shippable(reward_fns: Sequence[RewardFn]) -> None:
    """Worker processes load each per-sample function from its spec or unpickle it by
    reference; say so now, not on the first call, for one that allows neither."""
    for rf in reward_fns:
        if rf.spec or rf.batched or rf.is_async:
            continue
        try:
            pickle.dumps(rf.fn)
        except Exception as exc:  # pickling raises several types for unshippable objects
            raise ValueError(
                f"reward {rf.name!r} cannot run in a worker process: it has no spec to load it "
                f"from and cannot be pickled by reference ({type(exc).__name__}: {exc}); define "
                "it at module level, name it as `module:function`, or use pool='thread'"
            ) from exc


def _worker_main(conn: Connection, recipes: list[Any]) -> None:
    fns: dict[str, RewardFn] = {}
    try:
        for name, spec, base_dir, fn, kwargs, timeout in recipes:
            loaded = fn if fn is not None else load_reward_fn(spec, base_dir=base_dir)
            fns[name] = RewardFn(name, loaded, kwargs=kwargs, timeout_s=timeout)
    except Exception as exc:  # reported to the scorer, which fails the calls with it
        conn.send(f"the reward functions do not load in a worker process: {type(exc).__name__}: {exc}")
        return
    conn.send("ready")
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        name, sample = message
        conn.send(_call_one(fns[name], sample))


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
