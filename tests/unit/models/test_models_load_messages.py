"""Messages that blame the right file: an invalid config.json is named as such (never as a
tokenizer problem to fix with remote code), an invalid config is named with its field,
and transformers' own report is held back when the load fails."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from rltune.models.load import ModelLoadError, held_transformers_warnings, load_model, load_tokenizer
from rltune.models.reward_model import load_reward_model


@pytest.fixture
def model_dir(tiny_dir: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_dir, tmp_path / "model"))


@pytest.mark.parametrize("load", [load_tokenizer, load_model, load_reward_model])
def test_invalid_config_json_names_the_file_and_the_json_error(model_dir, load):
    (model_dir / "config.json").write_text('{"model_type": "qwen2",')
    with pytest.raises(ModelLoadError) as info:
        load(str(model_dir))
    message = str(info.value)
    assert message.startswith(f"{model_dir / 'config.json'} is not valid JSON (Expecting property name")
    assert "trust_remote_code" not in message and "tokenizer" not in message


def test_a_config_transformers_refuses_names_config_json(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] += 1  # no longer matches its `layer_types`
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=f"^{model_dir / 'config.json'} is not a valid config: .*num_hidden_layers"):
        load_tokenizer(str(model_dir))


@pytest.mark.parametrize(("key", "value"), [("num_attention_heads", 0), ("hidden_size", "64"), ("vocab_size", -1)])
def test_a_size_that_is_not_a_positive_integer_names_the_key(model_dir, key, value):
    # a head count of 0 ended in transformers' ZeroDivisionError
    config = json.loads((model_dir / "config.json").read_text())
    config[key] = value
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=rf"config.json: {key}={value!r}: each must be an integer >= 1"):
        load_model(str(model_dir))


def test_a_corrupt_weights_file_of_a_reward_model_is_named(model_dir):
    (model_dir / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=f"^{model_dir / 'model.safetensors'}: empty \\(0 bytes\\)"):
        load_reward_model(str(model_dir))


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_held_warnings_are_dropped_on_failure_and_logged_on_success():
    root = logging.getLogger("transformers")
    collect = _Collect()
    root.addHandler(collect)
    try:
        with pytest.raises(RuntimeError), held_transformers_warnings():
            logging.getLogger("transformers.modeling_utils").warning("LOAD REPORT of a failed load")
            raise RuntimeError("the load failed")
        with held_transformers_warnings() as held:
            logging.getLogger("transformers.modeling_utils").warning("a note on a good load")
            assert collect.messages == []
            held.release()
        logging.getLogger("transformers.modeling_utils").warning("after the block")
    finally:
        root.removeHandler(collect)
    assert collect.messages == ["a note on a good load", "after the block"]
