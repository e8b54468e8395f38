"""Loading models and tokenizers: errors a user can act on, builtin resolution, MoE helpers."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedTokenizerFast, Qwen2Config, ViTConfig

from rltune.models.load import (
    ModelLoadError,
    is_moe,
    load_model,
    load_tokenizer,
    resolve_model,
    router_aux_loss_coef,
)
from rltune.models.tiny import build_tiny, build_tokenizer


def _write_config(directory: Path, config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_missing_path_names_path_and_fix(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match=f"{missing} does not exist.*`model.path`"):
        load_model(str(missing))
    with pytest.raises(ModelLoadError, match=f"{missing} does not exist.*`model.path`"):
        load_tokenizer(str(missing))


def test_file_instead_of_directory(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    with pytest.raises(ModelLoadError, match=f"{file} is a file, not a directory.*`model.path`"):
        load_model(str(file))


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=f"{tmp_path} has no config.json.*`model.path`"):
        load_model(str(tmp_path))


def test_remote_code_needs_permission(tmp_path: Path) -> None:
    directory = _write_config(tmp_path / "custom", {
        "model_type": "my_custom_lm",
        "auto_map": {"AutoConfig": "modeling.MyConfig", "AutoModelForCausalLM": "modeling.MyLM"},
    })
    with pytest.raises(ModelLoadError, match=f"{directory}.*'my_custom_lm'.*`model.trust_remote_code: true`"):
        load_model(str(directory))


def test_not_a_causal_lm(tmp_path: Path) -> None:
    directory = tmp_path / "vit"
    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(directory)
    with pytest.raises(ModelLoadError, match=f"{directory}.*'vit'.*not a causal language model.*`model.path`"):
        load_model(str(directory))


def test_unknown_model_type(tmp_path: Path) -> None:
    directory = _write_config(tmp_path / "odd", {"model_type": "no_such_arch"})
    with pytest.raises(ModelLoadError, match=f"does not know model_type 'no_such_arch' of {directory}"):
        load_model(str(directory))


def test_config_without_weights(tmp_path: Path) -> None:
    Qwen2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=f"{tmp_path} has a config.json but no weights"):
        load_model(str(tmp_path))


def test_incomplete_weights_are_an_error_not_random_init(tmp_path: Path) -> None:
    directory = build_tiny(tmp_path, layers=1)
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.0.mlp.down_proj.weight"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=f"{directory}.*model.layers.0.mlp.down_proj.weight"):
        load_model(str(directory))


def test_bad_dtype(tiny_dir: str) -> None:
    with pytest.raises(ModelLoadError, match="'float16'.*`model.dtype`"):
        load_model(tiny_dir, dtype="float16")


def test_loads_in_requested_dtype(tiny_dir: str) -> None:
    assert {p.dtype for p in load_model(tiny_dir).parameters()} == {torch.float32}
    assert {p.dtype for p in load_model(tiny_dir, dtype="bfloat16").parameters()} == {torch.bfloat16}


def test_tokenizer_files_missing(tmp_path: Path) -> None:
    Qwen2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=f"{tmp_path} holds no tokenizer.*tokenizer.json.*`model.path`"):
        load_tokenizer(str(tmp_path))


def test_unreadable_tokenizer_is_wrapped(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=f"{tmp_path / 'tokenizer.json'} is not valid JSON") as info:
        load_tokenizer(str(tmp_path))
    assert "trust_remote_code" not in str(info.value)


def test_tokenizer_without_pad_uses_eos_and_pads_left(tmp_path: Path) -> None:
    base = build_tokenizer()
    no_pad = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer,
                                     eos_token="<|im_end|>", padding_side="right")
    no_pad.save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert tok.pad_token == "<|im_end|>" and tok.pad_token_id == 3
    assert tok.padding_side == "left"
    batch = tok(["ab", "abcd"], padding=True)
    assert batch["input_ids"][0] == [3, 3, 4 + ord("a"), 4 + ord("b")]
    assert batch["attention_mask"][0] == [0, 0, 1, 1]


def test_tokenizer_without_pad_or_eos_is_an_error(tmp_path: Path) -> None:
    bare = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer().backend_tokenizer)
    bare.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=f"{tmp_path}.*neither a pad token nor an EOS.*pad_token"):
        load_tokenizer(str(tmp_path))


def test_resolve_model_passes_paths_through(tmp_path: Path) -> None:
    assert resolve_model("/some/model/dir", cache_dir=str(tmp_path)) == "/some/model/dir"
    assert list(tmp_path.iterdir()) == []


def test_resolve_builtin_builds_once_atomically(tmp_path: Path) -> None:
    first = Path(resolve_model("builtin:tiny", cache_dir=str(tmp_path)))
    assert first.parent == tmp_path and first.name.startswith("tiny-")
    assert (first / "config.json").is_file() and (first / "tokenizer.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temp dir left over
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert Path(resolve_model("builtin:tiny", cache_dir=str(tmp_path))) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    other_seed = Path(resolve_model("builtin:tiny", cache_dir=str(tmp_path), seed=1))
    assert other_seed != first
    a = load_file(first / "model.safetensors")
    b = load_file(other_seed / "model.safetensors")
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])
    model = load_model(str(first))
    assert type(model).__name__ == "Qwen2ForCausalLM"


def test_builtin_name_must_be_resolved_first() -> None:
    with pytest.raises(ModelLoadError, match="'builtin:tiny' names a builtin model.*resolve_model"):
        load_model("builtin:tiny")


def test_unknown_builtin(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="'builtin:huge'.*`model.path`.*builtin:tiny, builtin:tiny-moe"):
        resolve_model("builtin:huge", cache_dir=str(tmp_path))


def test_moe_helpers(tiny_dir: str, tiny_moe_dir: str) -> None:
    dense, moe = load_model(tiny_dir), load_model(tiny_moe_dir)
    assert not is_moe(dense) and is_moe(moe)
    assert router_aux_loss_coef(dense) == 0.0
    assert router_aux_loss_coef(moe) == pytest.approx(0.001)  # Qwen2-MoE's default


class _MoeWithoutCoef(torch.nn.Module):
    config = SimpleNamespace(num_local_experts=8)


def test_moe_without_coef_in_config_is_an_error() -> None:
    assert is_moe(_MoeWithoutCoef())
    with pytest.raises(ModelLoadError, match="_MoeWithoutCoef.*`model.router_aux_loss_coef`"):
        router_aux_loss_coef(_MoeWithoutCoef())
