"""Atomic checkpoints on disk: safetensors for tensors, JSON for everything else.

Layout of a checkpoint root (``runs/NAME/checkpoints``)::

    step-N/
        <stem>.safetensors   one per entry of ``tensors`` (a flat name -> tensor dict)
        <name>/...           directories written by ``shards`` (a learner group's sharded
                             state, rltune/checkpoint/sharded.py), one level deep
        state.json           ``meta``
        COMPLETE             written last: {"format": 1, "step": N, "files": {name: sha256}}
                             (a file in a directory is named ``<name>/<file>``)

A save writes every file into ``.tmp-step-N-<random>``, fsyncs the files and the
directory, renames it to ``step-N`` and only then writes ``COMPLETE`` (through its own
temp file and rename). A ``step-N`` without ``COMPLETE`` is an interrupted save (or a copy
someone made by hand): readers ignore it and the next save moves it aside to
``.skipped-step-N-no-marker`` (never deleted: it may hold the only copy of something); a
``.tmp-step-*`` dir is a save's own unfinished output and is deleted. Older checkpoints
are pruned only after the new one is complete, so a crash at any point leaves the
previous complete checkpoint loadable.

:func:`load_newest` is what a resume uses: the newest checkpoint whose files verify,
moving aside (``.skipped-step-N-corrupt``) each newer one that does not, and reporting
every checkpoint it skipped.

Saving a step that already exists complete moves the old directory aside to
``.replaced-step-N-<random>`` until the new one is complete; if the process dies in
between, ``latest_checkpoint`` returns the moved-aside copy and the next save puts it back.

One writer per root at a time (the driver); readers may run concurrently with it. A
reader that loses a race with pruning (the writer removes the checkpoint being read) gets
:class:`CheckpointRemoved`, naming the newest complete checkpoint to read instead.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from rltune.checkpoint.files import check_json
from rltune.checkpoint.files import fsync_dir as _fsync_dir
from rltune.checkpoint.files import sha256 as _sha256
from rltune.checkpoint.files import storable as _storable
from rltune.models.safetensors_io import load_tensors

MARKER = "COMPLETE"
META_FILE = "state.json"
TENSOR_SUFFIX = ".safetensors"
FORMAT_VERSION = 1

_STEP_DIR = re.compile(r"step-(\d+)")
_TMP_DIR = re.compile(r"\.tmp-step-\d+-[0-9a-f]+")
_REPLACED_DIR = re.compile(r"\.replaced-step-(\d+)-[0-9a-f]+")
_SKIPPED_PREFIX = ".skipped-"
_STEM = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


class CheckpointError(ValueError):
    """A checkpoint on disk is incomplete or corrupt, or does not fit what loads it."""


class CheckpointRemoved(CheckpointError):
    """The checkpoint was removed (pruned, or replaced by a new save of its step) by the
    process writing checkpoints while it was being read: not a corrupt one."""


# --------------------------------------------------------------------------- public API


def save_checkpoint(
    root: Path,
    step: int,
    *,
    tensors: Mapping[str, Mapping[str, torch.Tensor]],
    meta: Mapping[str, Any],
    keep: int,
    shards: Callable[[Path], tuple[Mapping[str, Mapping[str, torch.Tensor]], Mapping[str, Any]]] | None = None,
) -> Path:
    """Write ``root/step-{step}`` atomically and keep the newest ``keep`` complete ones.

    Args:
        root: checkpoint directory (created if missing).
        step: training step the state belongs to (>= 0).
        tensors: file stem -> flat state dict, each written as ``<stem>.safetensors``,
            e.g. ``{"model": model.state_dict(), "optimizer": opt_tensors}``. Tensors may
            live on any device (they are copied to CPU) and may share storage (tied
            weights are written once per key, so ``load_state_dict(strict=True)`` works).
        meta: JSON-able dict (str or int keys, lists/tuples, str/int/float/bool/None),
            written as ``state.json``.
        keep: number of complete checkpoints to keep (>= 1). The one just written is
            always kept, even when an older run left checkpoints with higher steps.
        shards: called with the checkpoint's unfinished directory before anything else
            is written there: it writes directories into it (the ranks of a sharded
            learner group each write their own files, on a filesystem they share with
            this process) and returns more ``(tensors, meta)``, merged into the others.
            Those files are checksummed in ``COMPLETE`` like the rest.

    Returns:
        The path of the new complete checkpoint.
    """
    _check_save_args(step, tensors, meta, keep)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _recover(root)
    tmp = root / f".tmp-step-{step}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        if shards is not None:
            more_tensors, more_meta = shards(tmp)
            tensors, meta = {**tensors, **more_tensors}, {**meta, **more_meta}
            _check_save_args(step, tensors, meta, keep)
        digests = _write_files(tmp, tensors, meta)
        _fsync_dir(tmp)
        final = _install(root, tmp, step)
    except BaseException:
        # Only our own half-written temp dir goes; the error itself propagates.
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_marker(final, step, digests)
    _recover(root)  # the moved-aside copy of this step (if any) is now obsolete
    _prune(root, keep=keep, current=step)
    return final


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root`` by step number, or None if none.

    Marker-less directories and temp dirs are ignored. Checksums are not verified here;
    ``load_checkpoint`` does that.
    """
    root = Path(root)
    if not root.exists():
        return None
    if not root.is_dir():
        raise CheckpointError(f"checkpoint root {root} exists but is not a directory")
    ranked = complete_checkpoints(root)
    return ranked[0] if ranked else None


