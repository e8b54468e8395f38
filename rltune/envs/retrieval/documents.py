"""Loading a corpus from JSONL: one ``{"id": ..., "text": ..., ...}`` object per line."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rltune.envs.retrieval.store import Document


class CorpusError(ValueError):
    """A corpus file cannot be loaded; the message names the file and line."""


def load_documents(path: str | os.PathLike[str]) -> list[Document]:
    """The documents of a JSONL file, in file order.

    Each non-blank line is a JSON object with a non-empty string ``id`` and a string
    ``text``; its other fields become ``meta``. A bad line (bytes that are not UTF-8
    included), or an id seen on an earlier line, stops loading with a :class:`CorpusError`
    naming ``FILE:LINE`` (an upsert would otherwise keep one of the two rows without a
    word). A file without documents gives ``[]``; :func:`~rltune.envs.retrieval.build_retriever`
    refuses one.
    """
    path = Path(path)
    # JSON Lines ends a line at "\n" (a "\r" before it is JSON whitespace); str.splitlines
    # would also cut one at a U+2028 or U+0085 inside a string, which JSON allows unescaped
    lines = _text(path).split("\n")
    docs: list[Document] = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        doc = _parse_row(line, f"{path}:{number}")
        if doc.id in first_line:
            raise CorpusError(f"{path}:{number}: id {doc.id!r} already used on line "
                              f"{first_line[doc.id]}")
        first_line[doc.id] = number
        docs.append(doc)
    return docs


def _text(path: Path) -> str:
    """The corpus file's text; a file that is missing, unreadable or not UTF-8 is a
    :class:`CorpusError` naming it (and the line of the first byte that is not UTF-8)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CorpusError(f"{path}: no such corpus file") from None
    except OSError as e:  # a directory, no permission
        raise CorpusError(f"{path}: cannot read the corpus file ({e.strerror or e})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise CorpusError(f"{path}:{line}: not UTF-8 (byte 0x{data[e.start]:02x} at byte column "
                          f"{column}); save the corpus as UTF-8") from None


def _parse_row(line: str, where: str) -> Document:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise CorpusError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise CorpusError(f"{where}: a row is a JSON object, got {type(row).__name__}")
    for key in ("id", "text"):
        if key not in row:
            raise CorpusError(f"{where}: missing {key!r} (row keys: {', '.join(sorted(row))})")
    if not isinstance(row["id"], str) or not row["id"]:
        raise CorpusError(f"{where}: 'id' must be a non-empty string, got {row['id']!r}")
    if not isinstance(row["text"], str):
        raise CorpusError(f"{where}: 'text' must be a string, got {type(row['text']).__name__}")
    meta = {k: v for k, v in row.items() if k not in ("id", "text")}
    return Document(id=row["id"], text=row["text"], meta=meta)
