"""Atomic save, pruning, crash leftovers and verification of the checkpoint store."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import rltune.checkpoint.store as store
from rltune.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint


def _tensors(value: float) -> dict[str, dict[str, torch.Tensor]]:
    return {
        "model": {"w": torch.full((2, 3), value), "b": torch.arange(3, dtype=torch.float64) + value},
        "rng": {"state": torch.tensor([1, 2, 255], dtype=torch.uint8)},
    }


def _save(root: Path, step: int, *, keep: int = 3, value: float | None = None) -> Path:
    value = float(step) if value is None else value
    return save_checkpoint(root, step, tensors=_tensors(value), meta={"step": step, "value": value}, keep=keep)


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_round_trip_and_marker_records_sha256_of_every_file(tmp_path):
    path = _save(tmp_path, 7, value=1.5)
    assert path == tmp_path / "step-7"
    assert _names(path) == ["COMPLETE", "model.safetensors", "rng.safetensors", "state.json"]
    marker = json.loads((path / "COMPLETE").read_text())
    assert marker["step"] == 7
    for name in ["model.safetensors", "rng.safetensors", "state.json"]:
        assert marker["files"][name] == hashlib.sha256((path / name).read_bytes()).hexdigest()

    tensors, meta = load_checkpoint(path)
    assert meta == {"step": 7, "value": 1.5}
    expected = _tensors(1.5)
    assert tensors.keys() == expected.keys()
    for stem, state in expected.items():
        assert tensors[stem].keys() == state.keys()
        for key, value in state.items():
            assert tensors[stem][key].dtype == value.dtype
            assert torch.equal(tensors[stem][key], value)


def test_meta_keeps_floats_exactly_and_infinities(tmp_path):
    meta = {"lr": 0.1 + 0.2, "best": float("inf"), "nested": {"ids": [1, 2], "none": None}}
    _, loaded = load_checkpoint(save_checkpoint(tmp_path, 1, tensors={}, meta=meta, keep=1))
    assert loaded == meta
    assert loaded["lr"] == 0.30000000000000004


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Embedding(5, 4)
        self.b = nn.Linear(4, 5, bias=False)
        self.b.weight = self.a.weight


def test_tied_weights_save_and_load_strictly(tmp_path):
    torch.manual_seed(0)
    model = _Tied()
    transposed = {"t": torch.arange(6.0).reshape(2, 3).t(), "slice": torch.arange(10.0)[2:5]}
    path = save_checkpoint(tmp_path, 1, tensors={"model": model.state_dict(), "other": transposed}, meta={}, keep=1)
    tensors, _ = load_checkpoint(path)

    torch.manual_seed(1)
    fresh = _Tied()
    assert not torch.equal(fresh.a.weight, model.a.weight)
    fresh.load_state_dict(tensors["model"], strict=True)
    assert fresh.b.weight is fresh.a.weight
    assert torch.equal(fresh.a.weight, model.a.weight)
    assert torch.equal(tensors["other"]["t"], torch.tensor([[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]))
    assert torch.equal(tensors["other"]["slice"], torch.tensor([2.0, 3.0, 4.0]))


def test_keep_prunes_to_newest(tmp_path):
    for step in range(1, 6):
        _save(tmp_path, step, keep=2)
    assert _names(tmp_path) == ["step-4", "step-5"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-5"


def test_latest_uses_step_number_not_name_order(tmp_path):
    _save(tmp_path, 9)
    _save(tmp_path, 10)
    assert latest_checkpoint(tmp_path) == tmp_path / "step-10"
    assert latest_checkpoint(tmp_path / "missing") is None


def test_crash_leftovers_are_ignored_then_cleaned_or_moved_aside(tmp_path):
    _save(tmp_path, 2)
    # A crash while writing step 7 and a crash between rename and marker for step 9.
    (tmp_path / ".tmp-step-7-abcd").mkdir()
    (tmp_path / ".tmp-step-7-abcd" / "model.safetensors").write_bytes(b"partial")
    (tmp_path / "step-9").mkdir()
    (tmp_path / "step-9" / "state.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("not ours")

    assert latest_checkpoint(tmp_path) == tmp_path / "step-2"
    with pytest.raises(CheckpointError, match=r"step-9 has no COMPLETE marker: .*newest complete one beside it is .*step-2$"):
        load_checkpoint(tmp_path / "step-9")

    _save(tmp_path, 3)
    # the temp dir is the save's own debris; a marker-less step-N is moved aside, untouched
    assert _names(tmp_path) == [".skipped-step-9-no-marker", "notes.txt", "step-2", "step-3"]
    assert (tmp_path / ".skipped-step-9-no-marker" / "state.json").read_text() == "{}"


def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    _save(tmp_path, 1, keep=1)
    real_save_file = store.save_file
    calls = []

    def failing_save_file(tensors, filename):
        calls.append(filename)
        if len(calls) == 2:  # the first file is written, the second dies halfway
            Path(filename).write_bytes(b"half a file")
            raise OSError("disk full")
        real_save_file(tensors, filename)

    monkeypatch.setattr(store, "save_file", failing_save_file)
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, 2, keep=1)
    assert len(calls) == 2
    assert _names(tmp_path) == ["step-1"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-1"
    tensors, meta = load_checkpoint(tmp_path / "step-1")
    assert meta["step"] == 1 and torch.equal(tensors["model"]["w"], torch.full((2, 3), 1.0))


def _die_before_marker(*args, **kwargs):
    raise KeyboardInterrupt  # the process stops right after the rename


def test_crash_before_marker_keeps_previous_and_next_save_moves_it_aside(tmp_path, monkeypatch):
    _save(tmp_path, 1, keep=1)

    monkeypatch.setattr(store, "_write_marker", _die_before_marker)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 2, keep=1)
    assert _names(tmp_path) == ["step-1", "step-2"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-1"

    monkeypatch.undo()
    _save(tmp_path, 3, keep=1)
    assert _names(tmp_path) == [".skipped-step-2-no-marker", "step-3"]


def test_resaving_a_step_replaces_it(tmp_path):
    _save(tmp_path, 3, value=1.0)
    _save(tmp_path, 3, value=2.0)
    assert _names(tmp_path) == ["step-3"]
    tensors, meta = load_checkpoint(tmp_path / "step-3")
    assert meta["value"] == 2.0 and torch.equal(tensors["model"]["w"], torch.full((2, 3), 2.0))


def test_interrupted_replacement_falls_back_to_old_copy(tmp_path, monkeypatch):
    _save(tmp_path, 3, keep=1, value=1.0)
    monkeypatch.setattr(store, "_write_marker", _die_before_marker)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 3, keep=1, value=2.0)
    aside = latest_checkpoint(tmp_path)
    assert aside is not None and aside.name.startswith(".replaced-step-3-")
    assert load_checkpoint(aside)[1]["value"] == 1.0

    monkeypatch.undo()
    _save(tmp_path, 4, keep=2, value=4.0)  # the next save puts the old copy back
    # and moves the unfinished new one aside (its files are complete, only the marker is missing)
    assert _names(tmp_path) == [".skipped-step-3-no-marker", "step-3", "step-4"]
    assert load_checkpoint(tmp_path / "step-3")[1]["value"] == 1.0


def test_checksum_mismatch_is_an_error(tmp_path):
    path = _save(tmp_path, 1)
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (path / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"step-1: model.safetensors has sha256 [0-9a-f]{64} but COMPLETE"):
        load_checkpoint(path)


def test_missing_file_and_bad_marker_are_errors(tmp_path):
    path = _save(tmp_path, 1)
    (path / "rng.safetensors").unlink()
    with pytest.raises(CheckpointError, match="rng.safetensors is listed in COMPLETE but missing"):
        load_checkpoint(path)
    (path / "COMPLETE").write_text("{not json")
    with pytest.raises(CheckpointError, match="COMPLETE is not valid JSON"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "step-99")


def test_marker_step_must_match_directory(tmp_path):
    path = _save(tmp_path, 1)
    moved = path.rename(tmp_path / "step-2")
    with pytest.raises(CheckpointError, match="directory says step 2 but COMPLETE says 1"):
        load_checkpoint(moved)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"keep": 0}, ValueError, "keep must be an int >= 1"),
        ({"step": -1}, ValueError, "step must be an int >= 0"),
        ({"tensors": {"../x": {}}}, ValueError, "not a usable file stem"),
        ({"tensors": {"m": {"w": [1.0]}}}, TypeError, r"tensors\['m'\]\['w'\] is a list"),
        ({"meta": {"opt": {"lr": torch.tensor(1.0)}}}, TypeError, r"meta\['opt'\]\['lr'\] is a Tensor"),
    ],
)
def test_bad_arguments_are_rejected_before_writing(tmp_path, kwargs, error, match):
    args = {"step": 1, "tensors": _tensors(1.0), "meta": {}, "keep": 1} | kwargs
    with pytest.raises(error, match=match):
        save_checkpoint(tmp_path / "ckpt", args.pop("step"), **args)
    assert not (tmp_path / "ckpt").exists() or _names(tmp_path / "ckpt") == []


# --------------------------------------------------------------------------- load_newest


def _corrupt(path: Path) -> None:
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # one bit pattern in the last tensor's bytes: sha256 differs
    (path / "model.safetensors").write_bytes(bytes(data))


def test_load_newest_falls_back_from_corrupt_and_unfinished_checkpoints(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    _corrupt(tmp_path / "step-3")
    (tmp_path / "step-4").mkdir()  # an interrupted save
    (tmp_path / "step-4" / "state.json").write_text("{}")

    loaded = store.load_newest(tmp_path)

    assert loaded.path == tmp_path / "step-2" and loaded.meta == {"step": 2, "value": 2.0}
    assert torch.equal(loaded.tensors["model"]["w"], torch.full((2, 3), 2.0))
    assert [(s.path.name, s.moved_to.name) for s in loaded.skipped] == [
        ("step-4", ".skipped-step-4-no-marker"), ("step-3", ".skipped-step-3-corrupt"),
    ]
    assert "no COMPLETE marker" in loaded.skipped[0].reason
    assert "model.safetensors has sha256" in loaded.skipped[1].reason
    assert _names(tmp_path) == [".skipped-step-3-corrupt", ".skipped-step-4-no-marker", "step-1", "step-2"]
    assert (tmp_path / ".skipped-step-4-no-marker" / "state.json").read_text() == "{}"
    assert latest_checkpoint(tmp_path) == tmp_path / "step-2"


def test_load_newest_without_a_loadable_checkpoint(tmp_path):
    assert store.load_newest(tmp_path / "missing") == store.Loaded(None)
    (tmp_path / "step-1").mkdir()
    only_unfinished = store.load_newest(tmp_path)
    assert only_unfinished.path is None and [s.path.name for s in only_unfinished.skipped] == ["step-1"]

    _save(tmp_path, 2)
    _corrupt(tmp_path / "step-2")
    with pytest.raises(CheckpointError, match=r"no checkpoint under .* can be loaded: step-2: model.safetensors has sha256"):
        store.load_newest(tmp_path)
    assert "step-2" in _names(tmp_path)  # nothing to fall back to: left where it is


def test_set_aside_never_overwrites(tmp_path):
    for _ in range(2):
        (tmp_path / "step-5").mkdir()
        store.set_aside(tmp_path / "step-5", "no-marker")
    assert _names(tmp_path) == [".skipped-step-5-no-marker", ".skipped-step-5-no-marker-2"]


def test_a_run_or_checkpoints_directory_given_as_a_checkpoint_names_the_step_to_give(tmp_path):
    run = tmp_path / "run"
    _save(run / "checkpoints", 2)
    _save(run / "checkpoints", 5)
    newest = run / "checkpoints" / "step-5"
    with pytest.raises(CheckpointError, match=rf"{run} is a run directory, not one checkpoint; give one of its step "
                                              rf"directories, e.g. the newest, {newest}$"):
        load_checkpoint(run)
    with pytest.raises(CheckpointError, match=rf"is a directory of checkpoints, not one checkpoint; .* {newest}$"):
        load_checkpoint(run / "checkpoints")
    (tmp_path / "other").mkdir()
    with pytest.raises(CheckpointError, match=r"other is not a checkpoint: it has no COMPLETE marker"):
        load_checkpoint(tmp_path / "other")


def test_a_marker_that_is_not_utf8_is_corrupt_and_skipped_for_an_older_one(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    (tmp_path / "step-2" / "COMPLETE").write_bytes(b"\xff\xfe{")
    with pytest.raises(CheckpointError, match=r"step-2: COMPLETE is not valid JSON"):
        load_checkpoint(tmp_path / "step-2")
    loaded = store.load_newest(tmp_path)
    assert loaded.path == tmp_path / "step-1" and [s.moved_to.name for s in loaded.skipped] == [".skipped-step-2-corrupt"]


@pytest.mark.parametrize(("text", "message"), [
    ("{broken", r"state.json is not valid JSON"),
    ("[1, 2]", r"state.json holds a list, not an object"),
])
def test_a_state_file_edited_with_its_marker_is_named(tmp_path, text, message):
    # the checksum recomputed by hand: the files verify, their content does not load
    path = _save(tmp_path, 1)
    (path / "state.json").write_text(text)
    marker = json.loads((path / "COMPLETE").read_text())
    marker["files"]["state.json"] = hashlib.sha256(text.encode()).hexdigest()
    (path / "COMPLETE").write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match=rf"checkpoint {path}: {message}"):
        load_checkpoint(path)