def load_checkpoint(path: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """Read a complete checkpoint, verifying its marker and every file's sha256.

    Returns:
        ``(tensors, meta)``: file stem -> flat CPU state dict, and the saved ``meta``.

    Raises:
        CheckpointRemoved: the writer removed the checkpoint while it was read.
        CheckpointError: the directory is missing, has no ``COMPLETE`` marker (an
            interrupted save), or a listed file is missing or fails its checksum.
    """
    path = Path(path)
    with held_while_read(path):
        _, files = _read_marker(path)
        for name, expected in files.items():
            file = path / name
            if not file.is_file():
                raise CheckpointError(f"checkpoint {path}: {name} is listed in {MARKER} but missing")
            actual = _sha256(file)
            if actual != expected:
                raise CheckpointError(
                    f"checkpoint {path}: {name} has sha256 {actual} but {MARKER} records {expected}; "
                    "the file is corrupt or was changed after the save"
                )
        tensors = {
            name[: -len(TENSOR_SUFFIX)]: load_tensors(path / name, error=CheckpointError)
            for name in files
            if name.endswith(TENSOR_SUFFIX) and "/" not in name  # a directory's files are its writer's to read
        }
        try:
            meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
        except ValueError as err:  # its checksum matched: written so, or edited with the marker
            raise CheckpointError(f"checkpoint {path}: {META_FILE} is not valid JSON ({err})") from err
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {path}: {META_FILE} holds a {type(meta).__name__}, not an object")
    return tensors, meta


def checkpoint_step(path: Path) -> int:
    """The step a complete checkpoint's ``COMPLETE`` marker records (that of its
    ``step-N`` name, when it has one)."""
    return _read_marker(Path(path))[0]


@contextmanager
def held_while_read(path: Path) -> Iterator[None]:
    """Read checkpoint ``path`` in the body; raise :class:`CheckpointRemoved` when its
    marker vanished or changed meanwhile (the writer pruned it, or saved its step again):
    whatever the body read may then be partial or a mix. Other errors of the body pass
    through, an ``OSError`` as a CheckpointError naming the file."""
    before = _marker_bytes(path)
    try:
        yield
    except (OSError, RuntimeError, CheckpointError) as err:
        if before is not None and _marker_bytes(path) != before:
            raise CheckpointRemoved(_removed_message(path)) from err
        if isinstance(err, OSError):
            what = err.filename or path
            raise CheckpointError(f"checkpoint {path}: cannot read {what} ({err.strerror or err})") from err
        raise
    if before is not None and _marker_bytes(path) != before:
        raise CheckpointRemoved(_removed_message(path))


def _removed_message(path: Path) -> str:
    try:
        newest = latest_checkpoint(path.parent)
    except (OSError, CheckpointError):
        newest = None
    instead = f"; the newest complete checkpoint there now is {newest}" if newest is not None else ""
    return (
        f"checkpoint {path} was removed or rewritten while it was read, by the run saving checkpoints "
        f"beside it (a run keeps its newest `checkpoint.keep` and deletes older ones as it saves){instead}"
    )


@dataclass(frozen=True)
class Skipped:
    """A checkpoint a resume did not use, and where it was moved."""

    path: Path
    moved_to: Path
    reason: str


@dataclass(frozen=True)
class Loaded:
    """What :func:`load_newest` found: the checkpoint loaded (None: none there), its
    contents, and the newer or unfinished ones it skipped."""

    path: Path | None
    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    skipped: tuple[Skipped, ...] = ()


def load_newest(root: Path) -> Loaded:
    """Load the newest complete checkpoint under ``root`` whose files verify.

    Marker-less ``step-N`` dirs (an interrupted save) are moved aside first. Then the
    complete ones are tried newest first; one that fails verification (a missing file, a
    checksum mismatch, an unreadable marker) is skipped for the next older one, and
    moved aside once an older one has loaded.

    Raises:
        CheckpointError: checkpoints were there but none loads; nothing complete is
            moved then, so the user can look at them where they are.
    """
    root = Path(root)
    skipped = [
        Skipped(path, set_aside(path, "no-marker"), f"no {MARKER} marker: its save did not finish")
        for path in incomplete_checkpoints(root)
    ]
    corrupt: list[tuple[Path, str]] = []
    for path in complete_checkpoints(root):
        try:
            tensors, meta = load_checkpoint(path)
        except CheckpointRemoved:
            continue  # gone: another process prunes this root
        except CheckpointError as err:
            corrupt.append((path, str(err).removeprefix(f"checkpoint {path}: ")))
            continue
        skipped += [Skipped(bad, set_aside(bad, "corrupt"), reason) for bad, reason in corrupt]
        return Loaded(path, tensors, meta, tuple(skipped))
    if corrupt:
        raise CheckpointError(
            f"no checkpoint under {root} can be loaded: {'; '.join(f'{p.name}: {why}' for p, why in corrupt)}; "
            "continue from another copy (checkpoint.resume=PATH), or start afresh "
            "(checkpoint.resume=never checkpoint.overwrite=true moves this run aside)"
        )
    return Loaded(None, skipped=tuple(skipped))


def incomplete_checkpoints(root: Path) -> list[Path]:
    """``step-N`` dirs under ``root`` without a ``COMPLETE`` marker, newest first."""
    if not Path(root).is_dir():
        return []
    found = [(int(m[1]), entry) for entry in Path(root).iterdir()
             if (m := _STEP_DIR.fullmatch(entry.name)) and entry.is_dir() and not is_complete(entry)]
    return [entry for _, entry in sorted(found, reverse=True)]


def set_aside(path: Path, reason: str) -> Path:
    """Rename checkpoint dir ``path`` (``step-N`` or a moved-aside copy of it) to
    ``.skipped-step-N-<reason>`` beside it (``-2``, ``-3``, ... when taken). Readers and
    pruning ignore it; nothing in it is changed. Returns the new path."""
    match = _STEP_DIR.fullmatch(path.name) or _REPLACED_DIR.fullmatch(path.name)
    if match is None:
        raise ValueError(f"{path} is not a checkpoint directory (step-N)")
    base = f"{_SKIPPED_PREFIX}step-{match[1]}-{reason}"
    target, n = path.with_name(base), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{base}-{n}")
    os.replace(path, target)
    _fsync_dir(path.parent)
    return target


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, in the order :func:`latest_checkpoint` prefers
    them (newest first); checksums are not verified."""
    root = Path(root)
    if not root.is_dir():
        return []
    ranked = []
    for entry in root.iterdir():
        match = _STEP_DIR.fullmatch(entry.name) or _REPLACED_DIR.fullmatch(entry.name)
        if match and is_complete(entry):
            # a complete step-N wins over a moved-aside copy of the same step
            ranked.append(((int(match[1]), entry.name.startswith("step-")), entry))
    return [entry for _, entry in sorted(ranked, key=lambda item: item[0], reverse=True)]


# --------------------------------------------------------------------------- writing


def _check_save_args(step: int, tensors: Mapping, meta: Mapping, keep: int) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    for stem in tensors:
        if not isinstance(stem, str) or not _STEM.fullmatch(stem) or stem == MARKER:
            raise ValueError(
                f"tensors key {stem!r} is not a usable file stem: use letters, digits, '_', '.', '-', "
                f"not starting with '.' or '-', and not {MARKER!r}"
            )
    if not isinstance(meta, Mapping):
        raise TypeError(f"meta must be a dict, got {type(meta).__name__}")
    check_json(meta, where="meta")


def _write_files(tmp: Path, tensors: Mapping, meta: Mapping) -> dict[str, str]:
    """Write every tensor file and state.json into ``tmp``; fsync each; return sha256s."""
    digests: dict[str, str] = {}
    for stem, state in tensors.items():
        path = tmp / f"{stem}{TENSOR_SUFFIX}"
        save_file(_storable(state, stem=stem), str(path))
        digests[path.name] = _sha256(path, fsync=True)
    path = tmp / META_FILE
    path.write_text(json.dumps(meta, indent=1), encoding="utf-8")
    digests[path.name] = _sha256(path, fsync=True)
    for sub in sorted(p for p in tmp.iterdir() if p.is_dir()):
        for file in sorted(sub.iterdir()):
            if not file.is_file():
                raise CheckpointError(f"{file}: a checkpoint's directories hold files only, one level deep")
            digests[f"{sub.name}/{file.name}"] = _sha256(file, fsync=True)
        _fsync_dir(sub)
    return digests


def _install(root: Path, tmp: Path, step: int) -> Path:
    """Rename the finished temp dir to ``step-N``, moving a complete old one aside first."""
    final = root / f"step-{step}"
    if final.exists():  # _recover removed incomplete ones, so this one is complete
        os.replace(final, root / f".replaced-step-{step}-{secrets.token_hex(4)}")
    os.replace(tmp, final)
    _fsync_dir(root)
    return final


def _write_marker(final: Path, step: int, digests: dict[str, str]) -> None:
    payload = json.dumps({"format": FORMAT_VERSION, "step": step, "files": digests}, indent=1)
    tmp = final / f".{MARKER}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final / MARKER)
    _fsync_dir(final)


# --------------------------------------------------------------------------- cleaning


def _recover(root: Path) -> None:
    """Restore moved-aside copies whose step has no complete dir; delete debris; move
    marker-less ``step-N`` dirs aside.

    Debris: ``.tmp-step-*`` dirs and moved-aside copies made obsolete by a complete
    ``step-N``. Complete checkpoints are never touched.
    """
    for entry in sorted(root.iterdir()):
        match = _REPLACED_DIR.fullmatch(entry.name)
        if match and entry.is_dir():
            target = root / f"step-{match[1]}"
            if is_complete(entry) and not is_complete(target):
                if target.exists():
                    set_aside(target, "no-marker")
                os.replace(entry, target)
                _fsync_dir(root)
            else:
                _remove(entry)
    for entry in root.iterdir():
        if entry.is_dir() and _TMP_DIR.fullmatch(entry.name):
            _remove(entry)
    for entry in incomplete_checkpoints(root):
        set_aside(entry, "no-marker")


def _prune(root: Path, *, keep: int, current: int) -> None:
    complete = sorted(
        (int(m[1]), entry)
        for entry in root.iterdir()
        if (m := _STEP_DIR.fullmatch(entry.name)) and is_complete(entry)
    )
    kept = {step for step, _ in complete[-keep:]} | {current}
    for step, entry in complete:
        if step not in kept:
            _remove(entry)


def _remove(path: Path) -> None:
    """Delete a checkpoint dir so that a crash midway never leaves it looking complete."""
    marker = path / MARKER
    if marker.exists():
        marker.unlink()
        _fsync_dir(path)
    shutil.rmtree(path)


# --------------------------------------------------------------------------- reading


def is_complete(path: Path) -> bool:
    """Whether ``path`` is a directory with a ``COMPLETE`` marker (not verified)."""
    return path.is_dir() and (path / MARKER).is_file()


def _marker_bytes(path: Path) -> bytes | None:
    """The bytes of ``path/COMPLETE``; None when there is none (or it cannot be read)."""
    try:
        return (path / MARKER).read_bytes()
    except OSError:
        return None


def _read_marker(path: Path) -> tuple[int, dict[str, str]]:
    """Parse and check ``path/COMPLETE``; return its step and file name -> sha256."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
    raw = _marker_bytes(path)
    if raw is None:
        raise CheckpointError(_not_a_checkpoint(path))
    try:
        record = json.loads(raw.decode("utf-8"))
    except ValueError as err:  # not JSON, or not UTF-8
        raise CheckpointError(f"checkpoint {path}: {MARKER} is not valid JSON ({err})") from err
    if not isinstance(record, dict) or record.get("format") != FORMAT_VERSION or not isinstance(record.get("files"), dict):
        raise CheckpointError(
            f"checkpoint {path}: {MARKER} is not a format-{FORMAT_VERSION} marker with a 'files' table"
        )
    files = record["files"]
    for name, digest in files.items():
        parts = name.split("/")
        if (len(parts) > 2 or "\\" in name or any(not p or p.startswith(".") for p in parts)
                or not isinstance(digest, str)):
            raise CheckpointError(f"checkpoint {path}: {MARKER} lists a bad entry {name!r}: {digest!r}")
    if META_FILE not in files:
        raise CheckpointError(f"checkpoint {path}: {MARKER} does not list {META_FILE}")
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"checkpoint {path}: {MARKER} records step {step!r}, not a whole number >= 0")
    match = _STEP_DIR.fullmatch(path.name) or _REPLACED_DIR.fullmatch(path.name)
    if match and int(match[1]) != step:
        raise CheckpointError(f"checkpoint {path}: directory says step {match[1]} but {MARKER} says {step}")
    return step, files


def _not_a_checkpoint(path: Path) -> str:
    """Why directory ``path`` (without a marker) is not a checkpoint, and which one to give
    instead: a run directory (``RUN/checkpoints/step-N``), a checkpoint root, or an
    interrupted save beside complete ones."""
    if _STEP_DIR.fullmatch(path.name):
        newest = latest_checkpoint(path.parent)
        instead = f"; the newest complete one beside it is {newest}" if newest else ""
        return f"checkpoint {path} has no {MARKER} marker: the save that wrote it did not finish{instead}"
    for root, what in ((path / "checkpoints", "a run directory"), (path, "a directory of checkpoints")):
        if root.is_dir() and (newest := latest_checkpoint(root)) is not None:
            return f"checkpoint {path} is {what}, not one checkpoint; give one of its step directories, e.g. the newest, {newest}"
    return f"checkpoint {path} is not a checkpoint: it has no {MARKER} marker (a step-N directory of a run's checkpoints)"
