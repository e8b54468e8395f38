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
    ``text``; its other fields become ``meta``. A bad line, or an id seen on an earlier
    line, stops loading with a :class:`CorpusError` naming ``FILE:LINE`` (an upsert would
    otherwise keep one of the two rows without a word).
    """
    path = Path(path)
    try:
        # JSON Lines ends a line at "\n" (a "\r" before it is JSON whitespace); str.splitlines
        # would also cut one at a U+2028 or U+0085 inside a string, which JSON allows unescaped
        lines = path.read_text(encoding="utf-8").split("\n")
    except FileNotFoundError:
        raise CorpusError(f"{path}: no such corpus file") from None
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
