"""JSON-lines files that a training run appends to (``metrics.jsonl``, ``samples.jsonl``):
the one place they are read, by the dashboard, the report and the CLI.

Every line is written the same way (:func:`json_line`: UTF-8, a lone surrogate as its
JSON escape), and every reader turns a line into a row the same way (:func:`parse_line`):
a JSON object, ``NaN``/``Infinity`` as ``null``, blank lines skipped. :class:`JsonlReader`
reads a whole file once, in order, with line numbers (the report, the CLI). Two readers,
both answering ``read(cursor, limit) -> Chunk``, serve the dashboard:

* :class:`JsonlLog` keeps no rows: a cursor is a byte offset, and each read parses the
  lines after it straight from the file. Memory does not grow with the file
  (``metrics.jsonl``: every client wants every row).
* :class:`JsonlTail` keeps the newest ``max_rows`` rows in memory and parses each line
  once; a file it first opens is read from its ``max_rows``-th last line, found by
  reading the file backwards (``samples.jsonl``: only the newest rows are wanted).

Both (the dashboard's) return a line only once its newline is written (the line a run is writing is left
for later), skip lines that are not JSON objects, turn ``NaN``/``Infinity`` into ``null``,
and notice a file that was rewritten under them: replaced (a resumed run truncates its
files to the checkpoint's step through a new file), shorter than before, or different in
the bytes last seen (emptied in place and grown again). A rewrite starts a new *epoch*;
a cursor of an earlier epoch gets ``reset: true`` and the rows from the start again.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

MARK_BYTES = 64
"""How many bytes before the last position seen are remembered; if they differ at the
next read, the file was rewritten."""

BACKWARD_BLOCK = 1 << 16
"""Block size for reading a file from its end."""


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
    answer, because they are not JSON objects."""

    rows: list[dict[str, Any]]
    cursor: str
    reset: bool
    more: bool
    bad_lines: int = 0


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
    (a line longer than that is still read whole). Safe to use from several threads."""

    def __init__(self, path: Path, *, read_bytes: int = 8 << 20) -> None:
        if read_bytes < 1:
            raise ValueError(f"read_bytes must be at least 1 (got {read_bytes})")
        self.path = Path(path)
        self.read_bytes = read_bytes
        self._rewrites = _Rewrites()
        self._lock = threading.Lock()

    def read(self, cursor: str | None, *, limit: int) -> Chunk:
        """Rows after ``cursor`` (from the start for ``None``), at most ``limit``."""
        _check_limit(limit)
        with self._lock:
            try:
                handle = self.path.open("rb")
            except FileNotFoundError:
                self._rewrites.gone()
                return self._answer(cursor, 0, lambda offset: ([], offset, 0, False))
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
        rows, end, bad, more = rows_at(offset)
        return Chunk(rows=rows, cursor=f"{epoch}:{end}", reset=reset, more=more, bad_lines=bad)

    def _rows_at(self, handle: BinaryIO, offset: int, size: int,
                 limit: int) -> tuple[list[dict[str, Any]], int, int, bool]:
        """``(rows, offset after them, lines skipped, more ready)`` from ``offset``, which
        must be the start of a line."""
        if offset > 0 and _bytes_before(handle, offset)[-1:] != b"\n":
            raise CursorError(f"cursor offset {offset} is not the start of a line of {self.path}")
        data, complete = _read_whole_lines(handle, offset, size, self.read_bytes)
        rows: list[dict[str, Any]] = []
        bad = position = 0
        while position < complete and len(rows) < limit:
            newline = data.index(b"\n", position)
            row = _parse(data[position:newline])
            position = newline + 1
            if row is None:
                bad += 1
            elif row is not BLANK:
                rows.append(row)
        more = position < complete or offset + len(data) < size
        return rows, offset + position, bad, more


class JsonlTail:
    """The newest ``max_rows`` rows of a JSON-lines file, kept in memory.

    Each :meth:`read` first parses what was appended since the previous one (at most
    ``read_bytes`` per call, but always whole lines), then answers from memory. Cursors
    count rows; a cursor older than the rows kept continues from the oldest kept. Lines
    that are not JSON objects are skipped and counted in :attr:`bad_lines`. Safe to use
    from several threads."""

    def __init__(self, path: Path, *, max_rows: int, read_bytes: int = 8 << 20) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1 (got {max_rows})")
        if read_bytes < 1:
            raise ValueError(f"read_bytes must be at least 1 (got {read_bytes})")
        self.path = Path(path)
        self.max_rows = max_rows
        self.read_bytes = read_bytes
        self._rewrites = _Rewrites()
        self._lock = threading.Lock()
        self._start_over(0)

    def _start_over(self, offset: int) -> None:
        """Forget every row; read again from ``offset``."""
        self._offset = offset
        self._rows: deque[dict[str, Any]] = deque(maxlen=self.max_rows)
        self._next_seq = 0
        self.bad_lines = 0

    @property
    def held(self) -> int:
        """How many rows are in memory now."""
        return len(self._rows)

    def read(self, cursor: str | None, *, limit: int) -> Chunk:
        """Rows after ``cursor`` (all rows held for ``None``), at most ``limit``."""
        _check_limit(limit)
        with self._lock:
            bad_before = self.bad_lines
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
            rows = [self._rows[index] for index in range(start - first_seq, min(len(self._rows), start - first_seq + limit))]
            end = start + len(rows)
            return Chunk(rows=rows, cursor=f"{epoch}:{end}", reset=reset,
                         more=unread or end < self._next_seq, bad_lines=self.bad_lines - bad_before)

    def _refresh(self) -> bool:
        """Parse the whole lines appended since the last call; True if unread bytes
        remain because the read stopped at ``read_bytes``."""
        try:
            handle = self.path.open("rb")
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
            for line in data[:complete].split(b"\n")[:-1]:
                row = _parse(line)
                if row is None:
                    self.bad_lines += 1
                elif row is not BLANK:
                    self._rows.append(row)
                    self._next_seq += 1
            self._offset += complete
            return self._offset + (len(data) - complete) < size


BLANK: dict[str, Any] = {}
"""What :func:`_parse` returns for an empty line (skipped, not counted as bad)."""


class JsonlError(ValueError):
    """A line of a JSON-lines file is not a JSON object; the message names file and line."""


class BadLine(ValueError):
    """Why one line is not a row; ``complete``: it is whole JSON (just not an object)."""

    def __init__(self, reason: str, *, complete: bool) -> None:
        super().__init__(reason)
        self.complete = complete


def parse_line(line: bytes) -> dict[str, Any]:
    """The JSON object on one line, ``NaN`` and ``Infinity`` read as None; ``BLANK`` for a
    blank line. Anything else raises :class:`BadLine` saying why."""
    if not line.strip():
        return BLANK
    try:
        row = json.loads(line.decode("utf-8"), parse_constant=lambda _name: None)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadLine(f"not a JSON line ({exc})", complete=False) from exc
    if not isinstance(row, dict):
        raise BadLine(f"expected a JSON object, got {type(row).__name__}", complete=True)
    return row


def _parse(line: bytes) -> dict[str, Any] | None:
    """:func:`parse_line`, with None for a line that is not a row (the dashboard skips it)."""
    try:
        return parse_line(line)
    except BadLine:
        return None


class JsonlReader:
    """The rows of a JSON-lines file, read once in order, line by line (a samples file can
    be large).

    Iterating yields ``(line number, row)`` (numbers 1-based; rows as :func:`parse_line`
    reads them); blank lines are skipped. A last line that is not complete JSON (or not
    complete UTF-8), as a run still writing leaves it, is left out and ``cut_short`` is
    set; any other line that is not a JSON object is a :class:`JsonlError` naming the file
    and line."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.cut_short = False

    def __iter__(self) -> Iterator[tuple[int, dict[str, Any]]]:
        failed: tuple[int, BadLine] | None = None
        with self.path.open("rb") as lines:
            for number, raw in enumerate(lines, start=1):
                if not raw.strip():
                    continue
                if failed is not None:  # the bad line was not the last one
                    raise JsonlError(f"{self.path}:{failed[0]}: {failed[1]}") from failed[1]
                try:
                    row = parse_line(raw)
                except BadLine as exc:
                    if exc.complete:
                        raise JsonlError(f"{self.path}:{number}: {exc}") from exc
                    failed = (number, exc)
                    continue
                yield number, row
        self.cut_short = failed is not None


