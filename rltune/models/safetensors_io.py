"""Reading safetensors files with an error that names the file and what is wrong with it.

safetensors reports a zero-byte, truncated or foreign file as ``SafetensorError: Error
while deserializing header: ...``, without the file's name, and its error type is none
of the ones callers catch. Every reader in rltune goes through :func:`load_tensors` (or
:func:`open_tensors`) and names the error type it raises, so a model directory gives a
``ModelLoadError`` and a checkpoint a ``CheckpointError``, both shown as one line.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open


class TensorFileError(ValueError):
    """A safetensors file that cannot be read (truncated, empty, not safetensors)."""


def bad_file_message(path: str | Path, err: Exception) -> str:
    """``PATH: truncated or not a safetensors file (REASON)`` for a file safetensors refused."""
    size = Path(path).stat().st_size if Path(path).is_file() else None
    what = "empty (0 bytes)" if size == 0 else "truncated or not a safetensors file"
    reason = str(err).removeprefix("Error while deserializing header: ")
    return f"{path}: {what} ({reason})"


@contextmanager
def open_tensors(
    path: str | Path, *, error: type[Exception] = TensorFileError, fix: str = ""
) -> Iterator[object]:
    """``safe_open(path)`` on CPU, raising ``error`` naming ``path`` (and then ``fix``, what
    to do about it) if it is not readable.

    Only opening (the header and its check that the file covers every tensor) is guarded;
    what the caller does with the handle is its own business.
    """
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except SafetensorError as err:
        raise error(bad_file_message(path, err) + (f"; {fix}" if fix else "")) from err
    with handle as f:
        yield f


def load_tensors(
    path: str | Path, *, error: type[Exception] = TensorFileError
) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``path``, on CPU; ``error`` names a bad file."""
    try:
        with open_tensors(path, error=error) as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except SafetensorError as err:  # a tensor's bytes refused after the header was read
        raise error(bad_file_message(path, err)) from err


def bad_files(directory: str | Path) -> list[str]:
    """:func:`bad_file_message` for each ``*.safetensors`` file in ``directory`` whose header
    safetensors refuses, in name order; empty when all open."""
    found = []
    for path in sorted(Path(directory).glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt", device="cpu"):
                pass
        except SafetensorError as err:
            found.append(bad_file_message(path, err))
    return found
