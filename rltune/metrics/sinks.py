"""Where metrics and samples go: JSON lines files, the console progress bar, and the
metric sinks (:class:`Sink`): TensorBoard here, Weights & Biases in
:mod:`rltune.metrics.wandb`, MLflow in :mod:`rltune.metrics.mlflow`.

Every sink skips non-finite values (nan, inf, and ``None``, which is how ``metrics.jsonl``
writes them): the trackers either reject them or draw them as gaps that hide the rest
of a chart, and ``metrics.jsonl`` already records that they happened."""

from __future__ import annotations

import math
import numbers
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from rltune.metrics import keys
from rltune.metrics.jsonl import BLANK, BadLine, json_line, parse_line


class JsonlWriter:
    """Appends one JSON object per line, flushed per write so a crash loses nothing
    already logged. Non-finite floats are written as null (strict JSON). Each line is
    encoded whole before any of it is written (:func:`json_line`), so a record that
    cannot be written leaves no partial line behind.

    ``resume_after_step=N`` keeps the file, cut back to step N (:func:`truncate_after_step`);
    a last line cut short by a crash is dropped then, with a warning on stderr, and
    :attr:`resume_note` says so (None otherwise)."""

    def __init__(self, path: Path, *, resume_after_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.resume_note: str | None = None
        if resume_after_step is None:
            self.path.write_text("")
        else:
            self.resume_note = truncate_after_step(self.path, resume_after_step)
            if self.resume_note is not None:
                print(f"warning: {self.resume_note}", file=sys.stderr)
        self._file = self.path.open("ab")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json_line(_finite(record)))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class ResumeError(ValueError):
    """A line of ``metrics.jsonl`` or ``samples.jsonl`` that a resumed run must cut back
    to its checkpoint's step cannot be read; the message names the file and line, and the
    file is left as it was."""


def truncate_after_step(path: Path, step: int, *, check_only: bool = False) -> str | None:
    """Drop lines whose ``step`` is greater than ``step`` (written after the checkpoint a
    run resumes from), so a resumed run's files read as if it had never stopped.

    The last line, when it has no newline and is not whole JSON (or not whole UTF-8), is
    the record a crash cut short: it is dropped too, and the note returned says so (None
    when nothing was dropped but later steps and blank lines). Any other line that is not
    a JSON object with an integer ``step`` is a :class:`ResumeError` naming the file and
    line; the file is then left as it was. The kept lines are copied byte for byte, into
    a new file that replaces the old one only when it is complete. ``check_only`` reads
    the file the same way and changes nothing (a resume checks every file before it cuts
    any)."""
    path = Path(path)
    if not path.exists():
        return None
    note = None
    tmp = Path(os.devnull) if check_only else path.with_suffix(path.suffix + ".tmp")
    try:
        # records end in "\n" alone (binary lines split there only): str.splitlines would
        # also cut a line at a U+2028, U+0085 or U+001C-1E inside a completion's text
        # (written unescaped), and drop both halves
        with path.open("rb") as lines, tmp.open("wb") as kept:
            for number, raw in enumerate(lines, start=1):
                try:
                    row = parse_line(raw)
                except BadLine as exc:
                    if not raw.endswith(b"\n") and not exc.complete:
                        note = (f"{path}:{number}: the last line was cut short when the run stopped "
                                f"and is dropped ({exc})")
                        continue
                    raise _resume_error(path, number, str(exc), step) from None
                if row is BLANK:
                    continue
                record_step = row.get("step")
                if isinstance(record_step, bool) or not isinstance(record_step, int):
                    raise _resume_error(path, number, f"'step' must be an integer, got {record_step!r:.80}", step)
                if record_step <= step:
                    kept.write(raw if raw.endswith(b"\n") else raw + b"\n")
    except BaseException:
        if not check_only:
            tmp.unlink(missing_ok=True)
        raise
    if not check_only:
        os.replace(tmp, path)
    return note


def _resume_error(path: Path, number: int, reason: str, step: int) -> ResumeError:
    return ResumeError(
        f"{path}:{number}: {reason}; cannot cut the file back to step {step} to resume, so it is left as it "
        "was: fix or delete that line (or move the file aside) and start the run again"
    )


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
        self.console = console or Console(stderr=True, emoji=False)  # user text: ":ok:" stays as written
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
    """``reward 0.512  kl 0.0031  1.20 s/step``; a metric that is absent shows as ``-``.
    A step with reward errors adds their count after the reward, ``errors 5`` (``errors 5
    (2 timed out)``); the first message of each kind is printed above the bar."""
    parts = []
    for label, key, fmt in (
        ("reward", keys.REWARD_MEAN, "{:.3f}"),
        ("kl", keys.KL, "{:.4f}"),
        ("loss", keys.LOSS, "{:.4f}"),
    ):
        value = metrics.get(key)
        parts.append(f"{label} {fmt.format(value) if value is not None and math.isfinite(value) else '-'}")
        if key == keys.REWARD_MEAN and metrics.get(keys.REWARD_ERRORS):
            timeouts = metrics.get(keys.REWARD_TIMEOUTS)
            parts.append(f"errors {metrics[keys.REWARD_ERRORS]:.0f}" + (
                f" ({timeouts:.0f} timed out)" if timeouts else ""))
    seconds = metrics.get(keys.TIME_STEP)
    parts.append(f"{seconds:.2f} s/step" if seconds is not None else "- s/step")
    return "  ".join(parts)


