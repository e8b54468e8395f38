"""One call of a reward function, and what its result means.

A :class:`Call` is a per-sample function on one sample or a batched function on several.
Making it never raises: whatever the user's code does (raise, return None, return
something that is not a finite number, drop the sample) becomes an :class:`Outcome` per
sample, a value or an error message. The forms a function can take are in
:mod:`rltune.rewards.contract`; where calls run is an executor's business
(:mod:`rltune.rewards.executors`).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import numbers
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from rltune.data.records import Prompt
from rltune.rewards.arguments import own_copy, own_kwargs, own_prompt
from rltune.rewards.contract import SampleDropped, is_batched

_MAX_SHOWN = 80  # characters of a bad return value's repr kept in its error
_MAX_MESSAGE = 2000
"""Characters of an exception's message kept in a sample's error: enough for the part of
a long message that says what went wrong (the keys a KeyError lists, an assertion's
text), bounded so that one pathological message cannot bloat every sample's record."""
_FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max


@dataclass(frozen=True)
class RewardFn:
    """One configured reward function (any form of :mod:`rltune.rewards.contract`).

    ``timeout_s``: the most one call may take (None: no limit); a batched call is one
    call. ``cache``: reuse values of identical calls (turn off for a reward that is not a
    function of its inputs, e.g. one that samples). ``spec``/``base_dir``: where it was
    loaded from, so worker processes can load it too. ``kwargs`` are copied for every call
    (like the sample's data): keep them to config values, and build heavy state (a model,
    a client) on the first call with :class:`~rltune.rewards.keyed_cache.KeyedCache`.
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


@dataclass(frozen=True)
class Sample:
    """What a reward sees of one rollout: its prompt, the completion (an episode's last
    turn) and, for episodes, the turns (given to per-sample rewards as ``turns``)."""

    prompt: Prompt
    completion: str
    turns: list[dict[str, Any]] | None = None

    def arguments(self, rf: RewardFn) -> tuple[Prompt, dict[str, Any]]:
        """The prompt and ``meta`` of one per-sample call of ``rf``, ``meta`` being
        ``{**prompt.meta, "turns": turns, **rf.kwargs}``: copies of the mutable parts
        (:mod:`rltune.rewards.arguments`), so that the call cannot change the data."""
        memo: dict[int, Any] = {}
        prompt = own_prompt(self.prompt, memo)
        turns = {} if self.turns is None else {"turns": own_copy(self.turns, memo)}
        return prompt, {**prompt.meta, **turns, **own_kwargs(rf.kwargs, memo)}

    def key(self) -> str:
        """What a reward can depend on: the prompt (id, content, meta), the completion
        and an episode's turns."""
        prompt = self.prompt
        body = json.dumps(
            [prompt.id, prompt.text, prompt.messages, prompt.meta, self.completion, self.turns],
            sort_keys=True, default=repr, ensure_ascii=False,
        )
        return hashlib.blake2b(body.encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class Outcome:
    """One sample's result from one function: a value, or an error message (a drop is an
    error with ``dropped``). ``seconds``: this sample's share of the call's time."""

    value: float | None
    error: str | None
    seconds: float
    dropped: bool = False
    timed_out: bool = False

    def shared(self) -> "Outcome":
        """The outcome of a duplicate sample: same value or error, no time of its own."""
        return Outcome(self.value, self.error, 0.0, self.dropped, self.timed_out)


@dataclass(eq=False)
class Call:
    """``rf`` on ``samples`` (one sample; several for a batched function). An executor
    sets ``started`` when the call begins running (not when it was queued): its timeout
    counts from there."""

    rf: RewardFn
    samples: list[Sample]
    started: float | None = None

    def begin(self) -> None:
        """Mark the call as running from now."""
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        """Seconds since the call began running (0 if it never did)."""
        return 0.0 if self.started is None else time.perf_counter() - self.started

    def run(self) -> list[Outcome]:
        """Make the call here, now (in a thread of an executor)."""
        self.begin()
        if self.rf.batched:
            return call_batch(self.rf, [s.prompt for s in self.samples], [s.completion for s in self.samples])
        return [call_one(self.rf, self.samples[0])]

    async def run_async(self) -> list[Outcome]:
        """Make the call of an ``async def`` function (on an executor's event loop)."""
        if self.rf.batched:
            return await _call_async_batch(self.rf, [s.prompt for s in self.samples], [s.completion for s in self.samples])
        return await _call_async_one(self.rf, self.samples[0])

    def overdue(self, now: float) -> bool:
        """Running for longer than the function's timeout."""
        limit = self.rf.timeout_s
        return limit is not None and self.started is not None and now - self.started > limit

    def timed_out(self) -> list[Outcome]:
        """The outcomes of a call cut at its timeout: an error, charged the whole limit."""
        limit = self.rf.timeout_s
        what = "batched call" if self.rf.batched else "call"
        message = f"{self.rf.name}: timed out ({what} took over {limit:g} s)"
        return [Outcome(None, message, limit, timed_out=True)] * len(self.samples)

    def failed(self, exc: BaseException) -> list[Outcome]:
        """The outcomes of a call whose wrapper itself failed (cancelled, crashed)."""
        return [error_outcome(self.rf, exc, 0.0)] * len(self.samples)


def overdue(calls: Iterable[Call]) -> list[Call]:
    """The calls of ``calls`` past their timeout now."""
    now = time.perf_counter()
    return [call for call in calls if call.overdue(now)]


def call_one(rf: RewardFn, sample: Sample) -> Outcome:
    """One call of one per-sample reward function; every failure becomes an error."""
    start = time.perf_counter()
    try:
        prompt, meta = sample.arguments(rf)
    except Exception as exc:  # an object in the data that cannot be copied
        return _uncopyable(rf, exc)
    try:
        value = rf.fn(prompt, sample.completion, **meta)
    except Exception as exc:  # user code: any failure is "no score", reported by name
        return error_outcome(rf, exc, time.perf_counter() - start)
    return checked(rf, value, time.perf_counter() - start)


async def _call_async_one(rf: RewardFn, sample: Sample) -> list[Outcome]:
    start = time.perf_counter()
    try:
        prompt, meta = sample.arguments(rf)
    except Exception as exc:
        return [_uncopyable(rf, exc)]
    try:
        value = await rf.fn(prompt, sample.completion, **meta)
    except Exception as exc:
        return [error_outcome(rf, exc, time.perf_counter() - start)]
    return [checked(rf, value, time.perf_counter() - start)]


def batch_arguments(rf: RewardFn, prompts: list[Prompt]) -> tuple[list[Prompt], dict[str, Any]]:
    """The prompts and kwargs of one batched call of ``rf``, copied like a per-sample
    call's (:meth:`Sample.arguments`); a prompt given twice is one copy given twice."""
    memo: dict[int, Any] = {}
    return [own_prompt(p, memo) for p in prompts], own_kwargs(rf.kwargs, memo)


def call_batch(rf: RewardFn, prompts: list[Prompt], texts: list[str]) -> list[Outcome]:
    start = time.perf_counter()
    try:
        own, kwargs = batch_arguments(rf, prompts)
    except Exception as exc:
        return [_uncopyable(rf, exc)] * len(prompts)
    try:
        values = rf.fn(own, texts, **kwargs)
    except Exception as exc:
        return [error_outcome(rf, exc, time.perf_counter() - start)] * len(prompts)
    return _batch_outcomes(rf, values, len(prompts), time.perf_counter() - start)


async def _call_async_batch(rf: RewardFn, prompts: list[Prompt], texts: list[str]) -> list[Outcome]:
    start = time.perf_counter()
    try:
        own, kwargs = batch_arguments(rf, prompts)
    except Exception as exc:
        return [_uncopyable(rf, exc)] * len(prompts)
    try:
        values = await rf.fn(own, texts, **kwargs)
    except Exception as exc:
        return [error_outcome(rf, exc, time.perf_counter() - start)] * len(prompts)
    return _batch_outcomes(rf, values, len(prompts), time.perf_counter() - start)


def _uncopyable(rf: RewardFn, exc: Exception) -> Outcome:
    """A sample whose data holds an object that cannot be copied for the call (every
    call gets its own copy; a worker process could not be sent it either)."""
    return Outcome(None, f"{rf.name}: cannot copy the sample's prompt, meta or kwargs for the call: "
                         f"{type(exc).__name__}: {_bounded(str(exc))}", 0.0)


def _batch_outcomes(rf: RewardFn, values: Any, n: int, seconds: float) -> list[Outcome]:
    """A batched function's result, checked: one entry per completion. Its time is
    shared out evenly, so per-function seconds add up to the call's."""
    kind = type_name(values)
    unordered = isinstance(values, (Mapping, str, bytes, AbstractSet))  # list() of these is not the scores
    try:
        values = None if unordered else list(values)
    except TypeError:
        values = None
    if values is None or len(values) != n:
        got = f"a {kind}, not a sequence," if values is None else f"{len(values)} values"
        error = Outcome(None, f"{rf.name}: returned {got} for {n} completions", seconds / max(n, 1))
        return [error] * n
    each = seconds / n
    return [
        error_outcome(rf, v, each) if isinstance(v, BaseException) else checked(rf, v, each)
        for v in values
    ]


def error_outcome(rf: RewardFn, exc: BaseException, seconds: float) -> Outcome:
    """An exception as an outcome: ``NAME: TYPE: MESSAGE`` (``NAME: dropped: REASON`` for
    a drop), the message whole up to :data:`_MAX_MESSAGE` characters."""
    if isinstance(exc, SampleDropped):
        return Outcome(None, f"{rf.name}: dropped: {_bounded(str(exc))}", seconds, dropped=True)
    return Outcome(None, f"{rf.name}: {type(exc).__name__}: {_bounded(str(exc))}", seconds)


def checked(rf: RewardFn, value: Any, seconds: float) -> Outcome:
    """A returned value as an outcome: a finite number is a score, anything else an error."""
    if value is None:
        return Outcome(None, f"{rf.name}: returned None", seconds)
    score = finite_reward(value)
    if score is None:
        return Outcome(
            None,
            f"{rf.name}: returned {type_name(value)} {_shown(value)} (expected {expected_reward(value)})",
            seconds,
        )
    return Outcome(score, None, seconds)


def finite_reward(value: Any) -> float | None:
    """``value`` as a float when it is a reward: a real number (numpy's included; a bool,
    Python's or numpy's, counts as 1.0 or 0.0; a str, a tensor or a list does not) that is
    finite in float32, the precision training reads rewards in; else None."""
    if not isinstance(value, numbers.Real) and not _is_numpy_bool(value):
        return None
    try:
        number = float(value)
    except (OverflowError, TypeError, ValueError):  # an int too large for a float
        return None
    return number if math.isfinite(number) and abs(number) <= _FLOAT32_MAX else None


def expected_reward(value: Any) -> str:
    """What a reward must be, for the error about ``value`` (which is not one): the range
    is named when ``value`` is a number past it."""
    try:
        beyond = isinstance(value, numbers.Real) and math.isfinite(float(value))
    except OverflowError:  # an int too large for a float
        beyond = True
    return "a finite number" + (" within float32's range, where training reads rewards: |r| <= 3.4e38" if beyond else "")


def type_name(value: Any) -> str:
    """The name of ``value``'s type for messages: numpy's types by their full name
    (``numpy.bool``, ``numpy.float64``: not to be taken for Python's ``bool``, ``float``)."""
    cls = type(value)
    return f"numpy.{cls.__name__}" if cls.__module__ == "numpy" else cls.__name__


def _is_numpy_bool(value: Any) -> bool:
    """Whether ``value`` is a numpy bool (not a ``numbers.Real``, unlike Python's). A
    value can only be one once numpy is imported, so this never imports it."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.bool_)


def _shown(value: Any) -> str:
    try:
        return _shorten(repr(value))
    except Exception:  # a repr that fails (an int past Python's digit limit, a broken class)
        return "(no repr)"


def _bounded(text: str) -> str:
    """``text`` whole when it has at most :data:`_MAX_MESSAGE` characters, else its start
    and how many characters were left out."""
    if len(text) <= _MAX_MESSAGE:
        return text
    return f"{text[:_MAX_MESSAGE]}... ({len(text) - _MAX_MESSAGE} more characters)"


def _shorten(text: str) -> str:
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."
