"""Export of a LoRA model: a plain HF directory (base names, no adapter files) whose model
computes the adapted model's logits, made without changing the training model."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rltune.checkpoint.export import export_hf
from rltune.config.schema import LoraConfig
from rltune.models.load import load_model, load_tokenizer
from rltune.models.lora import apply_lora, is_lora, merged_state_dict

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = torch.tensor([[30, 70, 11, 122, 95, 14, 3], [50, 52, 200, 2, 111, 39, 3]])
MASK = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1]])


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS, attention_mask=MASK).logits


def _adapted(tiny_path: str, **cfg) -> torch.nn.Module:
    model = apply_lora(load_model(tiny_path), LoraConfig(**{"r": 4, **cfg})).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=g) * 0.05)
    return model


CASES = {
    "all-linear": {},
    "trained lm_head copy (tied embeddings untied)": {"modules_to_save": ("lm_head",)},
    "adapted embeddings (tied embeddings untied)": {"target_modules": ("embed_tokens", "o_proj")},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_merged_export_loads_with_plain_transformers(tiny_path: str, tmp_path: Path, case: str) -> None:
    model = _adapted(tiny_path, **CASES[case])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    adapted = _logits(model)
    assert (adapted - _logits(load_model(tiny_path))).abs().max() > 1e-2  # the adapters matter

    out = export_hf(model, load_tokenizer(tiny_path), tmp_path / "export")

    assert sorted(p.name for p in out.iterdir() if "adapter" in p.name) == []
    assert set(load_file(out / "model.safetensors")) <= set(load_file(Path(tiny_path) / "model.safetensors")) | {"lm_head.weight"}
    exported = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert not is_lora(exported)
    torch.testing.assert_close(_logits(exported), adapted, atol=1e-5, rtol=0)
    # the training model: same tensors, same trainable set, adapters still on
    assert is_lora(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [n for n, p in model.named_parameters() if p.requires_grad] == trainable
    assert torch.equal(_logits(model), adapted)


def test_untied_only_when_training_made_the_tied_weights_differ(tiny_path: str, tmp_path: Path) -> None:
    tied = export_hf(_adapted(tiny_path), load_tokenizer(tiny_path), tmp_path / "tied")
    untied = export_hf(_adapted(tiny_path, modules_to_save=("lm_head",)), load_tokenizer(tiny_path), tmp_path / "untied")
    assert json.loads((tied / "config.json").read_text())["tie_word_embeddings"] is True
    assert json.loads((untied / "config.json").read_text())["tie_word_embeddings"] is False
    assert "lm_head.weight" in load_file(untied / "model.safetensors")


def test_merge_matches_peft_and_the_formula(tiny_path: str) -> None:
    """Against peft's own merge_and_unload (on a copy), and one layer against
    ``W + (alpha / r) B A`` written out."""
    model = _adapted(tiny_path, alpha=12.0)
    merged = merged_state_dict(model)
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(merged) == set(reference)
    for key in reference:
        torch.testing.assert_close(merged[key], reference[key], atol=1e-7, rtol=0)
    layer = model.get_base_model().model.layers[2].self_attn.v_proj
    a, b = layer.lora_A["default"].weight.tolist(), layer.lora_B["default"].weight.tolist()
    w = layer.base_layer.weight.tolist()
    rows = range(0, len(w), 7)  # a spread of output rows keeps the Python loops short
    expected = torch.tensor([
        [w[o][i] + 12.0 / 4 * sum(b[o][k] * a[k][i] for k in range(4)) for i in range(len(w[0]))]
        for o in rows
    ])
    got = merged["model.layers.2.self_attn.v_proj.weight"][list(rows)]
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_a_plain_model_is_exported_as_is(tiny_path: str, tmp_path: Path) -> None:
    model = load_model(tiny_path)
    out = export_hf(model, load_tokenizer(tiny_path), tmp_path / "plain")
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(out, local_files_only=True)), _logits(model))
