"""The dashboard's readers of the JSON-lines files a run appends to, both answering
``read(cursor, limit) -> Chunk``, and :func:`last_step` for the run list:

* :class:`JsonlLog` keeps no rows: a cursor is a byte offset, and each read parses the
  lines after it straight from the file. Memory does not grow with the file
  (``metrics.jsonl``: every client wants every row).
* :class:`JsonlTail` keeps the newest ``max_rows`` rows in memory and parses each line
  once; a file it first opens is read from its ``max_rows``-th last line, found by
  reading the file backwards (``samples.jsonl``: only the newest rows are wanted).

Both return a line only once its newline is written (the line a run is writing is left
for later), parse it with :func:`rltune.metrics.jsonl.parse_line`, skip lines that are
not rows (counted, the first one described with its line number), and notice a file that
was rewritten under them: replaced (a resumed run truncates its files to the
checkpoint's step through a new file), shorter than before, or different in the bytes
last seen (emptied in place and grown again). A rewrite starts a new *epoch*; a cursor
of an earlier epoch gets ``reset: true`` and the rows from the start again. Files are
opened with :func:`rltune.metrics.jsonl.open_file` (a :class:`RunFileError` for one
that exists but cannot be read, or leads out of the run directory).
"""

from __future__ import annotations

import os
import secrets
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from rltune.metrics.jsonl import BLANK, BadLine, RunFileError, open_file, parse_line

__all__ = ["Chunk", "CursorError", "JsonlLog", "JsonlTail", "RunFileError", "last_step"]

MARK_BYTES = 64
"""How many bytes before the last position seen are remembered; if they differ at the
next read, the file was rewritten."""

BACKWARD_BLOCK = 1 << 16
"""Block size for reading a file from its end."""

MAX_CURSOR_DIGITS = 20
"""A cursor's position has at most this many ASCII digits (a byte offset or a row count)."""


class CursorError(ValueError):
    """A cursor the client sent is not one a reader handed out."""


@dataclass(frozen=True)
class Chunk:
    """Rows read from a file.

    ``cursor``: what to send next time to get only the rows after these. ``reset``: the
    cursor that was sent belongs to an earlier version of the file (rewritten since, or
    read by an earlier server), so the client must drop what it holds; ``rows`` start
    from the beginning again. ``more``: further rows are ready now (the read stopped at
    a limit), ask again at once. ``bad_lines``: lines skipped, among those read for this
    answer, because they are not rows (not JSON objects, or without an integer step when
    the reader wants one); ``first_bad``: the first of them, ``line N: why``."""

    rows: list[dict[str, Any]]
    cursor: str
    reset: bool
    more: bool
    bad_lines: int = 0
    first_bad: str | None = None


class _Rewrites:
    """Tells whether a file was rewritten since it was last looked at, from its identity,
    its size and the bytes just before the size last seen."""

    def __init__(self) -> None:
        self.epoch = secrets.token_hex(4)
        self._ident: tuple[int, int] | None = None
        self._seen = 0
        self._mark = b""

    def check(self, handle: BinaryIO) -> tuple[int, bool]:
        """``(size, rewritten)``; remembers this size and the bytes before it."""
        stat = os.fstat(handle.fileno())
        ident = (stat.st_dev, stat.st_ino)
        rewritten = (ident != self._ident or stat.st_size < self._seen
                     or _bytes_before(handle, self._seen) != self._mark)
        if rewritten:
            self.epoch = secrets.token_hex(4)
        self._ident, self._seen = ident, stat.st_size
        self._mark = _bytes_before(handle, stat.st_size)
        return stat.st_size, rewritten

    def gone(self) -> None:
        """The file does not exist (any more): a new epoch if it did before."""
        if self._ident is not None:
            self.epoch = secrets.token_hex(4)
        self._ident, self._seen, self._mark = None, 0, b""


