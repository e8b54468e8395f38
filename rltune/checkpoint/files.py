"""Low-level pieces of the checkpoint store (:mod:`rltune.checkpoint.store`): what a
checkpoint's ``meta`` and tensors must be to be written, a file's sha256, and making a
rename durable."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

_HASH_CHUNK = 1 << 20


def check_json(value: Any, *, where: str) -> Any:
    """Return ``value`` unchanged if ``json.dumps`` can write it and JSON keeps its meaning.

    Allowed: None, bool, int, float (inf/nan included), str, list/tuple of those, dicts
    with str or int keys. Raises TypeError naming the offending entry (``where`` is the
    path printed for the top level).
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_json(item, where=f"{where}[{i}]")
        return value
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise TypeError(f"{where} has key {key!r} of type {type(key).__name__}; JSON needs str or int keys")
            check_json(item, where=f"{where}[{key!r}]")
        return value
    raise TypeError(f"{where} is a {type(value).__name__}, which JSON cannot hold; store tensors in `tensors`")


def storable(state: Mapping[str, torch.Tensor], *, stem: str) -> dict[str, torch.Tensor]:
    """CPU, contiguous, one storage per key: what ``safetensors.save_file`` accepts.

    Tied weights (two keys, one storage) are refused by safetensors; the second key
    gets its own copy, so both keys are saved and a strict ``load_state_dict`` finds them.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, value in state.items():
        if not isinstance(key, str):
            raise TypeError(f"tensors[{stem!r}] has key {key!r}; safetensors needs str keys")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"tensors[{stem!r}][{key!r}] is a {type(value).__name__}, not a torch.Tensor")
        tensor = value.detach().to("cpu").contiguous()
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen:
            tensor = tensor.clone()
        elif ptr != 0:  # empty tensors have no storage to share
            seen.add(ptr)
        out[key] = tensor
    return out


def sha256(path: Path, *, fsync: bool = False) -> str:
    """The sha256 of file ``path`` (hex); ``fsync``: flush it to disk first."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        if fsync:
            os.fsync(fd)
        while chunk := os.read(fd, _HASH_CHUNK):
            digest.update(chunk)
    finally:
        os.close(fd)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file inside ``path`` durable (POSIX)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
