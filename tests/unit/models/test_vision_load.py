"""Loading vision-language model directories: what a user can get wrong, and the messages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rltune.models.load import (
    ModelLoadError,
    is_vision_language_config,
    load_model,
    load_processor,
)
from rltune.models.dense_layout import supports_fastpath


def _copy(src: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "vl"))


@pytest.mark.parametrize("directory", ["tiny_vl_dir", "tiny_llava_dir"])
def test_a_vlm_directory_without_processor_files_names_them(
    directory: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    model_dir = _copy(request.getfixturevalue(directory), tmp_path)
    for name in ("preprocessor_config.json", "processor_config.json"):
        (model_dir / name).unlink(missing_ok=True)
    with pytest.raises(ModelLoadError, match=(
        f"{model_dir} holds a vision-language model but no image processor "
        r"\(none of preprocessor_config.json, processor_config.json\).*processor.save_pretrained"
    )):
        load_processor(str(model_dir))
    assert type(load_model(str(model_dir))).__name__.endswith("ForConditionalGeneration")


def test_a_damaged_processor_file_is_named(tiny_vl_dir: str, tmp_path: Path) -> None:
    model_dir = _copy(tiny_vl_dir, tmp_path)
    (model_dir / "preprocessor_config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match=f"{model_dir / 'preprocessor_config.json'} is not valid JSON"):
        load_processor(str(model_dir))


def test_a_vlm_directory_without_a_tokenizer_says_so(tiny_llava_dir: str, tmp_path: Path) -> None:
    model_dir = _copy(tiny_llava_dir, tmp_path)
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=f"{model_dir} holds no tokenizer"):
        load_processor(str(model_dir))


@pytest.mark.parametrize("directory", ["tiny_vl_dir", "tiny_llava_dir"])
def test_an_unknown_processor_class_is_named(
    directory: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    model_dir = _copy(request.getfixturevalue(directory), tmp_path)
    settings = json.loads((model_dir / "processor_config.json").read_text())
    settings["processor_class"] = "NoSuchProcessor"
    (model_dir / "processor_config.json").write_text(json.dumps(settings))
    with pytest.raises(ModelLoadError, match=f"{model_dir} names no processor class.*processor_config.json"):
        load_processor(str(model_dir))


def test_remote_code_vlm_needs_trust(tiny_vl_dir: str, tmp_path: Path) -> None:
    model_dir = _copy(tiny_vl_dir, tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(model_type="my_vlm", auto_map={"AutoModelForImageTextToText": "modeling_my.MyVLM"})
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="model_type 'my_vlm'.*needs code shipped.*trust_remote_code: true"):
        load_model(str(model_dir))


def test_which_configs_are_vision_language() -> None:
    assert is_vision_language_config({"model_type": "qwen2_vl", "vision_config": {}})
    assert is_vision_language_config({"model_type": "llava", "vision_config": {}})
    # Gemma 3's text-only checkpoints share model_type-free tables with the VLM: no vision config.
    assert not is_vision_language_config({"model_type": "gemma3"})
    assert not is_vision_language_config({"model_type": "qwen2"})
    assert is_vision_language_config({"model_type": "x", "auto_map": {"AutoModelForImageTextToText": "m.X"}})
    assert not is_vision_language_config(
        {"model_type": "x", "auto_map": {"AutoModelForImageTextToText": "m.X", "AutoModelForCausalLM": "m.Y"}}
    )


def test_the_lean_decoder_never_takes_a_vlm(tiny_vl_dir: str, tiny_llava_dir: str) -> None:
    assert not supports_fastpath(load_model(tiny_vl_dir))
    assert not supports_fastpath(load_model(tiny_llava_dir))


def test_the_layout_check_reads_a_vlm_language_models_shapes(tiny_vl_dir: str) -> None:
    from rltune.parallel.layout import Layout, layout_problems, model_config_of

    for config in (model_config_of("builtin:tiny-vl"), model_config_of(tiny_vl_dir)):
        no_plan, shapes = layout_problems(Layout(tp=3), 3, config)
        assert "tp=3 does not divide qwen2_vl_text's num_attention_heads=4, num_key_value_heads=2 (" in shapes  # 264 ids split in 3
        # the shapes are the language model's, but the plan is by the model's own type, and
        # tensor parallelism has none for a vision-language model
        assert layout_problems(Layout(tp=2), 2, config) == [no_plan.replace("tp=3", "tp=2")]
        assert "no plan for model_type 'qwen2_vl'" in no_plan
