"""Writing a model as a Hugging Face directory (safetensors), atomically; exporting a run's
checkpoint that way (``rltune export``)."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
from pathlib import Path

from rltune.checkpoint.model import FULL, model_from_state
from rltune.checkpoint.sharded import FORMAT as SHARDED
from rltune.checkpoint.sharded import read_full
from rltune.checkpoint.meaning import as_recorded, meaning_changes, recorded_config
from rltune.checkpoint.store import (
    CheckpointError,
    CheckpointRemoved,
    complete_checkpoints,
    held_while_read,
    is_complete,
    latest_checkpoint,
    load_checkpoint,
)
from rltune.config import load_config
from rltune.models.load import held_transformers_warnings, load_model, load_tokenizer, resolve_model
from rltune.models.lora import apply_lora, is_lora, merged_copy
from rltune.models.reward_model import load_reward_model
from rltune.models.routing import BIAS_BUFFER, find_routers, install_routing

CHECKPOINTS = "checkpoints"
"""Where a run keeps its checkpoints: ``RUN/checkpoints/step-N``."""
RUN_CONFIG = "config.yaml"
"""The resolved config a run writes into its directory."""
STAGING_PREFIX = ".rltune-export-"
"""Start of the name of the temporary directory an export is written in, beside the output
(``.rltune-export-OUT.XXXXXXXX``): one of its own, made by ``mkdtemp``, so no name the user
owns is ever written, moved or removed; one left by a killed export may be deleted."""


READ_ATTEMPTS = 5
"""How often an export without ``--checkpoint`` reads the newest checkpoint again when the
training run writing them pruned the one it was reading."""


class ExportError(ValueError):
    """A run cannot be exported: no such run directory, or an output path in the way."""


# The processor's own files besides the tokenizer's (which the tokenizer writes).
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")

logger = logging.getLogger(__name__)


def export_hf(
    model, tokenizer, directory: Path, *, processor_from: Path | None = None, replace: bool = True
) -> Path:
    """``save_pretrained`` of model and tokenizer into ``directory``, written to a temporary
    directory beside it first and renamed, so the directory is either the old or the new
    export, never a half-written one. ``processor_from``: a vision-language model's source
    directory, whose processor files (:data:`PROCESSOR_FILES`) are copied beside the model
    as they are.

    ``directory`` may be absent or an empty directory (replaced in one rename). With
    ``replace`` a directory with files (an earlier export, e.g. a resumed run's ``final``)
    is replaced too; without it that is an ExportError and nothing is touched, so files
    that appear there while the model is written are never removed. Everything temporary
    lives in one ``mkdtemp`` directory of its own (:data:`STAGING_PREFIX`) and is removed
    at the end, also after a failure.

    A model with LoRA adapters is written merged (:func:`rltune.models.lora.merged_copy`):
    a plain directory that ``AutoModelForCausalLM.from_pretrained`` (a reward model:
    ``AutoModelForSequenceClassification``) loads without peft. ``model`` itself is left
    as it was, adapters and all.

    Raises:
        ExportError: ``directory`` or one of its parents is in the way (a file, a link,
            no permission), or the write failed (e.g. the disk is full).
    """
    directory = Path(directory)
    check_output(directory, may_hold_files=replace)
    if is_lora(model):
        model = merged_copy(model)
    # its parent and name as the path means them: "." or "out/.." have no name of their own
    target = Path(os.path.abspath(directory))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{target.name}.", dir=target.parent))
    except OSError as err:
        raise ExportError(f"cannot write the export to {directory}: {err}") from err
    keep = False
    try:
        # A subdirectory, not the mkdtemp directory itself: that one is owner-only (0700),
        # and the export should have the permissions of any directory the user makes.
        new = staging / "model"
        new.mkdir()
        model.save_pretrained(new, safe_serialization=True)
        tokenizer.save_pretrained(new)
        for name in PROCESSOR_FILES if processor_from is not None else ():
            if (Path(processor_from) / name).is_file():
                shutil.copy2(Path(processor_from) / name, new / name)
        _install(new, target, aside=staging / "old", replace=replace)
    except _KeptAside:
        keep = True  # the earlier export is in there
        raise
    except OSError as err:
        raise ExportError(f"cannot write the export to {directory}: {err}; {directory} is as it was") from err
    finally:
        if not keep:
            shutil.rmtree(staging, ignore_errors=True)
    _note_routing_bias(model, directory)
    return directory


def _note_routing_bias(model, directory: Path) -> None:
    """Say where an exported MoE model's aux-free routing bias is read back and where not."""
    biased = sum(BIAS_BUFFER in gate._buffers for gate in find_routers(model)) if hasattr(model, "modules") else 0
    if biased:
        logger.warning(
            "%s holds the aux-free routing bias of %d MoE routers (*.%s): rltune's load_model "
            "reads it back, but transformers and vLLM drop it and select experts without it",
            directory, biased, BIAS_BUFFER,
        )


class _KeptAside(ExportError):
    """The earlier export was moved aside and could not be put back: the caller keeps the
    temporary directory it is in, whose path the message names."""


def _install(new: Path, directory: Path, *, aside: Path, replace: bool) -> None:
    """Rename ``new`` to ``directory``. An absent or empty ``directory`` is replaced by the
    rename itself (POSIX ``rename`` replaces an empty directory, atomically, and refuses
    one with files). A directory with files, when ``replace``, is first moved to
    ``aside`` (inside the export's own temporary directory) and moved back if the second
    rename fails."""
    try:
        os.replace(new, directory)
        return
    except OSError as err:
        if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        if not replace:
            raise ExportError(
                f"output directory {directory} received files while the model was written; "
                f"left as it is, choose a new one"
            ) from err
    os.replace(directory, aside)
    try:
        os.replace(new, directory)
    except BaseException as err:
        try:
            os.replace(aside, directory)
        except OSError as again:
            raise _KeptAside(
                f"cannot write the export to {directory} ({err}) nor put the earlier export back "
                f"({again}); the earlier export is in {aside}"
            ) from again
        raise


def check_output(directory: Path, *, may_hold_files: bool = False) -> None:
    """Refuse an output path that the export could not be written to, before anything is
    loaded: ``directory`` must be absent or a directory (empty unless ``may_hold_files``),
    not a symbolic link (the rename would replace the link, not fill its target), and
    its nearest existing parent a directory this process may write in.

    Raises:
        ExportError: naming the path in the way.
    """
    directory = Path(directory)
    if directory.is_symlink():
        raise ExportError(
            f"output directory {directory} is a symbolic link; give the directory it points to "
            f"({os.path.realpath(directory)}) or a new path"
        )
    if os.path.lexists(directory):
        if not directory.is_dir():
            raise ExportError(f"output directory {directory} is a file, not a directory; choose a new path")
        try:
            busy = any(directory.iterdir())
        except OSError as err:
            raise ExportError(
                f"output directory {directory} cannot be read ({err.strerror}); choose a new one"
            ) from err
        if busy and not may_hold_files:
            raise ExportError(f"output directory {directory} already exists and is not empty; choose a new one")
    parent = directory.absolute().parent
    while not os.path.lexists(parent) and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ExportError(
            f"output directory {directory}: {parent} is a file, not a directory; choose a path "
            f"whose parents are directories"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"output directory {directory}: no permission to write in {parent}; choose another path")


def export_run(run_dir: Path, out_dir: Path, *, checkpoint: Path | None = None) -> Path:
    """Write the model of a run's checkpoint to ``out_dir`` as a plain HF directory.

    Rebuilds the model from the run's resolved ``config.yaml`` as training built it
    (``model.path`` relative paths resolve against the working directory, as in training;
    a reward model for ``algo.name: reward_model``; LoRA adapters when ``model.lora`` is
    set), loads ``checkpoint`` or else the run's newest complete one, and writes it with
    the base model's tokenizer (merged, for LoRA). A policy run exports the policy (a
    PPO run's critic is not exported). ``out_dir`` must not exist or be empty, and must lie
    outside the run's checkpoints; it is checked before anything is loaded. A checkpoint
    of another run is refused (:func:`check_same_run`). The run may be training meanwhile:
    a newest checkpoint it prunes while it is read is replaced by the newest again; a
    ``checkpoint`` it prunes is an error saying so. Returns the checkpoint exported.

    Raises:
        ExportError: ``run_dir`` is not a run directory, or ``out_dir`` is in the way.
        CheckpointError: no complete checkpoint, one that does not fit the config, one
            written by another run, or ``checkpoint`` removed while it was read
            (:class:`~rltune.checkpoint.store.CheckpointRemoved`).
    """
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if not (run_dir / RUN_CONFIG).is_file():
        what = "does not exist" if not run_dir.exists() else f"has no {RUN_CONFIG}"
        raise ExportError(f"run directory {run_dir} {what}; pass the directory of a run (log.dir/NAME)")
    _check_outside_run(out_dir, run_dir, checkpoint)
    check_output(out_dir)
    cfg = load_config(run_dir / RUN_CONFIG)
    if checkpoint is None:
        checkpoint, (weights, model_meta, meta) = _newest_weights(run_dir)
    else:
        checkpoint = Path(checkpoint)
        weights, model_meta, meta = _checkpoint_weights(checkpoint)
    check_same_run(cfg, run_dir, checkpoint, meta)
    model_dir = resolve_model(cfg.model.path)
    model = _run_model(cfg, model_dir)
    # A checkpoint that does not record its model format holds a full state_dict.
    model_from_state(model, weights, model_meta, where=str(checkpoint))
    tokenizer = load_tokenizer(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    export_hf(model, tokenizer, out_dir, processor_from=Path(model_dir), replace=False)
    return checkpoint


def _newest_weights(run_dir: Path) -> tuple[Path, tuple[dict, dict | None, dict]]:
    """The run's newest complete checkpoint and what :func:`_checkpoint_weights` reads of
    it. A training run may prune it while it is read (it keeps ``checkpoint.keep``): then
    the newest one again, up to :data:`READ_ATTEMPTS` times. A corrupt one is an error that
    names the next older complete checkpoint, to export with ``--checkpoint``."""
    root = run_dir / CHECKPOINTS
    for _ in range(READ_ATTEMPTS):
        checkpoint = latest_checkpoint(root)
        if checkpoint is None:
            raise CheckpointError(
                f"run directory {run_dir} has no complete checkpoint under {root}; "
                f"a run writes one every `checkpoint.every` steps and at its end"
            )
        try:
            return checkpoint, _checkpoint_weights(checkpoint)
        except CheckpointRemoved:
            continue
        except CheckpointError as err:
            if not is_complete(checkpoint):  # its marker went between the listing and the read: pruned
                continue
            ranked = complete_checkpoints(root)  # newest first
            older = ranked[ranked.index(checkpoint) + 1:] if checkpoint in ranked else []
            if not older:
                raise
            raise CheckpointError(f"{err}; the next older complete checkpoint is {older[0]}: export it with "
                                  f"`--checkpoint {older[0]}`") from err
    raise CheckpointError(
        f"the newest checkpoint of {run_dir} was removed while it was read, {READ_ATTEMPTS} times: the run "
        f"writing it saves and prunes (checkpoint.keep) faster than it can be read; export again, or name a "
        f"checkpoint the run keeps with --checkpoint"
    )


def check_same_run(cfg, run_dir: Path, checkpoint: Path, meta: dict) -> None:
    """Refuse a checkpoint from outside the run's own checkpoints that another run wrote:
    its weights would go out with ``run_dir``'s config (``cfg``, which rebuilds the model)
    and tokenizer. Another run is one whose config differs from ``cfg`` in what the run
    means, by the rules a resume applies (:mod:`rltune.checkpoint.meaning`): the config the
    checkpoint recorded, or for one written before records (by an earlier rltune) the
    ``config.yaml`` of the run directory it lies in. A checkpoint with neither (copied out
    of its run) is not compared. The run's own checkpoints are its by where they lie."""
    if checkpoint.parent.resolve() == (run_dir / CHECKPOINTS).resolve():
        return
    owner = checkpoint.parent.parent if checkpoint.parent.name == CHECKPOINTS else None
    old = recorded_config(meta.get("config"), f"export of {run_dir}", checkpoint)
    whose = f"the config recorded in checkpoint {checkpoint}"
    if old is None:
        if owner is None or not (owner / RUN_CONFIG).is_file():
            return
        old, whose = load_config(owner / RUN_CONFIG), f"{owner / RUN_CONFIG}, the config of the run it lies in"
    changes = meaning_changes(old, as_recorded(cfg))
    if changes:
        other = f"; export it with its own run: `rltune export {owner} OUT --checkpoint {checkpoint}`" if owner else ""
        raise CheckpointError(
            f"checkpoint {checkpoint} was written by another run than {run_dir}: {run_dir / RUN_CONFIG} differs "
            f"from {whose} in what the run means ({'; '.join(changes)}), so its weights do not go with this "
            f"run's config and tokenizer{other}"
        )


def _run_model(cfg, model_dir: str):
    """The model the run trained, built as :func:`rltune.runtime.roles.learner_model` builds
    it, before its checkpoint is loaded: for a reward-model run a sequence classifier (the
    decoder and a ``score`` head; a causal LM has no head for the checkpoint's
    ``score.weight``), else the causal LM; with LoRA adapters as configured.

    The reward model's head is drawn with ``train.seed`` as in training: a full
    checkpoint overwrites it, but a LoRA checkpoint's fingerprint covers the frozen
    original beside the trained copy, so it must be the same draw. transformers' note that
    the head was newly initialised is dropped: the checkpoint's head replaces it."""
    from rltune.learner.preference import PREFERENCE_METHODS

    common = dict(dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code)
    method = PREFERENCE_METHODS.get(cfg.algo.name)
    if method is not None and method.scores:
        with held_transformers_warnings():  # never released: the new head's report is moot
            model = load_reward_model(model_dir, seed=cfg.train.seed, **common)
    else:
        model = load_model(model_dir, **common)
        # an MoE policy's routing bias is part of its state, as training installs it
        install_routing(model, aux_free_bias=cfg.model.moe.aux_free_bias)
    if cfg.model.lora is not None:
        model = apply_lora(model, cfg.model.lora, language_model_only=cfg.model.freeze_vision)
    return model


def _check_outside_run(out_dir: Path, run_dir: Path, checkpoint: Path | None) -> None:
    """Refuse an output inside the run's checkpoints or the checkpoint exported (the
    checkpoint store prunes and moves what is there, and a step directory holds only
    what its marker lists), and an output that is, or holds, the run directory."""
    out = out_dir.resolve()
    owned = [(run_dir / CHECKPOINTS, "the run's checkpoint directory")]
    if checkpoint is not None:
        owned.append((Path(checkpoint), "the checkpoint"))
    for path, what in owned:
        if out.is_relative_to(path.resolve()):
            raise ExportError(
                f"output directory {out_dir} is inside {what} {path}, which the checkpoint "
                f"store manages; choose a directory outside it"
            )
    if run_dir.resolve().is_relative_to(out):
        what = "is" if run_dir.resolve() == out else "holds"
        raise ExportError(f"output directory {out_dir} {what} the run directory {run_dir}; choose a new one")


def _checkpoint_weights(checkpoint: Path) -> tuple[dict, dict | None, dict]:
    """The model's tensors of a checkpoint and their format meta. A sharded checkpoint
    (a learner group's DCP shards) is read into full tensors here, in this one process,
    tensor by tensor from every rank's file (:func:`rltune.checkpoint.sharded.read_full`):
    the export holds the model once, as ``save_pretrained`` needs it anyway. Only the
    ``model`` entry is read: a PPO checkpoint's ``critic_model`` is not the policy.
    Returns the weights, their format meta and the checkpoint's whole meta."""
    with held_while_read(checkpoint):  # the shards too are read from a checkpoint the writer may prune
        tensors, meta = load_checkpoint(checkpoint)
        model_meta = meta.get("model")
        if isinstance(model_meta, dict) and model_meta.get("format") == SHARDED:
            return read_full(checkpoint / model_meta["dir"]), {"format": FULL}, meta
    if "model" not in tensors:
        raise CheckpointError(f"{checkpoint}: the checkpoint holds no model weights (no model.safetensors)")
    return tensors["model"], model_meta, meta
