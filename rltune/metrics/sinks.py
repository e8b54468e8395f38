"""Where metrics and samples go: JSON lines files and the console progress bar."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class JsonlWriter:
    """Appends one JSON object per line, flushed per write so a crash loses nothing
    already logged. Non-finite floats are written as null (strict JSON)."""

    def __init__(self, path: Path, *, resume_after_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_after_step is None:
            self.path.write_text("")
        else:
            truncate_after_step(self.path, resume_after_step)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(_finite(record), ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def truncate_after_step(path: Path, step: int) -> None:
    """Drop lines whose ``step`` is greater than ``step`` (written after the checkpoint a
    run resumes from), so a resumed run's files read as if it had never stopped."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            record_step = json.loads(line).get("step", 0)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if record_step <= step:
            kept.append(line)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


class ConsoleProgress:
    """A progress bar with step, reward, KL, seconds per step and ETA."""

    def __init__(self, total: int, *, start: int = 0, enabled: bool = True, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.enabled = enabled
        self._progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(bar_width=24),
            TextColumn("{task.fields[stats]}"),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not enabled,
        )
        self._task = self._progress.add_task("train", total=total, completed=start, stats="")

    def __enter__(self) -> "ConsoleProgress":
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def update(self, step: int, metrics: dict[str, float]) -> None:
        self._progress.update(self._task, completed=step, stats=format_stats(metrics))

    def print(self, message: str) -> None:
        self.console.print(message)


def format_stats(metrics: dict[str, float]) -> str:
    """``reward 0.512  kl 0.0031  1.20 s/step``; a metric that is absent shows as ``-``."""
    parts = []
    for label, key, fmt in (
        ("reward", "reward/mean", "{:.3f}"),
        ("kl", "kl", "{:.4f}"),
        ("loss", "loss", "{:.4f}"),
    ):
        value = metrics.get(key)
        parts.append(f"{label} {fmt.format(value) if value is not None and math.isfinite(value) else '-'}")
    seconds = metrics.get("time/step")
    parts.append(f"{seconds:.2f} s/step" if seconds is not None else "- s/step")
    return "  ".join(parts)
