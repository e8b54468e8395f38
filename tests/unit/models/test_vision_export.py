"""A trained vision-language model exports as a directory that loads with its processor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rltune.checkpoint.export import export_hf
from rltune.config.schema import LoraConfig
from rltune.models.load import load_model, load_processor
from rltune.models.lora import apply_lora


@pytest.mark.parametrize("directory", ["tiny_vl_dir", "tiny_llava_dir"])
def test_export_writes_the_processor_and_the_merged_language_model(
    directory: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    pytest.importorskip("peft")
    source = request.getfixturevalue(directory)
    model = apply_lora(load_model(source), LoraConfig())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.fill_(0.01)  # a non-zero update, so the merge changes the weights
    processor = load_processor(source)
    out = export_hf(model, processor.tokenizer, tmp_path / "final", processor_from=Path(source))
    exported, base = load_model(str(out)), load_model(source)
    assert type(load_processor(str(out))) is type(processor)
    changed = {n for n, p in exported.state_dict().items() if not torch.equal(p, base.state_dict()[n])}
    assert changed and all(n.startswith("model.language_model.") for n in changed)
