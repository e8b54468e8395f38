"""Where reward calls run: a thread pool, an event loop, worker processes, behind one
small protocol, and which of them a function's calls go to.

An :class:`Executor` takes calls (:meth:`~Executor.submit`) and hands each back exactly
once (:meth:`~Executor.collect`), with its outcomes: what the function gave, or a timeout
error once the call has run past its function's ``timeout_s``. Cutting a call short is the
executor's business, since only it knows how: a thread is abandoned and replaced, a
coroutine cancelled, a worker process killed and replaced. A scoring round submits its
calls to several executors at once and collects from each in turn, so that a round's
threaded, async and process calls run at the same time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from rltune.rewards.calls import RewardFn
from rltune.rewards.executors.base import Executor, Finished
from rltune.rewards.executors.event_loop import AsyncExecutor
from rltune.rewards.executors.processes import ProcessExecutor
from rltune.rewards.executors.threads import ThreadExecutor

__all__ = ["AsyncExecutor", "Executor", "Executors", "Finished", "ProcessExecutor", "ThreadExecutor"]


class Executors:
    """The executors of one scorer, each started on first need: ``async def`` functions
    run on the event loop; per-sample functions on worker processes when ``pool`` is
    ``"process"``; everything else (batched functions always) on the thread pool.
    ``width``: threads, and worker processes."""

    def __init__(self, reward_fns: Sequence[RewardFn], *, pool: Literal["thread", "process"], width: int) -> None:
        self.reward_fns = list(reward_fns)
        self.pool = pool
        self.width = width
        self._threads: Executor | None = None
        self._loop: Executor | None = None
        self._processes: Executor | None = None

    def for_fn(self, rf: RewardFn) -> Executor:
        """The executor ``rf``'s calls run on."""
        if rf.is_async:
            if self._loop is None:
                self._loop = AsyncExecutor()
            return self._loop
        if self.pool == "process" and not rf.batched:
            if self._processes is None:
                shipped = [f for f in self.reward_fns if not f.batched and not f.is_async]
                self._processes = ProcessExecutor(shipped, self.width)
            return self._processes
        if self._threads is None:
            self._threads = ThreadExecutor(self.width)
        return self._threads

    def close(self) -> None:
        """Close every executor started (idempotent)."""
        for executor in (self._threads, self._processes, self._loop):
            if executor is not None:
                executor.close()
        self._threads = self._loop = self._processes = None