# --------------------------------------------------------------------------- metric sinks


@runtime_checkable
class Sink(Protocol):
    """A destination for a run's metrics and its resolved config.

    ``log`` is called once per step (and once more at a step with the evaluation
    metrics), with increasing steps; non-finite scalars and histogram values are skipped,
    never an error. ``log_config`` gets the resolved config as a nested dict. ``close``
    flushes and ends the run; calling it twice is harmless."""

    def log(
        self, step: int, scalars: Mapping[str, float], histograms: Mapping[str, Sequence[float]] | None = None
    ) -> None: ...

    def log_config(self, config: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def finite_scalars(scalars: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of ``scalars`` as floats; nan, inf and ``None`` are dropped.
    Anything else (a string, a list) is a ``TypeError`` naming the metric, since it means
    a histogram or a label was passed where a number belongs."""
    out: dict[str, float] = {}
    for name, value in scalars.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"metric {name!r}: a scalar must be a real number or None, got {type(value).__name__} "
                            f"{value!r:.80}")
        number = float(value)
        if math.isfinite(number):
            out[name] = number
    return out


def finite_values(values: Sequence[Any]) -> list[float]:
    """The finite numbers of one histogram's ``values`` as floats (``None`` and non-finite
    values dropped)."""
    return [v for v in (float(x) for x in values if x is not None) if math.isfinite(v)]


def finite_histograms(histograms: Mapping[str, Sequence[Any]] | None) -> dict[str, list[float]]:
    """``histograms`` with non-finite values dropped, and any left empty dropped too."""
    out: dict[str, list[float]] = {}
    for name, values in (histograms or {}).items():
        kept = finite_values(values)
        if kept:
            out[name] = kept
    return out


def plain_config(value: Any) -> Any:
    """``value`` as plain YAML/JSON data: mappings become dicts, lists and tuples lists,
    and anything else that is not a str, number, bool or None its ``str()`` (a path, an
    enum), so every tracker can store it."""
    if isinstance(value, Mapping):
        return {str(k): plain_config(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_config(v) for v in value]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    return str(value)


def config_yaml(config: Mapping[str, Any]) -> str:
    """``config`` as YAML, keys in their given order."""
    return yaml.safe_dump(plain_config(config), sort_keys=False, allow_unicode=True)


def check_resume_step(resume_after_step: int | None, where: str) -> None:
    """A ``ValueError`` naming ``where`` unless ``resume_after_step`` is None or a step >= 0."""
    if resume_after_step is None:
        return
    if isinstance(resume_after_step, bool) or not isinstance(resume_after_step, int) or resume_after_step < 0:
        raise ValueError(f"{where}: resume_after_step must be a step >= 0 or None, got {resume_after_step!r}")


class TensorBoardSink:
    """Writes TensorBoard event files into ``log_dir``: scalars as scalar summaries,
    histograms as histogram summaries, the config as a text summary (YAML in a code
    block) under the tag ``config``.

    ``resume_after_step=N`` continues a run from its checkpoint at step N: the new event
    file starts with a purge marker at step N + 1, so TensorBoard discards whatever the
    interrupted run had logged after the checkpoint. Non-finite values are skipped.
    Events are flushed after every call, so a live TensorBoard sees each step."""

    CONFIG_TAG = "config"

    def __init__(self, log_dir: Path, *, resume_after_step: int | None = None) -> None:
        check_resume_step(resume_after_step, "TensorBoardSink")
        try:
            import numpy
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(
                f"TensorBoardSink needs the tensorboard package ({exc}); install it with "
                "pip install 'rltune[tensorboard]'"
            ) from exc
        self._np = numpy
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        purge_step = None if resume_after_step is None else resume_after_step + 1
        self._config_step = resume_after_step or 0
        self._writer: Any = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)

    def log(
        self, step: int, scalars: Mapping[str, float], histograms: Mapping[str, Sequence[float]] | None = None
    ) -> None:
        """One scalar summary per finite scalar and one histogram per non-empty histogram
        (its finite values), all at ``step``."""
        for name, value in finite_scalars(scalars).items():
            self._writer.add_scalar(name, value, step)
        for name, values in finite_histograms(histograms).items():
            self._writer.add_histogram(name, self._np.asarray(values, dtype=self._np.float64), step)
        self._writer.flush()

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The config as a YAML code block, at step 0 (at the resume step when resuming,
        so the config each start ran with is kept)."""
        text = f"```yaml\n{config_yaml(config)}```"
        self._writer.add_text(self.CONFIG_TAG, text, self._config_step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
