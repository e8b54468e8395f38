"""Starting a learner group on this machine without a launcher: ``world_size`` fresh
processes that join one torch.distributed group on 127.0.0.1 and each run a function.

``torchrun`` does the same from the command line; the Ray runtime starts its ranks as
actors (``rltune/runtime/ray/learner.py``). Both end in
:func:`rltune.learner.distributed.init_group`.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing
from torch.multiprocessing.spawn import ProcessException

from rltune.learner.distributed import destroy_group, init_group, loopback_interface


def spawn_learner_group(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    backend: str | None = None,
    timeout_s: float = 300.0,
) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` fresh processes forming one process group on
    127.0.0.1 (no launcher, no Ray); returns each rank's return value, in rank order.

    Each process gets ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` and
    ``LOCAL_RANK`` and joins with :func:`init_group` (``backend`` None: its default)
    before ``fn`` runs, and leaves after. ``fn`` must be importable by name (a module's
    top-level function), its arguments picklable and its return value made of tensors,
    numbers, strings and lists/tuples/dicts of them (read back with
    ``torch.load(weights_only=True)``: no pickle of arbitrary objects). A rank that
    raises fails the whole group: the others are stopped and a ``RuntimeError`` shows
    the tracebacks, the first rank to fail first (the others usually fail because of
    it). A group still running after ``timeout_s`` seconds is stopped with a
    ``TimeoutError``."""
    if world_size < 1:
        raise ValueError(f"spawn_learner_group: world_size={world_size} must be >= 1")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="rltune-group-") as out_dir:
        context = torch.multiprocessing.start_processes(
            _group_worker, args=(world_size, port, backend, out_dir, fn, args),
            nprocs=world_size, join=False, start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    _stop(context.processes)
                    raise TimeoutError(f"spawn_learner_group: {fn.__name__} on {world_size} ranks still ran "
                                       f"after {timeout_s} s; stopped")
        except ProcessException as err:
            _stop(context.processes)
            raise RuntimeError(_failure_report(Path(out_dir), fn, err)) from None
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=True) for r in range(world_size)]


def _group_worker(rank: int, world: int, port: int, backend: str | None, out_dir: str,
                  fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    loopback = loopback_interface()
    if loopback is not None:  # gloo's connections between the ranks, too, stay on this machine
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    try:
        init_group(backend)
        result = fn(*args)
    except BaseException:
        # written before this rank leaves the group, so before the others notice
        (Path(out_dir) / f"rank{rank}.error").write_text(f"{time.time()}\n{traceback.format_exc()}")
        raise
    finally:
        destroy_group()
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def _failure_report(out_dir: Path, fn: Callable[..., Any], err: ProcessException) -> str:
    """The failed ranks' tracebacks, earliest failure first."""
    failures = []
    for path in out_dir.glob("rank*.error"):
        written, _, trace = path.read_text().partition("\n")
        failures.append((float(written), int(path.stem.removeprefix("rank")), trace))
    if not failures:  # killed without a Python exception (a signal, a crash in C++)
        return f"spawn_learner_group: {fn.__name__} failed: {err}"
    failures.sort()
    parts = [f"rank {rank}:\n{trace}" for _, rank, trace in failures]
    return (f"spawn_learner_group: {fn.__name__} failed on rank(s) {[r for _, r, _ in failures]}, "
            f"rank {failures[0][1]} first\n\n" + "\n".join(parts))


def _stop(processes: list[Any]) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
        process.join()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


__all__ = ["spawn_learner_group"]
