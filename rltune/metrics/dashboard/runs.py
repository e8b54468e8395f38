"""Runs on disk as the dashboard sees them: :class:`RunIndex` finds run directories
under the paths the dashboard was given and looks again on every listing, so a run
started after the dashboard shows up (and one deleted since is no longer listed); each
:class:`Run` reads its files incrementally (:mod:`rltune.metrics.dashboard.readers`),
only regular files that resolve inside its directory. A file that cannot be read is that
run's error, named in its listing; it never stops the other runs from being served."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rltune.metrics.dashboard.errors import DashboardError
from rltune.metrics.dashboard.readers import JsonlLog, JsonlTail, last_step
from rltune.metrics.jsonl import RunFileError, open_file

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
CONFIG_FILE = "config.yaml"
RUN_FILES = (METRICS_FILE, SAMPLES_FILE, CONFIG_FILE)
RUN_MARKERS = (METRICS_FILE, CONFIG_FILE)
"""A directory holding either of these is a run directory."""

CONFIG_MAX_BYTES = 1 << 20


def is_run_dir(path: Path) -> bool:
    """A run directory holds ``metrics.jsonl`` or ``config.yaml`` (an :class:`OSError`
    if the folder cannot be looked into)."""
    return path.is_dir() and any((path / marker).is_file() for marker in RUN_MARKERS)


def shown(text: str) -> str:
    """A file name as text that any page can hold: bytes that are not UTF-8 (kept by
    Python as lone surrogates) are written as ``\\xNN``."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


@dataclass
class Run:
    """One run directory and its open readers."""

    id: str
    path: Path
    metrics: JsonlLog
    samples: JsonlTail
    _step_cache: tuple[tuple[int, int, int], int | None] | None = field(default=None, repr=False)

    def summary(self, now: float, live_window_s: float) -> dict[str, Any]:
        """The run as listed by ``/api/runs``: ``files`` tells which files can be read,
        ``errors`` names each one that exists but cannot be (``FILE: why``)."""
        stats: dict[str, os.stat_result | None] = {}
        errors: list[str] = []
        for name in RUN_FILES:
            stats[name], error = self._check(name)
            errors += [error] if error else []
        last, error = self._last_step(stats[METRICS_FILE])
        errors += [error] if error else []
        times = [stat.st_mtime for stat in stats.values() if stat is not None]
        last_write = max(times) if times else None
        return {
            "id": self.id,
            "name": shown(self.path.name),
            "path": shown(str(self.path)),
            "last_step": last,
            "last_write": last_write,
            "live": last_write is not None and now - last_write <= live_window_s,
            "files": {name.split(".")[0]: stat is not None for name, stat in stats.items()},
            "errors": errors,
        }

    def _check(self, name: str) -> tuple[os.stat_result | None, str | None]:
        """``(stat, None)`` for a file of the run that can be read, ``(None, None)`` for a
        missing one, ``(None, "FILE: why")`` for one that cannot be read."""
        try:
            with open_file(self.path / name, within=self.path) as handle:
                return os.fstat(handle.fileno()), None
        except FileNotFoundError:
            return None, None
        except RunFileError as err:
            return None, f"{name}: {err.reason}"
        except OSError as err:  # the run directory itself cannot be looked into
            return None, f"{name}: cannot be read ({err.strerror or err})"

    def _last_step(self, stat: os.stat_result | None) -> tuple[int | None, str | None]:
        """``(step, error)``, cached on the metrics file's identity, size and modification
        time, so an unchanged file is not read again."""
        if stat is None:
            return None, None
        key = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if self._step_cache is None or self._step_cache[0] != key:
            try:
                self._step_cache = (key, last_step(self.path / METRICS_FILE, within=self.path))
            except RunFileError as err:  # changed since it was checked
                return None, f"{METRICS_FILE}: {err.reason}"
        return self._step_cache[1], None

    def config_text(self) -> str | None:
        """``config.yaml`` as text (bytes that are not UTF-8 shown as U+FFFD); None if the
        run has none (yet). A :class:`RunFileError` if it cannot be read."""
        path = self.path / CONFIG_FILE
        try:
            with open_file(path, within=self.path) as handle:
                data = handle.read(CONFIG_MAX_BYTES + 1)
        except FileNotFoundError:
            return None
        if len(data) > CONFIG_MAX_BYTES:
            raise DashboardError(f"{CONFIG_FILE} is larger than {CONFIG_MAX_BYTES} bytes; not shown")
        return data.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Root:
    """A path the dashboard was given: a run directory, or a folder of them; how many
    run directories were found there, and what could not be looked into, if anything."""

    path: Path
    runs: int
    error: str | None = None


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
        self._roots: list[Root] = []
        self.scan()

    def scan(self) -> list[Run]:
        """Look for run directories again; the runs found, in the order first found. A
        run that is no longer there is not listed, but keeps its id if it comes back."""
        with self._lock:
            found: set[Path] = set()
            roots = []
            for root in self.paths:
                paths, error = _run_dirs(root)
                keys = {_key(path) for path in paths}
                for path in paths:
                    if _key(path) not in self._runs:
                        self._add(path)
                found |= keys
                roots.append(Root(root, len(keys), error))
            self._roots = roots
            return [run for key, run in self._runs.items() if key in found]

    def roots(self) -> list[Root]:
        """Each given path, as the last :meth:`scan` found it (a run reached from two of
        them is counted in both)."""
        return list(self._roots)

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
            "roots": [{"path": shown(str(root.path)), "runs": root.runs, "error": root.error}
                      for root in self.roots()],
            "runs": [run.summary(now, self.live_window_s) for run in runs],
        }

    def _add(self, path: Path) -> None:
        run_id = self._unique_id(path)
        run = Run(
            id=run_id,
            path=path,
            metrics=JsonlLog(path / METRICS_FILE, within=path, steps=True),
            samples=JsonlTail(path / SAMPLES_FILE, max_rows=self.max_samples, within=path, steps=True),
        )
        self._runs[_key(path)] = run
        self._by_id[run_id] = run

    def _unique_id(self, path: Path) -> str:
        """The directory's name (as :func:`shown`, so an id is always valid text), or
        with its parent's name, or that and a number."""
        candidates = [shown(path.name), shown(f"{path.parent.name}/{path.name}")]
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


def _run_dirs(root: Path) -> tuple[list[Path], str | None]:
    """The root itself if it is a run directory, else its subdirectories that are; and
    what could not be looked into (the root removed or replaced by a file while the
    dashboard runs, a folder without permission), or None."""
    try:
        if is_run_dir(root):
            return [root], None
        children = sorted(root.iterdir())
    except FileNotFoundError:
        return [], f"{shown(str(root))} does not exist any more"
    except NotADirectoryError:
        return [], f"{shown(str(root))} is not a directory any more"
    except OSError as err:
        return [], f"{shown(str(root))} cannot be read ({err.strerror or err})"
    runs, unreadable = [], []
    for child in children:
        try:
            if not child.name.startswith(".") and is_run_dir(child):
                runs.append(child)
        except OSError as err:
            unreadable.append(f"{shown(child.name)} ({err.strerror or err})")
    return runs, f"cannot look into {', '.join(unreadable)}" if unreadable else None


def _key(path: Path) -> Path:
    """What tells two run directories apart: the real path (a link to a run is that run)."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):  # a loop of links: not a run directory anyway
        return path.absolute()
