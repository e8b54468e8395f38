"""Readers beside a writer that prunes: a checkpoint removed (or saved again) while it is
read is a :class:`CheckpointRemoved` naming the newest complete one, never a raw
``FileNotFoundError`` or a "corrupt" CheckpointError; and the step a marker records is
checked against the directory's name whatever that name is."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import rltune.checkpoint.store as store
from rltune.checkpoint.store import (
    MARKER,
    CheckpointError,
    CheckpointRemoved,
    checkpoint_step,
    load_checkpoint,
    load_newest,
    save_checkpoint,
)


def _save(root: Path, step: int, *, keep: int = 3) -> Path:
    tensors = {"model": {"w": torch.full((2, 3), float(step))}, "rng": {"s": torch.arange(3)}}
    return save_checkpoint(root, step, tensors=tensors, meta={"step": step}, keep=keep)


def _prune_like_the_writer(path: Path) -> None:
    """What ``store._remove`` does: the marker first, then the directory."""
    (path / MARKER).unlink()
    shutil.rmtree(path)


@pytest.mark.parametrize("when", ["hashing", "loading tensors"])
def test_a_checkpoint_pruned_while_it_is_read_is_reported_as_removed(tmp_path, monkeypatch, when):
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    hook = "_sha256" if when == "hashing" else "load_tensors"
    original = getattr(store, hook)
    calls = []

    def prune_then_read(path, **kwargs):
        if not calls:
            calls.append(path)
            if hook == "_sha256":
                out = original(path, **kwargs)  # the first file hashed, then the writer prunes
                _prune_like_the_writer(newest)
                return out
            _prune_like_the_writer(newest)
        return original(path, **kwargs)

    monkeypatch.setattr(store, hook, prune_then_read)
    with pytest.raises(CheckpointRemoved, match=rf"checkpoint {newest} was removed or rewritten while it was read, by "
                       rf"the run saving checkpoints beside it .*the newest complete checkpoint there now is "
                       rf"{tmp_path / 'step-1'}"):
        load_checkpoint(newest)


def test_a_checkpoint_saved_again_while_it_is_read_is_reported_as_removed(tmp_path, monkeypatch):
    """The writer saving the same step again (a resume from an older checkpoint) swaps the
    directory: files read before and after the swap would mix."""
    path = _save(tmp_path, 2)
    original = store.load_tensors

    def swap_then_load(file, **kwargs):
        if file.name == "model.safetensors":
            # another step-2, other weights, its own marker
            save_checkpoint(tmp_path, 2, tensors={"model": {"w": torch.zeros(2, 3)}}, meta={"step": 2}, keep=3)
        return original(file, **kwargs)

    monkeypatch.setattr(store, "load_tensors", swap_then_load)
    with pytest.raises(CheckpointRemoved, match=f"checkpoint {path} was removed or rewritten while it was read"):
        load_checkpoint(path)


def test_a_missing_file_under_a_present_marker_is_still_corruption(tmp_path):
    """The control: nothing removed the checkpoint, so a listed file that is missing is
    the checkpoint's own fault, said as before."""
    path = _save(tmp_path, 1)
    (path / "rng.safetensors").unlink()
    with pytest.raises(CheckpointError, match="rng.safetensors is listed in COMPLETE but missing") as info:
        load_checkpoint(path)
    assert not isinstance(info.value, CheckpointRemoved)


def test_load_newest_passes_over_a_checkpoint_removed_meanwhile(tmp_path, monkeypatch):
    """Removed under a resume (another process pruning the same root): the next older one
    loads, and nothing is moved aside as corrupt."""
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    original = store._sha256

    def prune_once(path, **kwargs):
        out = original(path, **kwargs)
        if newest.exists():
            _prune_like_the_writer(newest)
        return out

    monkeypatch.setattr(store, "_sha256", prune_once)
    loaded = load_newest(tmp_path)
    assert loaded.path == tmp_path / "step-1" and loaded.skipped == ()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]


def test_checkpoint_step_is_the_marker_s(tmp_path):
    assert checkpoint_step(_save(tmp_path, 4)) == 4


@pytest.mark.parametrize("step", [-1, "2", 2.0, True, None])
def test_a_marker_whose_step_is_not_a_whole_number_is_refused(tmp_path, step):
    path = _save(tmp_path, 2)
    copy = tmp_path / "copy"  # a name that says no step: only the marker's own value is checked
    shutil.copytree(path, copy)
    marker = json.loads((copy / MARKER).read_text())
    marker["step"] = step
    (copy / MARKER).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match=rf"{copy}: COMPLETE records step {step!r}, not a whole number >= 0"):
        load_checkpoint(copy)


def test_a_moved_aside_copy_s_name_is_checked_against_its_marker(tmp_path):
    path = _save(tmp_path, 2)
    aside = tmp_path / ".replaced-step-5-0a1b2c3d"
    path.rename(aside)
    with pytest.raises(CheckpointError, match="directory says step 5 but COMPLETE says 2"):
        load_checkpoint(aside)
