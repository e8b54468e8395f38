"""The SQLite file of an :class:`~rltune.envs.retrieval.embedded.EmbeddedStore`: opening
it, making a new one, and checking an existing one before anything is read from it or
written to it.

A store file that exists but cannot be read as a store (0 bytes, not a database, a table
or column missing, ``info`` rows missing or edited, a vector of the wrong length or not
finite, meta that is not a JSON object) is a :class:`StoreError` naming the file, what is
wrong, and what to do; it is never initialised or written over, since it may be the only
copy of an expensive embedding run.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rltune.envs.retrieval.store import NORM_TOLERANCE

DB_FILE = "store.sqlite3"
COLUMNS = {"docs": ("row", "id", "text", "meta", "vec"), "info": ("key", "value")}
_SCHEMA = (
    "CREATE TABLE docs (row INTEGER PRIMARY KEY, id TEXT UNIQUE NOT NULL, text TEXT NOT NULL, "
    "meta TEXT NOT NULL, vec BLOB NOT NULL)",
    "CREATE TABLE info (key TEXT PRIMARY KEY, value BLOB NOT NULL)",
)


class StoreError(ValueError):
    """A store file that cannot be used as it is; the message names the file."""


@dataclass(frozen=True)
class Info:
    """The ``info`` rows of a store: format version, dimension, the probe's embedding."""

    format: int
    dim: int
    probe: bytes


def rebuild_hint(file: str | os.PathLike[str]) -> str:
    return (f"rebuild it: delete {file} and build the store again from its documents "
            "(`documents:` in the search spec)")


def connect(path: str | os.PathLike[str] | None) -> tuple[sqlite3.Connection, Path | None, bool]:
    """``(connection, file, new)`` for a store in the directory ``path`` (in memory for
    None). ``new``: there was no store file, so the caller makes one (:func:`create`);
    an existing file has been checked to be an SQLite database with the store's tables
    and columns."""
    if path is None:
        return sqlite3.connect(":memory:", check_same_thread=False), None, True
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"embedded store path {os.fspath(path)!r} is a file; "
                                 "the store is a directory")
    file = directory / DB_FILE
    new = not file.exists()
    if not new and file.is_file() and file.stat().st_size == 0:
        raise StoreError(f"embedded store {file}: the file is empty (0 bytes: a truncated copy?); "
                         + rebuild_hint(file))
    directory.mkdir(parents=True, exist_ok=True)
    try:
        db = sqlite3.connect(file, check_same_thread=False)  # guarded by the store's lock
    except sqlite3.Error as e:
        raise StoreError(f"embedded store {file}: cannot open it ({e})") from None
    if not new:
        try:
            _check_schema(db, file)
        except BaseException:
            db.close()
            raise
    return db, file, new


def _check_schema(db: sqlite3.Connection, file: Path) -> None:
    where = f"embedded store {file}"
    try:
        tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        missing = [t for t in COLUMNS if t not in tables]
        if missing:
            raise StoreError(f"{where}: no {' or '.join(missing)} table (not a store written by "
                             f"rltune, or a damaged one); {rebuild_hint(file)}")
        for table, wanted in COLUMNS.items():
            have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
            lacking = [c for c in wanted if c not in have]
            if lacking:
                raise StoreError(f"{where}: the {table} table has no column {', '.join(lacking)} "
                                 f"(a store of an older format?); {rebuild_hint(file)}")
    except sqlite3.OperationalError as e:  # locked, unreadable: the file may be fine
        raise StoreError(f"{where}: cannot read it ({e})") from None
    except sqlite3.DatabaseError as e:  # "file is not a database", "malformed"
        raise StoreError(f"{where}: not a readable SQLite database ({e}); {rebuild_hint(file)}") from None


def create(db: sqlite3.Connection, info: Info) -> None:
    """Make the tables of a new store and write its ``info``, in one transaction."""
    db.execute("BEGIN")
    try:
        for statement in _SCHEMA:
            db.execute(statement)
        db.executemany("INSERT INTO info (key, value) VALUES (?, ?)", [
            ("format", str(info.format)), ("dim", str(info.dim)), ("probe", info.probe)])
    except BaseException:
        db.rollback()
        raise
    db.commit()


