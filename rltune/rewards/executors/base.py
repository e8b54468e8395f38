"""The executor protocol, and what the future-based executors (threads, event loop)
share."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Protocol

from rltune.rewards.calls import Call, Outcome, overdue

Finished = tuple[Call, list[Outcome]]
"""A call handed back, with one outcome per sample it covered."""


class Executor(Protocol):
    def submit(self, call: Call) -> None:
        """Start ``call``, or queue it until a worker is free (its timeout counts from
        when it starts)."""

    def collect(self, wait_s: float) -> list[Finished]:
        """The calls that finished within ``wait_s`` seconds, and those past their
        timeout (cut short: their outcomes are the timeout error)."""

    def close(self) -> None:
        """Stop the workers (idempotent); calls still running are abandoned."""


def collect_futures(running: dict[Future, Call], wait_s: float, cut: Callable[[Future], None]) -> list[Finished]:
    """For an executor whose calls are futures (``running``, removed from as they are
    handed back): those done within ``wait_s``, then those past their timeout, each of
    which ``cut`` stops as it can."""
    finished: list[Finished] = []
    if running:
        done, _ = wait(list(running), timeout=wait_s, return_when=FIRST_COMPLETED)
        for future in done:
            call = running.pop(future)
            finished.append((call, _result(future, call)))
    late = set(overdue(running.values()))
    for future, call in list(running.items()):
        if call in late:
            del running[future]
            finished.append((call, call.timed_out()))
            cut(future)
    return finished


def _result(future: Future, call: Call) -> list[Outcome]:
    try:
        return future.result()
    except BaseException as exc:  # a cancelled or crashed wrapper: still an error, not a raise
        return call.failed(exc)
