"""Calls in a pool of daemon threads: right for functions that wait (HTTP, subprocesses
such as the code sandbox) or release the GIL.

A call past its timeout is abandoned: it is scored as an error at once and its thread is
left to finish on its own (Python cannot stop a thread), while a new thread takes its
place, so the pool keeps its width. The threads are daemons: a call that never returns
does not keep the process from exiting.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from rltune.rewards.calls import Call
from rltune.rewards.executors.base import Finished, collect_futures


class ThreadExecutor:
    """The :class:`~rltune.rewards.executors.base.Executor` over ``width`` daemon threads."""

    def __init__(self, width: int) -> None:
        self._threads: DaemonThreads | None = DaemonThreads(width)
        self._running: dict[Future, Call] = {}

    def submit(self, call: Call) -> None:
        if self._threads is None:
            raise RuntimeError("the reward thread pool is closed")
        self._running[self._threads.submit(call.run)] = call

    def collect(self, wait_s: float) -> list[Finished]:
        return collect_futures(self._running, wait_s, self._replace)

    def _replace(self, future: Future) -> None:
        """A call was cut short: its thread is still in it, so start one in its place."""
        if self._threads is not None:
            self._threads.replace_one()

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown()
            self._threads = None
        self._running = {}


class DaemonThreads:
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
