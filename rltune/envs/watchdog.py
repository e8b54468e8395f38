"""A word on the console when an environment's call does not return.

rltune does not interrupt ``make_env``, ``reset`` or ``step``: an environment may hold
state tied to the thread that made it (a sqlite connection, a browser driver), so its
calls run in the episode runner's own thread, where nothing can stop them. An environment
that waits on a remote service should give its calls a timeout of its own. So that such a
wait is not silent, :class:`CallWatch` logs a warning naming the call and the prompt when
one has run for :data:`FIRST_WARNING_S`, then again each time its wait doubles.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

FIRST_WARNING_S = 60.0
"""Seconds a call runs before the first warning (rewards' default ``timeout_s`` too)."""


class CallWatch:
    """Watches one call at a time (the runner makes them one after another) from a daemon
    thread started with the first call; ``first_s`` is when the first warning comes."""

    def __init__(self, first_s: float = FIRST_WARNING_S) -> None:
        self.first_s = first_s
        self._lock = threading.Lock()
        self._call: tuple[str, float] | None = None
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def watching(self, what: str) -> Iterator[None]:
        """Around one call; ``what`` names it (``env: step for prompt 'p7'``)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rltune-env-watch", daemon=True)
            self._thread.start()
        with self._lock:
            self._call = (what, time.monotonic())
        self._wake.set()
        try:
            yield
        finally:
            with self._lock:
                self._call = None

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                call = self._call
            if call is None:
                continue
            self._watch(*call)

    def _watch(self, what: str, started: float) -> None:
        """Warn at ``first_s``, ``2 * first_s``, ``4 * first_s``, ... while this call runs."""
        due = self.first_s
        while True:
            if self._wake.wait(max(0.0, started + due - time.monotonic())):
                return  # another call began (this one returned)
            with self._lock:
                if self._call != (what, started):
                    return
            log.warning("%s has not returned after %g s; rltune does not interrupt an environment's calls: "
                        "give them a timeout of their own (a request's timeout, a game's step limit)", what, due)
            due *= 2


__all__ = ["FIRST_WARNING_S", "CallWatch"]
