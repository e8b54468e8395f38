"""Every reader of safetensors files names a damaged file and what is wrong with it, with
the error type its caller shows to the user in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rltune.checkpoint.store import CheckpointError, load_checkpoint, save_checkpoint
from rltune.data.records import Prompt
from rltune.learner.pair_scoring import load_or_compute_reference
from rltune.models.safetensors_io import TensorFileError, bad_files, load_tensors


def _write(path: Path) -> Path:
    save_file({"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4)}, str(path))
    return path


def test_a_good_file_is_read_whole(tmp_path):
    tensors = load_tensors(_write(tmp_path / "t.safetensors"))
    assert torch.equal(tensors["a"], torch.arange(6.0).reshape(2, 3))
    assert torch.equal(tensors["b"], torch.ones(4))


@pytest.mark.parametrize(("content", "expected"), [
    (lambda b: b"", "empty (0 bytes) (header too small)"),
    (lambda b: b[:-1], "truncated or not a safetensors file (incomplete metadata, file not fully covered)"),
    (lambda b: b[:5], "truncated or not a safetensors file (header too small)"),
    (lambda b: b"not safetensors at all", "truncated or not a safetensors file (header too large)"),
])
def test_a_bad_file_is_named_with_the_reason(tmp_path, content, expected):
    path = _write(tmp_path / "t.safetensors")
    path.write_bytes(content(path.read_bytes()))
    with pytest.raises(TensorFileError) as info:
        load_tensors(path)
    assert str(info.value) == f"{path}: {expected}"
    assert bad_files(tmp_path) == [f"{path}: {expected}"]


def test_the_caller_chooses_the_error_type(tmp_path):
    path = tmp_path / "t.safetensors"
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match=f"^{path}: empty"):
        load_tensors(path, error=CheckpointError)


def test_bad_files_lists_only_the_bad_ones(tmp_path):
    _write(tmp_path / "a.safetensors")
    (tmp_path / "b.safetensors").write_bytes(b"")
    assert bad_files(tmp_path) == [f"{tmp_path / 'b.safetensors'}: empty (0 bytes) (header too small)"]


def test_a_checkpoint_whose_tensor_file_is_damaged_after_its_checksum(tmp_path, monkeypatch):
    """The checksum catches a file changed after the save; a file written damaged (so its
    checksum matches) still gets a CheckpointError naming it."""
    import rltune.checkpoint.store as store

    real = store.save_file
    monkeypatch.setattr(store, "save_file", lambda tensors, path: Path(path).write_bytes(b"junk"))
    path = save_checkpoint(tmp_path, 1, tensors={"model": {"w": torch.ones(2)}}, meta={}, keep=1)
    monkeypatch.setattr(store, "save_file", real)
    with pytest.raises(CheckpointError, match=f"{path / 'model.safetensors'}: truncated or not a safetensors file"):
        load_checkpoint(path)


def test_a_damaged_reference_cache_says_it_can_be_deleted(tmp_path):
    cache = tmp_path / "reference_logps.safetensors"
    cache.write_bytes(b"")
    pair = Prompt(id="p", text="x", input_ids=[5, 6], meta={"chosen_ids": [7, 3], "rejected_ids": [8, 3]})
    with pytest.raises(TensorFileError) as info:
        load_or_compute_reference(cache, torch.nn.Linear(1, 1), {"train": [pair]}, 0, budget=100)
    assert str(info.value) == (
        f"{cache}: empty (0 bytes) (header too small); it only caches the reference "
        "log-probs: delete it and they are computed again"
    )
