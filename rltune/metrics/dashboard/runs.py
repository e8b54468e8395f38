"""Runs on disk as the dashboard sees them: :class:`RunIndex` finds run directories
under the paths the dashboard was given and looks again on every listing, so a run
started after the dashboard shows up; each :class:`Run` reads its files incrementally
(:mod:`rltune.metrics.jsonl`)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rltune.metrics.dashboard.errors import DashboardError
from rltune.metrics.jsonl import JsonlLog, JsonlTail, last_step

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
CONFIG_FILE = "config.yaml"
RUN_MARKERS = (METRICS_FILE, CONFIG_FILE)
"""A directory holding either of these is a run directory."""

CONFIG_MAX_BYTES = 1 << 20


def is_run_dir(path: Path) -> bool:
    """A run directory holds ``metrics.jsonl`` or ``config.yaml``."""
    return path.is_dir() and any((path / marker).is_file() for marker in RUN_MARKERS)


@dataclass
class Run:
    """One run directory and its open readers."""

    id: str
    path: Path
    metrics: JsonlLog
    samples: JsonlTail
    _step_cache: tuple[tuple[int, int, int], int | None] | None = field(default=None, repr=False)

    def summary(self, now: float, live_window_s: float) -> dict[str, Any]:
        """The run as listed by ``/api/runs``."""
        files = {name: self.path / name for name in (METRICS_FILE, SAMPLES_FILE, CONFIG_FILE)}
        stats = {name: _stat(path) for name, path in files.items()}
        times = [stat.st_mtime for stat in stats.values() if stat is not None]
        last_write = max(times) if times else None
        return {
            "id": self.id,
            "name": self.path.name,
            "path": str(self.path),
            "last_step": self._last_step(stats[METRICS_FILE]),
            "last_write": last_write,
            "live": last_write is not None and now - last_write <= live_window_s,
            "files": {name.split(".")[0]: stat is not None for name, stat in stats.items()},
        }

    def _last_step(self, stat: os.stat_result | None) -> int | None:
        """Cached on the metrics file's identity, size and modification time, so an
        unchanged file is not read again."""
        if stat is None:
            return None
        key = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if self._step_cache is None or self._step_cache[0] != key:
            self._step_cache = (key, last_step(self.path / METRICS_FILE))
        return self._step_cache[1]

    def config_text(self) -> str | None:
        """``config.yaml`` as text; None if the run has none (yet)."""
        path = self.path / CONFIG_FILE
        try:
            with path.open("rb") as handle:
                data = handle.read(CONFIG_MAX_BYTES + 1)
        except FileNotFoundError:
            return None
        if len(data) > CONFIG_MAX_BYTES:
            raise DashboardError(f"{path} is larger than {CONFIG_MAX_BYTES} bytes; not shown")
        return data.decode("utf-8", errors="replace")


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except FileNotFoundError:
        return None


@dataclass(frozen=True)
class Root:
    """A path the dashboard was given: a run directory, or a folder of them."""

    path: Path
    runs: int


class RunIndex:
    """The run directories under the given paths, found again on every :meth:`scan`.

    Each path must exist and be a directory: either a run directory itself or a folder
    whose subdirectories are run directories (like ``runs/``). A folder with no run yet
    is accepted (a dashboard may be started before the first run); what it holds is
    looked at again on each scan. Every run gets an id, its directory's name, made
    unique with its parent's name and then a number if needed; an id never changes
    while the index lives."""

    def __init__(self, paths: Sequence[Path], *, max_samples: int = 5000,
                 live_window_s: float = 60.0) -> None:
        if not paths:
            raise DashboardError("no run directory given; name a run directory or a folder of runs (like runs/)")
        if max_samples < 1:
            raise DashboardError(f"max_samples must be at least 1 (got {max_samples})")
        self.paths = [_checked_root(Path(path)) for path in paths]
        self.max_samples = max_samples
        self.live_window_s = live_window_s
        self._lock = threading.Lock()
        self._runs: dict[Path, Run] = {}
        self._by_id: dict[str, Run] = {}
        self.scan()

    def scan(self) -> list[Run]:
        """Look for run directories again; the runs in the order first found."""
        with self._lock:
            for root in self.paths:
                for path in _run_dirs(root):
                    if path.resolve() not in self._runs:
                        self._add(path)
            return list(self._runs.values())

    def roots(self, runs: Sequence[Run] | None = None) -> list[Root]:
        """Each given path and how many of ``runs`` (default: a new scan) it holds."""
        runs = self.scan() if runs is None else runs
        return [Root(root, sum(1 for run in runs if _within(run.path, root))) for root in self.paths]

    def get(self, run_id: str) -> Run:
        """The run with this id, looking again if it is not known yet."""
        if run_id not in self._by_id:
            self.scan()
        try:
            return self._by_id[run_id]
        except KeyError:
            known = ", ".join(sorted(self._by_id)) or "none yet"
            raise KeyError(f"no run {run_id!r} (known runs: {known})") from None

    def summaries(self) -> dict[str, Any]:
        """The body of ``/api/runs``."""
        now = time.time()
        runs = self.scan()
        return {
            "now": now,
            "live_window_s": self.live_window_s,
            "sample_cap": self.max_samples,
            "roots": [{"path": str(root.path), "runs": root.runs} for root in self.roots(runs)],
            "runs": [run.summary(now, self.live_window_s) for run in runs],
        }

    def _add(self, path: Path) -> None:
        run_id = self._unique_id(path)
        run = Run(
            id=run_id,
            path=path,
            metrics=JsonlLog(path / METRICS_FILE),
            samples=JsonlTail(path / SAMPLES_FILE, max_rows=self.max_samples),
        )
        self._runs[path.resolve()] = run
        self._by_id[run_id] = run

    def _unique_id(self, path: Path) -> str:
        candidates = [path.name, f"{path.parent.name}/{path.name}"]
        for candidate in candidates:
            if candidate and candidate not in self._by_id:
                return candidate
        number = 2
        while f"{candidates[1]}-{number}" in self._by_id:
            number += 1
        return f"{candidates[1]}-{number}"


def _checked_root(path: Path) -> Path:
    if not path.exists():
        raise DashboardError(
            f"{path} does not exist; give a run directory (with {METRICS_FILE} or {CONFIG_FILE}) "
            "or a folder of runs (like runs/)")
    if not path.is_dir():
        raise DashboardError(
            f"{path} is a file, not a directory; give a run directory (with {METRICS_FILE} or "
            f"{CONFIG_FILE}) or a folder of runs (like runs/)")
    return path.absolute()


def _run_dirs(root: Path) -> Iterable[Path]:
    """The root itself if it is a run directory, else its subdirectories that are."""
    if is_run_dir(root):
        return [root]
    try:
        children = sorted(root.iterdir())
    except FileNotFoundError:  # removed while the dashboard runs
        return []
    return [child for child in children if not child.name.startswith(".") and is_run_dir(child)]


def _within(path: Path, root: Path) -> bool:
    return path == root or path.parent == root