def _check_limit(limit: int) -> None:
    if limit < 1:
        raise ValueError(f"limit must be at least 1 (got {limit})")


def _parse_cursor(cursor: str) -> tuple[str, int]:
    epoch, sep, position = cursor.partition(":")
    if not sep or not epoch or not position.isdigit():
        raise CursorError(f"cursor {cursor!r} is not EPOCH:POSITION as returned by an earlier answer")
    return epoch, int(position)


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


def last_step(path: Path, *, search_bytes: int = 1 << 20) -> int | None:
    """The ``step`` of the last whole line of a metrics file that has one, reading the
    file from its end (at most ``search_bytes``); None if there is none."""
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        return None
    with handle:
        size = os.fstat(handle.fileno()).st_size
        tail = b""
        for start, block in _blocks_from_end(handle, size, search_bytes):
            tail = block + tail
            step = _last_step_in(tail, whole_first_line=start == 0)
            if step is not None:
                return step
    return None


def _last_step_in(tail: bytes, *, whole_first_line: bool) -> int | None:
    """The step of the last whole, parseable line of ``tail``; its first line may be cut
    unless it starts the file, its last is being written unless it ends with a newline."""
    lines = tail.split(b"\n")[:-1]
    if not whole_first_line:
        lines = lines[1:]
    for line in reversed(lines):
        row = _parse(line)
        if row and isinstance(row.get("step"), int):
            return row["step"]
    return None