class JsonlLog:
    """Rows of a JSON-lines file read from disk from the client's byte offset; nothing
    is kept in memory but what tells a rewritten file. ``read_bytes`` bounds one read
    (a line longer than that is still read whole). ``within``: the run directory the file
    must resolve into (:func:`open_file`). ``steps``: a row must have an integer ``step``
    (:func:`row_step`; a whole float is made an int), else it is a bad line. Safe to use
    from several threads."""

    def __init__(self, path: Path, *, read_bytes: int = 8 << 20, within: Path | None = None,
                 steps: bool = False) -> None:
        if read_bytes < 1:
            raise ValueError(f"read_bytes must be at least 1 (got {read_bytes})")
        self.path = Path(path)
        self.read_bytes = read_bytes
        self.within, self.steps = within, steps
        self._rewrites = _Rewrites()
        self._lock = threading.Lock()

    def read(self, cursor: str | None, *, limit: int) -> Chunk:
        """Rows after ``cursor`` (from the start for ``None``), at most ``limit``. A file
        that exists but cannot be read is a :class:`RunFileError`."""
        _check_limit(limit)
        with self._lock:
            try:
                handle = open_file(self.path, within=self.within)
            except FileNotFoundError:
                self._rewrites.gone()
                return self._answer(cursor, 0, lambda offset: ([], offset, 0, None, False))
            with handle:
                size, _ = self._rewrites.check(handle)
                return self._answer(cursor, size, lambda offset: self._rows_at(handle, offset, size, limit))

    def _answer(self, cursor: str | None, size: int, rows_at: Any) -> Chunk:
        epoch = self._rewrites.epoch
        offset, reset = 0, False
        if cursor is not None:
            given_epoch, offset = _parse_cursor(cursor)
            if given_epoch != epoch:
                offset, reset = 0, True
            elif offset > size:
                raise CursorError(f"cursor {cursor!r} is past the end of {self.path}")
        rows, end, bad, first_bad, more = rows_at(offset)
        return Chunk(rows=rows, cursor=f"{epoch}:{end}", reset=reset, more=more, bad_lines=bad,
                     first_bad=first_bad)

    def _rows_at(self, handle: BinaryIO, offset: int, size: int,
                 limit: int) -> tuple[list[dict[str, Any]], int, int, str | None, bool]:
        """``(rows, offset after them, lines skipped, the first skipped, more ready)`` from
        ``offset``, which must be the start of a line."""
        if offset > 0 and _bytes_before(handle, offset)[-1:] != b"\n":
            raise CursorError(f"cursor offset {offset} is not the start of a line of {self.path}")
        data, complete = _read_whole_lines(handle, offset, size, self.read_bytes)
        rows: list[dict[str, Any]] = []
        bad = position = 0
        first_bad = None
        while position < complete and len(rows) < limit:
            newline = data.index(b"\n", position)
            try:
                row = parse_line(data[position:newline], steps=self.steps)
            except BadLine as exc:
                bad += 1
                if first_bad is None:
                    number = _count_lines(handle, offset) + data.count(b"\n", 0, position) + 1
                    first_bad = f"line {number}: {exc}"
                row = BLANK
            position = newline + 1
            if row is not BLANK:
                rows.append(row)
        more = position < complete or offset + len(data) < size
        return rows, offset + position, bad, first_bad, more


class JsonlTail:
    """The newest ``max_rows`` rows of a JSON-lines file, kept in memory.

    Each :meth:`read` first parses what was appended since the previous one (at most
    ``read_bytes`` per call, but always whole lines), then answers from memory. Cursors
    count lines kept; a cursor older than the lines kept continues from the oldest kept.
    A line that is not a row is kept as such (it counts towards ``max_rows``), so that
    each reader is told of it once, in ``bad_lines`` and ``first_bad``. ``within`` and
    ``steps`` as for :class:`JsonlLog`. Safe to use from several threads."""

    def __init__(self, path: Path, *, max_rows: int, read_bytes: int = 8 << 20,
                 within: Path | None = None, steps: bool = False) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1 (got {max_rows})")
        if read_bytes < 1:
            raise ValueError(f"read_bytes must be at least 1 (got {read_bytes})")
        self.path = Path(path)
        self.max_rows = max_rows
        self.read_bytes = read_bytes
        self.within, self.steps = within, steps
        self._rewrites = _Rewrites()
        self._lock = threading.Lock()
        self._start_over(0)

    def _start_over(self, offset: int) -> None:
        """Forget every row; read again from ``offset``."""
        self._offset = offset
        self._line: int | None = 1 if offset == 0 else None  # the number of the line at the offset
        self._rows: deque[dict[str, Any] | _Bad] = deque(maxlen=self.max_rows)
        self._next_seq = 0

    def read(self, cursor: str | None, *, limit: int) -> Chunk:
        """Rows after ``cursor`` (all rows held for ``None``), at most ``limit`` lines. A
        file that exists but cannot be read is a :class:`RunFileError`."""
        _check_limit(limit)
        with self._lock:
            unread = self._refresh()
            first_seq = self._next_seq - len(self._rows)
            epoch = self._rewrites.epoch
            seq, reset = first_seq, False
            if cursor is not None:
                given_epoch, seq = _parse_cursor(cursor)
                if given_epoch != epoch:
                    seq, reset = first_seq, True
                elif seq > self._next_seq:
                    raise CursorError(f"cursor {cursor!r} is past the end of {self.path}")
            start = max(seq, first_seq)
            kept = [self._rows[index] for index in range(start - first_seq, min(len(self._rows), start - first_seq + limit))]
            end = start + len(kept)
            bad = [entry.why for entry in kept if isinstance(entry, _Bad)]
            return Chunk(rows=[entry for entry in kept if not isinstance(entry, _Bad)], cursor=f"{epoch}:{end}",
                         reset=reset, more=unread or end < self._next_seq, bad_lines=len(bad),
                         first_bad=bad[0] if bad else None)

    def _refresh(self) -> bool:
        """Parse the whole lines appended since the last call; True if unread bytes
        remain because the read stopped at ``read_bytes``."""
        try:
            handle = open_file(self.path, within=self.within)
        except FileNotFoundError:
            if self._rows or self._offset:
                self._start_over(0)
            self._rewrites.gone()
            return False
        with handle:
            size, rewritten = self._rewrites.check(handle)
            if rewritten:
                self._start_over(_start_of_last_lines(handle, size, self.max_rows))
            if size <= self._offset:
                return False
            data, complete = _read_whole_lines(handle, self._offset, size, self.read_bytes)
            for index, line in enumerate(data[:complete].split(b"\n")[:-1]):
                try:
                    row: dict[str, Any] | _Bad = parse_line(line, steps=self.steps)
                except BadLine as exc:
                    if self._line is None:
                        self._line = _count_lines(handle, self._offset) + 1
                    row = _Bad(f"line {self._line + index}: {exc}")
                if row is not BLANK:
                    self._rows.append(row)
                    self._next_seq += 1
            if self._line is not None:
                self._line += data.count(b"\n", 0, complete)
            self._offset += complete
            return self._offset + (len(data) - complete) < size


