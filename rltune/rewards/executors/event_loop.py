"""``async def`` reward functions, of either form, on one event loop in a thread of this
process, all at once; a call past its timeout has its coroutine cancelled."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future

from rltune.rewards.calls import Call
from rltune.rewards.executors.base import Finished, collect_futures


class AsyncExecutor:
    """The :class:`~rltune.rewards.executors.base.Executor` over one event loop, which
    starts every coroutine as it is submitted (so each call's timeout counts from then)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = asyncio.new_event_loop()
        threading.Thread(target=_run_loop, args=(self._loop,), name="reward-async", daemon=True).start()
        self._running: dict[Future, Call] = {}

    def submit(self, call: Call) -> None:
        if self._loop is None:
            raise RuntimeError("the reward event loop is closed")
        future = asyncio.run_coroutine_threadsafe(call.run_async(), self._loop)
        call.begin()
        self._running[future] = call

    def collect(self, wait_s: float) -> list[Finished]:
        return collect_futures(self._running, wait_s, Future.cancel)

    def close(self) -> None:
        """Cancel the coroutines still running (calls abandoned at their timeout) and stop
        the loop."""
        if self._loop is None:
            return
        loop, self._loop = self._loop, None
        self._running = {}
        try:
            asyncio.run_coroutine_threadsafe(_cancel_all(), loop).result(timeout=5.0)
        except Exception:  # noqa: BLE001 - a coroutine that ignores cancelling is left to the loop
            pass
        loop.call_soon_threadsafe(loop.stop)


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        loop.close()


async def _cancel_all() -> None:
    """Cancel the loop's other tasks and wait for them."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
