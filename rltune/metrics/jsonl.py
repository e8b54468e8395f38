"""JSON-lines files that a training run appends to (``metrics.jsonl``, ``samples.jsonl``):
the one place they are written and parsed, for the dashboard, the report and the CLI.

Every line is written the same way (:func:`json_line`: UTF-8, a lone surrogate as its
JSON escape), and every reader turns a line into a row the same way (:func:`parse_line`):
a JSON object, ``NaN``/``Infinity`` as ``null``, blank lines skipped, a byte-order mark
ignored. :class:`JsonlReader` reads a whole file once, in order, with line numbers (the
report, the CLI); the dashboard reads incrementally
(:mod:`rltune.metrics.dashboard.readers`).

Every reader opens its file with :func:`open_file`: only a regular file is read (a
directory, a FIFO or a device is a :class:`RunFileError`, and a FIFO is never waited on),
and, given the run directory, only a file that resolves inside it.
"""

from __future__ import annotations

import json
import os
import stat as stat_mode
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

BOM = b"\xef\xbb\xbf"
"""A UTF-8 byte-order mark, as some editors write at the start of a file; ignored."""


class RunFileError(ValueError):
    """A file of a run exists but is not read: not a regular file (a directory, a FIFO, a
    device), no permission, or a link that leads out of the run directory (``outside``).
    ``reason`` says which in a few words; the message is ``PATH: reason``."""

    def __init__(self, path: Path, reason: str, *, outside: bool = False) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason, self.outside = Path(path), reason, outside


def open_file(path: Path, *, within: Path | None = None) -> BinaryIO:
    """``path`` opened for reading (binary). :class:`FileNotFoundError` if it does not
    exist; :class:`RunFileError` if it is not a regular file (opened without blocking, so
    a FIFO never stalls the caller), cannot be opened, or, with ``within`` (a run
    directory), resolves to a file outside ``within``, as a link may."""
    path = Path(path)
    target, flags = path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)
    if within is not None:
        try:
            target = path.resolve(strict=True)
        except FileNotFoundError:
            raise
        except (OSError, RuntimeError) as err:  # a loop of links
            raise RunFileError(path, f"cannot be read ({getattr(err, 'strerror', None) or err})") from None
        if not target.is_relative_to(Path(within).resolve()):
            raise RunFileError(path, "is a link to a file outside the run directory; not read", outside=True)
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(target, flags)
    except FileNotFoundError:
        raise
    except OSError as err:
        raise RunFileError(path, f"cannot be read ({err.strerror or err})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat_mode.S_ISREG(mode):
            raise RunFileError(path, f"is {_kind(mode)}, not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _kind(mode: int) -> str:
    kinds = ((stat_mode.S_ISDIR, "a directory"), (stat_mode.S_ISFIFO, "a FIFO (named pipe)"),
             (stat_mode.S_ISSOCK, "a socket"), (stat_mode.S_ISCHR, "a device"), (stat_mode.S_ISBLK, "a device"))
    return next((name for test, name in kinds if test(mode)), "a special file")


def json_line(record: Any) -> bytes:
    """``record`` as one line of UTF-8 JSON (ending in a newline), non-ASCII text left
    readable. A lone surrogate in a string (text decoded with ``surrogateescape``, an
    error message holding one) cannot be UTF-8: it is written as its JSON escape
    (``\\ud800``), which :func:`json.loads` reads back as the same string."""
    return json_bytes(record) + b"\n"


def json_bytes(value: Any, **options: Any) -> bytes:
    """``json.dumps(value, ensure_ascii=False, **options)`` as UTF-8, with each lone
    surrogate (only ever inside a JSON string) written as its ``\\uXXXX`` escape."""
    return json.dumps(value, ensure_ascii=False, **options).encode("utf-8", errors="backslashreplace")


BLANK: dict[str, Any] = {}
"""What :func:`parse_line` returns for an empty line (skipped, not counted as bad)."""


class JsonlError(ValueError):
    """A line of a JSON-lines file is not a JSON object; the message names file and line."""


class BadLine(ValueError):
    """Why one line is not a row; ``complete``: it is whole JSON (just not an object)."""

    def __init__(self, reason: str, *, complete: bool) -> None:
        super().__init__(reason)
        self.complete = complete


def parse_line(line: bytes, *, steps: bool = False, nonfinite: bool = False) -> dict[str, Any]:
    """The JSON object on one line, ``NaN`` and ``Infinity`` read as None (as floats with
    ``nonfinite``); ``BLANK`` for a blank line; a byte-order mark before it is ignored.
    With ``steps`` the row must have an integer ``step`` (:func:`row_step`). Anything
    else raises :class:`BadLine` saying why."""
    if line.startswith(BOM):
        line = line[len(BOM):]
    if not line.strip():
        return BLANK
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadLine(f"not a JSON line ({exc})", complete=False) from exc
    try:
        row = json.loads(text, parse_constant=float if nonfinite else lambda _name: None)
    except json.JSONDecodeError as exc:
        raise BadLine(f"not a JSON line ({exc.msg} at column {exc.colno})", complete=False) from exc
    except (ValueError, RecursionError) as exc:  # a number of over 4300 digits; nesting too deep
        raise BadLine(f"not a JSON line ({str(exc).split(';')[0] or type(exc).__name__})", complete=True) from exc
    if not isinstance(row, dict):
        raise BadLine(f"expected a JSON object, got {type(row).__name__}", complete=True)
    if steps:
        row["step"] = row_step(row)
    return row


def row_step(row: dict[str, Any]) -> int:
    """The ``step`` of a row: an integer (a float with no fraction, ``5.0``, is taken as
    that integer); anything else, or none, raises :class:`BadLine`."""
    step = row.get("step")
    if isinstance(step, float) and step.is_integer():
        return int(step)
    if isinstance(step, bool) or not isinstance(step, int):
        shown = repr(step) if len(repr(step)) <= 40 else repr(step)[:40] + "…"
        raise BadLine(f"'step' must be an integer, got {shown}", complete=True)
    return step


class JsonlReader:
    """The rows of a JSON-lines file, read once in order, line by line (a samples file can
    be large).

    Iterating yields ``(line number, row)`` (numbers 1-based; rows as :func:`parse_line`
    reads them, with ``nonfinite`` as given); blank lines are skipped. A last line with no
    newline yet that is not complete JSON (or not complete UTF-8), as a run still writing
    leaves it, is left out and ``cut_short`` is set; any other line that is not a JSON
    object is a :class:`JsonlError` naming the file and line. A file that exists but is
    not a regular file, or cannot be read, is a :class:`RunFileError`."""

    def __init__(self, path: Path, *, nonfinite: bool = False) -> None:
        self.path = Path(path)
        self.nonfinite = nonfinite
        self.cut_short = False

    def __iter__(self) -> Iterator[tuple[int, dict[str, Any]]]:
        failed: tuple[int, BadLine] | None = None
        with open_file(self.path) as lines:
            for number, raw in enumerate(lines, start=1):
                if not raw.strip():
                    continue
                if failed is not None:  # the bad line was not the last one
                    raise JsonlError(f"{self.path}:{failed[0]}: {failed[1]}") from failed[1]
                try:
                    row = parse_line(raw, nonfinite=self.nonfinite)
                except BadLine as exc:
                    if exc.complete or raw.endswith(b"\n"):  # whole, yet not a row
                        raise JsonlError(f"{self.path}:{number}: {exc}") from exc
                    failed = (number, exc)
                    continue
                yield number, row
        self.cut_short = failed is not None
