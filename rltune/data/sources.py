"""Where a dataset's rows come from: jsonl and parquet files, ``datasets`` directories and
built-in tasks (``data.train`` / ``data.eval``; see :mod:`rltune.data.loaders`)."""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from rltune.data.tasks import TASKS

BUILTIN_PREFIX = "builtin:"


class DataError(ValueError):
    """A dataset cannot be used as configured; the message says where and what to change."""


class BadRow(Exception):
    """A row that fails a check: what is wrong and which setting or fix addresses it (the
    loader adds the source and row, and follows ``data.on_bad_row``)."""

    def __init__(self, problem: str, hint: str) -> None:
        super().__init__(problem)
        self.problem, self.hint = problem, hint


@dataclass(frozen=True)
class RawRow:
    """One row of a source: its fields, or why they could not be read."""

    number: int  # 1-based
    fields: dict[str, Any] | None
    problem: str | None = None  # why the row could not be parsed at all


def open_source(source: str) -> tuple[str, Iterable[RawRow]]:
    """``(name used in ids, rows)`` of ``source``."""
    if source.startswith(BUILTIN_PREFIX):
        return _builtin_rows(source)
    path = Path(source)
    if not path.exists():
        raise DataError(f"data source {source!r} does not exist; check data.train / data.eval")
    if path.is_dir():
        return path.name, _read_datasets_dir(path)
    reader = _FILE_READERS.get(path.suffix)
    if reader is None:
        raise DataError(
            f"data source {source!r}: unsupported file type {path.suffix!r}; use .jsonl, "
            f".parquet, a `datasets` directory (save_to_disk) or {BUILTIN_PREFIX}TASK/SPLIT"
        )
    return path.name, reader(path)


def image_dir(source: str) -> Path | None:
    """Where the relative image paths of ``source`` start: a file's directory, a
    ``datasets`` directory itself; None for built-in tasks."""
    if source.startswith(BUILTIN_PREFIX):
        return None
    path = Path(source)
    return path if path.is_dir() else path.parent


def _builtin_rows(source: str) -> tuple[str, Iterable[RawRow]]:
    spec = source[len(BUILTIN_PREFIX) :]
    task, _, split = spec.partition("/")
    if task not in TASKS or not split:
        raise DataError(
            f"data source {source!r}: expected {BUILTIN_PREFIX}TASK/SPLIT with TASK one of "
            f"{sorted(TASKS)}"
        )
    try:
        rows = TASKS[task](split)
    except ValueError as err:
        raise DataError(f"data source {source!r}: {err}") from err
    return spec, [RawRow(i, row) for i, row in enumerate(rows, 1)]


def _read_jsonl(path: Path) -> Iterator[RawRow]:
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                # without its line ending, a row cut short is reported at its end, not at "line 2"
                obj = json.loads(line.rstrip(b"\r\n").decode("utf-8"), object_pairs_hook=_without_duplicates)
            except UnicodeDecodeError as err:
                yield RawRow(number, None, f"not valid UTF-8 ({err.reason} at byte {err.start})")
                continue
            except _DuplicateKey as err:
                yield RawRow(number, None, f"the key {err.args[0]!r} appears twice in one object; keep one")
                continue
            except json.JSONDecodeError as err:
                # some of json's messages end in "at" (`Unterminated string starting at`)
                where = "" if err.msg.endswith(" at") else " at"
                yield RawRow(number, None, f"invalid JSON ({err.msg}{where} column {err.colno})")
                continue
            if not isinstance(obj, dict):
                yield RawRow(number, None, f"expected a JSON object, got {type(obj).__name__}")
                continue
            yield RawRow(number, obj)


class _DuplicateKey(Exception):
    pass


def _without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict, refusing a key given twice (json keeps the last silently)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return obj


def _read_parquet(path: Path) -> list[RawRow]:
    pa = _import_extra("pyarrow", what="parquet files")
    parquet = _import_extra("pyarrow.parquet", what="parquet files")
    try:
        table = parquet.read_table(path)
    except pa.ArrowException as err:
        raise DataError(f"cannot read parquet file {str(path)!r}: {err}") from err
    return [RawRow(i, row) for i, row in enumerate(table.to_pylist(), 1)]


def _read_datasets_dir(path: Path) -> list[RawRow]:
    datasets = _import_extra("datasets", what="`datasets` directories")
    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as err:
        raise DataError(
            f"data source {str(path)!r} is a directory but not one written by "
            f"datasets' save_to_disk: {err}"
        ) from err
    except OSError as err:  # permissions, I/O: the directory may be whole
        raise DataError(f"data source {str(path)!r}: cannot read this save_to_disk directory ({err})") from err
    except Exception as err:  # a damaged file inside it: arrow's, json's, datasets' own errors
        raise DataError(
            f"data source {str(path)!r}: datasets cannot read this save_to_disk directory, a file in it "
            f"is damaged ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); write it again"
        ) from err
    if isinstance(loaded, datasets.DatasetDict):
        raise DataError(
            f"data source {str(path)!r} holds several splits {sorted(loaded)}; point "
            f"data.train / data.eval at one of them, e.g. {str(path / next(iter(loaded)))!r}"
        )
    features = loaded.features.copy()
    if _encoded_images(datasets, features):  # rows then hold {"bytes", "path"}, as parquet's do
        loaded = loaded.cast(features, keep_in_memory=True)
    return [RawRow(i, dict(row)) for i, row in enumerate(loaded, 1)]


def _encoded_images(datasets: ModuleType, feature: Any) -> bool:
    """Set every ``Image`` feature in ``feature`` (a copy) to stay encoded; whether any was
    found. ``datasets`` would otherwise hand over decoded PIL images, leaving the loader
    neither the file's bytes (``PromptImage.data``) nor its size before decoding."""
    if isinstance(feature, datasets.Image):
        feature.decode = False
        return True
    if isinstance(feature, dict):
        return any([_encoded_images(datasets, f) for f in feature.values()])
    inner = getattr(feature, "feature", None)  # List, LargeList, Sequence
    return inner is not None and _encoded_images(datasets, inner)


_FILE_READERS = {".jsonl": _read_jsonl, ".parquet": _read_parquet}


def _import_extra(module: str, *, what: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise DataError(f"reading {what} needs `{module}`: pip install 'rltune[data]'") from err

