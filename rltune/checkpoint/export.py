"""Writing a model as a Hugging Face directory (safetensors), atomically; exporting a run's
checkpoint that way (``rltune export``)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from rltune.checkpoint.model import FULL, model_from_state
from rltune.checkpoint.sharded import FORMAT as SHARDED
from rltune.checkpoint.sharded import read_full
from rltune.checkpoint.store import CheckpointError, latest_checkpoint, load_checkpoint
from rltune.config import load_config
from rltune.models.load import load_model, load_tokenizer, resolve_model
from rltune.models.lora import apply_lora, is_lora, merged_copy

CHECKPOINTS = "checkpoints"
"""Where a run keeps its checkpoints: ``RUN/checkpoints/step-N``."""
RUN_CONFIG = "config.yaml"
"""The resolved config a run writes into its directory."""


class ExportError(ValueError):
    """A run cannot be exported: no such run directory, or an output directory in the way."""


# The processor's own files besides the tokenizer's (which the tokenizer writes).
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def export_hf(model, tokenizer, directory: Path, *, processor_from: Path | None = None) -> Path:
    """``save_pretrained`` of model and tokenizer into ``directory``, written to a temporary
    sibling first and renamed, so the directory is either the old or the new export.
    ``processor_from``: a vision-language model's source directory, whose processor files
    (:data:`PROCESSOR_FILES`) are copied beside the model as they are.

    A model with LoRA adapters is written merged (:func:`rltune.models.lora.merged_copy`):
    a plain directory that ``AutoModelForCausalLM.from_pretrained`` loads without peft.
    ``model`` itself is left as it was, adapters and all.
    """
    if is_lora(model):
        model = merged_copy(model)
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for name in PROCESSOR_FILES if processor_from is not None else ():
            if (Path(processor_from) / name).is_file():
                shutil.copy2(Path(processor_from) / name, tmp / name)
        if directory.exists():
            old = directory.with_name(f".{directory.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(directory, old)
            os.replace(tmp, directory)
            shutil.rmtree(old)
        else:
            os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def export_run(run_dir: Path, out_dir: Path, *, checkpoint: Path | None = None) -> Path:
    """Write the model of a run's checkpoint to ``out_dir`` as a plain HF directory.

    Rebuilds the model from the run's resolved ``config.yaml`` (``model.path`` relative
    paths resolve against the working directory, as in training; LoRA adapters when
    ``model.lora`` is set), loads ``checkpoint`` or else the run's newest complete one,
    and writes it with the base model's tokenizer (merged, for LoRA). ``out_dir`` must not
    exist or be empty. Returns the checkpoint exported.

    Raises:
        ExportError: ``run_dir`` is not a run directory, or ``out_dir`` holds files.
        CheckpointError: no complete checkpoint, or one that does not fit the config.
    """
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if not (run_dir / RUN_CONFIG).is_file():
        what = "does not exist" if not run_dir.exists() else f"has no {RUN_CONFIG}"
        raise ExportError(f"run directory {run_dir} {what}; pass the directory of a run (log.dir/NAME)")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"output directory {out_dir} already exists and is not empty; choose a new one")
    cfg = load_config(run_dir / RUN_CONFIG)
    if checkpoint is None:
        checkpoint = latest_checkpoint(run_dir / CHECKPOINTS)
        if checkpoint is None:
            raise CheckpointError(
                f"run directory {run_dir} has no complete checkpoint under {run_dir / CHECKPOINTS}; "
                f"a run writes one every `checkpoint.every` steps and at its end"
            )
    weights, model_meta = _checkpoint_weights(Path(checkpoint))
    model_dir = resolve_model(cfg.model.path)
    model = load_model(model_dir, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code)
    if cfg.model.lora is not None:
        model = apply_lora(model, cfg.model.lora, language_model_only=cfg.model.freeze_vision)
    # A checkpoint that does not record its model format holds a full state_dict.
    model_from_state(model, weights, model_meta, where=str(checkpoint))
    tokenizer = load_tokenizer(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    export_hf(model, tokenizer, out_dir, processor_from=Path(model_dir))
    return Path(checkpoint)


def _checkpoint_weights(checkpoint: Path) -> tuple[dict, dict | None]:
    """The model's tensors of a checkpoint and their format meta. A sharded checkpoint
    (a learner group's DCP shards) is read into full tensors here, in this one process,
    tensor by tensor from every rank's file (:func:`rltune.checkpoint.sharded.read_full`):
    the export holds the model once, as ``save_pretrained`` needs it anyway."""
    tensors, meta = load_checkpoint(checkpoint)
    model_meta = meta.get("model")
    if isinstance(model_meta, dict) and model_meta.get("format") == SHARDED:
        return read_full(checkpoint / model_meta["dir"]), {"format": FULL}
    if "model" not in tensors:
        raise CheckpointError(f"{checkpoint}: the checkpoint holds no model weights (no model.safetensors)")
    return tensors["model"], model_meta