@dataclass(frozen=True)
class _Bad:
    """A line of :class:`JsonlTail`'s file that is not a row, and why."""

    why: str


def _check_limit(limit: int) -> None:
    if limit < 1:
        raise ValueError(f"limit must be at least 1 (got {limit})")


def _parse_cursor(cursor: str) -> tuple[str, int]:
    """``(epoch, position)``; the position is ASCII digits, at most :data:`MAX_CURSOR_DIGITS`."""
    epoch, sep, position = cursor.partition(":")
    if (not sep or not epoch or len(epoch) > 64 or not position.isascii() or not position.isdigit()
            or len(position) > MAX_CURSOR_DIGITS):
        shown = cursor if len(cursor) <= 80 else cursor[:80] + "…"
        raise CursorError(f"cursor {shown!r} is not EPOCH:POSITION (POSITION: at most {MAX_CURSOR_DIGITS} "
                          "digits 0-9) as returned by an earlier answer")
    return epoch, int(position)


def _count_lines(handle: BinaryIO, end: int) -> int:
    """How many newlines the file has before byte ``end``."""
    handle.seek(0)
    count, left = 0, end
    while left > 0:
        block = handle.read(min(left, 1 << 20))
        if not block:
            break
        count += block.count(b"\n")
        left -= len(block)
    return count


def _read_whole_lines(handle: BinaryIO, offset: int, size: int, budget: int) -> tuple[bytes, int]:
    """Read from ``offset`` up to ``budget`` bytes (more if one line is longer than that)
    and return the data and the length of its part made of whole lines."""
    handle.seek(offset)
    data = handle.read(min(size - offset, budget))
    complete = data.rfind(b"\n") + 1
    while complete == 0 and offset + len(data) < size:
        more = handle.read(min(size - offset - len(data), budget))
        if not more:
            break
        newline = more.rfind(b"\n")
        data += more
        if newline >= 0:
            complete = len(data) - len(more) + newline + 1
    return data, complete


def _bytes_before(handle: BinaryIO, offset: int) -> bytes:
    start = max(0, offset - MARK_BYTES)
    handle.seek(start)
    return handle.read(offset - start)


def _start_of_last_lines(handle: BinaryIO, size: int, count: int) -> int:
    """Byte offset where the ``count``-th last whole line starts (0 if the file has no
    more than ``count`` whole lines)."""
    seen = 0
    for block_start, block in _blocks_from_end(handle, size):
        index = len(block)
        while (index := block.rfind(b"\n", 0, index)) >= 0:
            seen += 1
            if seen == count + 1:
                return block_start + index + 1
    return 0


def _blocks_from_end(handle: BinaryIO, size: int, limit: int | None = None) -> Iterator[tuple[int, bytes]]:
    """``(offset, bytes)`` blocks of the file from its end backwards, at most ``limit``
    bytes in all."""
    position, total = size, 0
    while position > 0 and (limit is None or total < limit):
        length = min(BACKWARD_BLOCK, position)
        position -= length
        total += length
        handle.seek(position)
        yield position, handle.read(length)


def last_step(path: Path, *, within: Path | None = None, search_bytes: int = 64 << 20) -> int | None:
    """The ``step`` (:func:`~rltune.metrics.jsonl.row_step`) of the last whole line of a metrics file that has
    one, reading the file from its end (at most ``search_bytes``); None if there is none.
    Opened with :func:`open_file` (a :class:`RunFileError` if it cannot be read)."""
    try:
        handle = open_file(path, within=within)
    except FileNotFoundError:
        return None
    with handle:
        pieces: list[bytes] = []  # the bytes after the newline last met, rightmost first
        at_end = True  # those bytes end the file: the line still being written
        start = 1
        for start, block in _blocks_from_end(handle, os.fstat(handle.fileno()).st_size, search_bytes):
            first, *lines = block.split(b"\n")
            if not lines:  # inside one line
                pieces.append(first)
                continue
            right = lines.pop() + b"".join(reversed(pieces))
            candidates = ([] if at_end else [right]) + lines[::-1]
            at_end, pieces = False, [first]
            for line in candidates:
                if (step := _step_of_line(line)) is not None:
                    return step
        if start == 0 and not at_end:  # the first line of the file
            return _step_of_line(b"".join(reversed(pieces)))
    return None


def _step_of_line(line: bytes) -> int | None:
    try:
        return parse_line(line, steps=True).get("step")
    except BadLine:
        return None
