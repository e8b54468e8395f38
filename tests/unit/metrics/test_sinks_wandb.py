"""WandbSink in offline mode: the run's ``.wandb`` file is read back record by record with
W&B's own protobuf ``Record``.

The file is a LevelDB-style log, as W&B writes it: a 7-byte header (``:W&B``, magic
0xBEE1, version 0), then 32 KiB blocks of chunks, each ``crc32 (4 bytes LE) | length
(2 bytes LE) | type (1 byte: 1 full, 2 first, 3 middle, 4 last)`` and its data, the crc
taken over the type byte and the data; a block's tail shorter than a chunk header is
zero padding."""

from __future__ import annotations

import json
import struct
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("wandb")

from wandb.proto import wandb_internal_pb2

from rltune.metrics.sinks import Sink
from rltune.metrics.wandb import RUN_ID_FILE, WandbSink

NAN, INF = float("nan"), float("inf")
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


def run_files(run_dir: Path, run_id: str) -> list[Path]:
    """The ``.wandb`` files of ``run_id`` in the order the runs started."""
    paths = list((run_dir / "wandb").glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb"))

    def started(path: Path) -> tuple[int, int]:
        run = next(r.run for r in read_records(path) if r.WhichOneof("record_type") == "run")
        return run.start_time.seconds, run.start_time.nanos

    return sorted(paths, key=started)


def test_offline_run_holds_history_histograms_and_config(tmp_path, capfd):
    sink = WandbSink(tmp_path, project="rltune-test", name="t-run", tags=("a", "b"))
    assert isinstance(sink, Sink)
    sink.log(0, {"eval/reward/mean": 0.25})
    sink.log(1, {"reward/mean": 0.5, "loss": NAN, "kl": INF, "entropy": None},
             {"length": [1.0, 3.0, NAN], "empty": [INF]})
    sink.log(2, {"reward/mean": 0.75, "loss": -0.25})
    sink.log(2, {"eval/reward/mean": 1.0})
    sink.log_config({"name": "t", "algo": {"name": "grpo"}, "train": {"betas": [0.9, 0.999]}})
    sink.close()
    sink.close()  # harmless

    assert capfd.readouterr().out == ""
    assert (tmp_path / RUN_ID_FILE).read_text() == sink.run_id + "\n"
    [path] = run_files(tmp_path, sink.run_id)
    records = read_records(path)
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name, list(run.tags)) == ("rltune-test", "t-run", ["a", "b"])

    rows = history(records)
    assert [row["_step"] for row in rows] == [0, 1, 2]
    assert rows[0] == {"_step": 0, "eval/reward/mean": 0.25}
    assert rows[2] == {"_step": 2, "reward/mean": 0.75, "loss": -0.25, "eval/reward/mean": 1.0}
    hist = {k: v for k, v in rows[1].items() if k.startswith("length/")}
    assert {k: v for k, v in rows[1].items() if not k.startswith("length/")} == {"_step": 1, "reward/mean": 0.5}
    assert hist["length/_type"] == "histogram"
    assert sum(hist["length/values"]) == 2 and hist["length/bins"][0] == 1.0 and hist["length/bins"][-1] == 3.0

    assert config(records) == {"name": "t", "algo": {"name": "grpo"}, "train": {"betas": [0.9, 0.999]}}


def test_resume_continues_the_same_run_and_a_fresh_run_gets_a_new_one(tmp_path):
    first = WandbSink(tmp_path, project="rltune-test")
    first.log(1, {"loss": 1.0})
    first.log(2, {"loss": 2.0})
    first.close()

    resumed = WandbSink(tmp_path, project="rltune-test", resume_after_step=1)
    assert resumed.run_id == first.run_id
    resumed.log(2, {"loss": 2.5})
    resumed.log(3, {"loss": 3.0})
    resumed.close()

    before, after = run_files(tmp_path, first.run_id)
    assert history(read_records(before)) == [{"_step": 1, "loss": 1.0}, {"_step": 2, "loss": 2.0}]
    assert history(read_records(after)) == [{"_step": 2, "loss": 2.5}, {"_step": 3, "loss": 3.0}]
    assert [r.run.resume for r in read_records(after) if r.WhichOneof("record_type") == "run"] == [True]

    fresh = WandbSink(tmp_path, project="rltune-test")
    fresh.close()
    assert fresh.run_id != first.run_id
    assert (tmp_path / RUN_ID_FILE).read_text() == fresh.run_id + "\n"


def test_bad_arguments_are_named(tmp_path):
    modes = r"\['offline', 'online', 'disabled'\]"
    with pytest.raises(ValueError, match=rf"WandbSink: mode must be one of {modes}, got 'local'"):
        WandbSink(tmp_path, project="p", mode="local")
    (tmp_path / RUN_ID_FILE).write_text("\n")
    with pytest.raises(ValueError, match=r"wandb-run-id: empty; it should hold the W&B run id"):
        WandbSink(tmp_path, project="p", resume_after_step=3)


def test_missing_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"pip install 'rltune\[wandb\]'"):
        WandbSink(tmp_path, project="p")
