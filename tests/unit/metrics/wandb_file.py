"""Reading a W&B offline ``.wandb`` file back record by record with W&B's own protobuf
``Record`` (wandb 0.31 has no public reader for it).

The file is a LevelDB-style log, as W&B writes it: a 7-byte header (``:W&B``, magic
0xBEE1, version 0), then 32 KiB blocks of chunks, each ``crc32 (4 bytes LE) | length
(2 bytes LE) | type (1 byte: 1 full, 2 first, 3 middle, 4 last)`` and its data, the crc
taken over the type byte and the data; a block's tail shorter than a chunk header is
zero padding."""

from __future__ import annotations

import json
import struct
import time
import zlib
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2

BLOCK = 32768
HEADER = 7


def chunks_data(path: Path) -> list[bytes]:
    """The records' bytes in the order they were written, crc checked."""
    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0)
    records, pending, pos = [], b"", HEADER
    while pos < len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if (crc, length, kind) == (0, 0, 0):  # padding up to the block's end
            pos += left
            continue
        chunk = data[pos + HEADER : pos + HEADER + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"bad crc at byte {pos} of {path}"
        pos += HEADER + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(pending)
    return records


def read_records(path: Path) -> list[Any]:
    out = []
    for raw in chunks_data(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        out.append(record)
    return out


def _items(updates: Any) -> dict[str, Any]:
    return {"/".join(u.nested_key) if u.nested_key else u.key: json.loads(u.value_json) for u in updates}


def history(records: list[Any]) -> list[dict[str, Any]]:
    """The history rows, without W&B's own ``_timestamp`` and ``_runtime``."""
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = _items(r.history.item)
            rows.append({k: v for k, v in row.items() if k not in ("_timestamp", "_runtime")})
    return rows


def config(records: list[Any]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for r in records:
        kind = r.WhichOneof("record_type")
        if kind in ("run", "config"):
            merged.update(_items((r.run.config if kind == "run" else r.config).update))
    merged.pop("_wandb", None)
    return merged


def run_files(run_dir: Path, run_id: str, *, wait_s: float = 30.0) -> list[Path]:
    """The ``.wandb`` files of ``run_id`` in the order the runs started, each once it
    holds its ``exit`` record. W&B's service process writes the offline file on its own:
    now and then ``run.finish()`` returns while the file still holds only its 7-byte
    header, and the records land moments later, so each file is polled (up to ``wait_s``
    seconds; after that it is read as it is and the caller's checks report what is missing)."""
    paths = list((run_dir / "wandb").glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb"))
    deadline = time.monotonic() + wait_s
    for path in paths:
        while time.monotonic() < deadline and not _finished(path):
            time.sleep(0.05)

    def started(path: Path) -> tuple[int, int]:
        run = next(r.run for r in read_records(path) if r.WhichOneof("record_type") == "run")
        return run.start_time.seconds, run.start_time.nanos

    return sorted(paths, key=started)


def _finished(path: Path) -> bool:
    try:
        return any(r.WhichOneof("record_type") == "exit" for r in read_records(path))
    except AssertionError:  # a chunk still being written fails its crc
        return False
