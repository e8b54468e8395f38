"""A damaged model directory ends ``rltune train`` with one line that names the damaged
file and what is wrong with it (exit 2), before any training and without transformers'
own reports printed ahead of it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from rltune.cli import main
from rltune.models.load import resolve_model

pytestmark = pytest.mark.usefixtures("keep_torch_threads")


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    """Rich wraps at the terminal width; a wide one keeps the message on one line."""
    monkeypatch.setenv("COLUMNS", "1000")


@pytest.fixture
def model_copy(tmp_path: Path) -> Path:
    """A writable copy of the builtin tiny model's directory."""
    return Path(shutil.copytree(resolve_model("builtin:tiny"), tmp_path / "model"))


def _train_fails(capsys, tmp_path: Path, model_dir: Path) -> str:
    """Run a tiny GRPO config on ``model_dir``; assert exit 2 and a one-line message with
    nothing printed before it; return that line."""
    (tmp_path / "rw.py").write_text("def one(prompt, completion, **meta):\n    return 1.0\n")
    config = {
        "name": "corrupt", "model": {"path": str(model_dir)},
        "algo": {"name": "grpo", "group_size": 2}, "data": {"train": "builtin:arith_small/train"},
        "reward": [{"fn": "rw.py:one"}], "rollout": {"max_new_tokens": 4},
        "train": {"steps": 1, "prompts_per_step": 2, "threads": 1},
        "log": {"dir": str(tmp_path / "runs"), "console": False},
    }
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump(config))
    code = main(["train", str(path)])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = (out + err).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out + err
    return lines[0]


def test_zero_byte_weights(capsys, tmp_path, model_copy):
    (model_copy / "model.safetensors").write_bytes(b"")
    line = _train_fails(capsys, tmp_path, model_copy)
    assert line == f"error: {model_copy / 'model.safetensors'}: empty (0 bytes) (header too small)"


def test_truncated_weights(capsys, tmp_path, model_copy):
    weights = model_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    line = _train_fails(capsys, tmp_path, model_copy)
    assert line.startswith(f"error: {weights}: truncated or not a safetensors file (")


def test_invalid_config_json_names_the_file_not_the_tokenizer(capsys, tmp_path, model_copy):
    (model_copy / "config.json").write_text('{"model_type": "qwen2",\n')
    line = _train_fails(capsys, tmp_path, model_copy)
    assert line.startswith(f"error: {model_copy / 'config.json'} is not valid JSON (")
    assert "line 2 column 1" in line  # the JSON error's position
    assert "tokenizer" not in line and "trust_remote_code" not in line


def test_weights_that_do_not_fit_the_config_print_no_transformers_report(capsys, tmp_path, model_copy):
    config = json.loads((model_copy / "config.json").read_text())
    config["intermediate_size"] //= 2
    (model_copy / "config.json").write_text(json.dumps(config))
    line = _train_fails(capsys, tmp_path, model_copy)
    assert f"the weights in {model_copy} do not fit its config.json" in line
    assert "model.layers.0.mlp.down_proj.weight (saved (128, 512), config (128, 256))" in line
