"""Per-sample reward functions in worker processes: right for CPU-bound Python (symbolic
maths).

Each of ``width`` workers loads the functions once, from their spec (or unpickled by
reference when built in code). A call goes to a worker once that worker is ready (its
start-up does not count against the call's timeout); a call past its timeout has its
worker killed and replaced, and a worker that dies (a segfault, ``os._exit``) is an error
for the sample it was on, never the end of the run.
"""

from __future__ import annotations

import multiprocessing
import pickle  # only to check a function can reach a worker process
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_connections
from typing import Any

from rltune.rewards.calls import Call, Outcome, RewardFn, call_one, overdue
from rltune.rewards.executors.base import Finished
from rltune.rewards.loading import load_reward_fn


class ProcessExecutor:
    """The :class:`~rltune.rewards.executors.base.Executor` over ``width`` worker
    processes that run ``reward_fns`` (per-sample functions only)."""

    def __init__(self, reward_fns: Sequence[RewardFn], width: int) -> None:
        self.context = multiprocessing.get_context("spawn")
        self.recipes = [_recipe(rf) for rf in reward_fns]
        self.idle: list[_Worker] = []
        self.starting: dict[Connection, _Worker] = {}
        self.busy: dict[Connection, _Worker] = {}
        self.queue: list[Call] = []
        self.failed: list[Finished] = []
        self.broken: str | None = None
        """Why no worker can ever take a call (the functions do not load in one)."""
        for _ in range(width):
            self._spawn()

    def submit(self, call: Call) -> None:
        self.queue.append(call)
        self._dispatch()

    def collect(self, wait_s: float) -> list[Finished]:
        finished = self._poll(wait_s)
        late = set(overdue(worker.call for worker in self.busy.values()))
        for conn, worker in list(self.busy.items()):
            if worker.call in late:
                del self.busy[conn]
                finished.append((worker.call, worker.call.timed_out()))
                self._replace(worker)
        self._dispatch()
        finished += self.failed
        self.failed = []
        return finished

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

    # -- workers --------------------------------------------------------------------------

    def _spawn(self) -> None:
        parent, child = self.context.Pipe()
        process = self.context.Process(
            target=_worker_main, args=(child, self.recipes), name="reward-worker", daemon=True
        )
        process.start()
        child.close()
        self.starting[parent] = _Worker(process, parent)

    def _dispatch(self) -> None:
        """Hand queued calls to idle workers (or fail them all, when no worker can start)."""
        if self.broken is not None:
            self.failed += [(call, [Outcome(None, f"{call.rf.name}: {self.broken}", 0.0)]) for call in self.queue]
            self.queue = []
        while self.queue and self.idle:
            call = self.queue.pop(0)
            worker = self.idle.pop()
            worker.call = call
            try:
                worker.conn.send((call.rf.name, call.samples[0]))
            except (OSError, ValueError) as exc:  # a dead pipe, or an unpicklable prompt
                message = f"{call.rf.name}: could not hand the call to a reward worker: {exc}"
                self.failed.append((call, [Outcome(None, message, 0.0)]))
                self._replace(worker)
                continue
            call.begin()
            self.busy[worker.conn] = worker

    def _poll(self, wait_s: float) -> list[Finished]:
        """Calls answered (or whose worker died) within ``wait_s``; workers that became
        ready join the idle ones."""
        finished: list[Finished] = []
        watched = [*self.busy, *self.starting]
        for conn in wait_connections(watched, timeout=wait_s) if watched else []:
            if conn in self.starting:
                self._started(self.starting.pop(conn))
                continue
            worker = self.busy.pop(conn)
            call = worker.call
            try:
                outcome = conn.recv()
            except (EOFError, OSError):
                worker.process.join(timeout=1.0)
                code = worker.process.exitcode
                message = f"{call.rf.name}: the reward worker process died (exit code {code})"
                outcome = Outcome(None, message, call.elapsed())
                self._replace(worker)
            else:
                worker.call = None
                self.idle.append(worker)
            finished.append((call, [outcome]))
        return finished

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

    def _replace(self, worker: "_Worker") -> None:
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(timeout=5.0)
        worker.conn.close()
        self._spawn()


@dataclass(eq=False)
class _Worker:
    process: Any
    conn: Connection
    call: Call | None = None


def _recipe(rf: RewardFn) -> tuple[str, str | None, str | None, Any, Mapping[str, Any], float | None]:
    """What a worker needs to rebuild ``rf``: its spec when it has one (loaded in the
    worker), else the function itself (pickled by reference: a module-level function)."""
    return (rf.name, rf.spec, rf.base_dir, None if rf.spec else rf.fn, dict(rf.kwargs), rf.timeout_s)


def check_shippable(reward_fns: Sequence[RewardFn]) -> None:
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
        conn.send(call_one(fns[name], sample))
