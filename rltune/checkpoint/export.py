"""Writing a model as a Hugging Face directory (safetensors), atomically."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def export_hf(model, tokenizer, directory: Path) -> Path:
    """``save_pretrained`` of model and tokenizer into ``directory``, written to a temporary
    sibling first and renamed, so the directory is either the old or the new export."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
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