def read_info(db: sqlite3.Connection, where: str, file: Path | None) -> Info:
    """The ``info`` rows of an existing store, each checked for its type."""
    info = dict(db.execute("SELECT key, value FROM info"))
    hint = rebuild_hint(file) if file is not None else "build the store again"
    if not info:
        count = db.execute("SELECT COUNT(*) FROM docs").fetchone()[0]
        held = f"{count} documents but " if count else ""
        raise StoreError(f"{where}: the info table is empty (the store holds {held}no format, "
                         f"dimension or embedder probe to check its vectors by); {hint}")
    missing = [key for key in ("format", "dim", "probe") if key not in info]
    if missing:
        raise StoreError(f"{where}: the info table has no {', '.join(map(repr, missing))} row; {hint}")
    numbers = {}
    for key in ("format", "dim"):
        value = info[key]
        try:
            numbers[key] = int(value.decode() if isinstance(value, bytes) else value)
        except (TypeError, ValueError, UnicodeDecodeError):
            raise StoreError(f"{where}: the info row {key!r} is {value!r}, not an integer; {hint}") from None
    if not isinstance(info["probe"], bytes):
        raise StoreError(f"{where}: the info row 'probe' is a {type(info['probe']).__name__}, "
                         f"not a vector; {hint}")
    return Info(format=numbers["format"], dim=numbers["dim"], probe=info["probe"])


def probe_vector(info: Info, where: str, file: Path | None) -> np.ndarray:
    """The stored probe embedding, checked for length and finite values."""
    hint = rebuild_hint(file) if file is not None else "build the store again"
    if len(info.probe) != 4 * info.dim:
        raise StoreError(f"{where}: the stored probe has {len(info.probe)} bytes, expected "
                         f"{4 * info.dim} ({info.dim} float32); {hint}")
    vector = np.frombuffer(info.probe, dtype=np.float32)
    if not np.isfinite(vector).all():
        raise StoreError(f"{where}: the stored probe is not finite (NaN or inf); {hint}")
    return vector


def load_vectors(db: sqlite3.Connection, dim: int, where: str,
                 file: Path | None) -> tuple[list[int], np.ndarray]:
    """``(rows, vectors [N, dim])`` of the stored documents, in row order. A document with a
    vector of the wrong length, not finite or not of unit (or zero) norm, or whose meta is
    not a JSON object, or a text or id that is not text, is refused by its id."""
    hint = rebuild_hint(file) if file is not None else "build the store again"
    rows, blobs = [], []
    for row, id_, text_type, meta, vec in _documents(db):
        problem = _row_problem(id_, text_type, meta, vec, dim)
        if problem is not None:
            raise StoreError(f"{where}: document {id_!r}: {problem}; {hint}")
        rows.append(row)
        blobs.append(vec)
    vectors = np.frombuffer(b"".join(blobs), dtype=np.float32).reshape(len(rows), dim)
    finite = np.isfinite(vectors).all(axis=1)
    norms = np.linalg.norm(np.where(finite[:, None], vectors, 0.0), axis=1)
    bad = ~finite | ~((np.abs(norms - 1.0) <= NORM_TOLERANCE) | (norms == 0.0))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        doc_id = db.execute("SELECT id FROM docs WHERE row = ?", (rows[i],)).fetchone()[0]
        what = "is not finite (NaN or inf)" if not finite[i] else f"has L2 norm {norms[i]:.6f}, not 1"
        raise StoreError(f"{where}: document {doc_id!r}: its stored vector {what}; {hint}")
    return rows, vectors


def _documents(db: sqlite3.Connection) -> Iterator[tuple[Any, ...]]:
    yield from db.execute("SELECT row, id, typeof(text), meta, vec FROM docs ORDER BY row")


def _row_problem(id_: Any, text_type: str, meta: Any, vec: Any, dim: int) -> str | None:
    if not isinstance(id_, str) or text_type != "text":
        return "its id or text is not text"
    if not isinstance(vec, bytes) or len(vec) != 4 * dim:
        size = f"{len(vec)} bytes" if isinstance(vec, bytes) else f"a {type(vec).__name__}"
        return f"its stored vector is {size}, expected {4 * dim} bytes ({dim} float32)"
    try:
        ok = isinstance(meta, str) and isinstance(json.loads(meta), dict)
    except (ValueError, RecursionError):
        ok = False
    return None if ok else "its meta is not a JSON object"
