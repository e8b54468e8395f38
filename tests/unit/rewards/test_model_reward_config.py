"""``builtin:reward_model``'s kwargs are checked when the config loads: a directory that
holds no reward model (missing, no config.json, a causal LM without a trained score head,
no tokenizer) is a RewardLoadError before anything is generated, found from its files
without loading a weight."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rltune.config.schema import RewardFnConfig
from rltune.models.load import load_tokenizer
from rltune.models.reward_model import load_reward_model
from rltune.models.tiny import TINY_SPECS, build_tiny
from rltune.rewards import model_rewards
from rltune.rewards.loading import RewardLoadError
from rltune.rewards.scorer import build_reward_fns


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny causal LM's directory (a decoder and an LM head, no score head)."""
    return Path(build_tiny(tmp_path_factory.mktemp("lm"), seed=0, **TINY_SPECS["tiny"]))


@pytest.fixture(scope="module")
def rm_dir(lm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved reward model with its tokenizer."""
    out = tmp_path_factory.mktemp("rm")
    load_reward_model(str(lm_dir), seed=3).save_pretrained(out)
    load_tokenizer(str(lm_dir)).save_pretrained(out)
    return out


@pytest.fixture(autouse=True)
def _no_weights_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checking a config never loads the model."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a reward model was loaded while the config was checked")

    monkeypatch.setattr(model_rewards, "load_reward_model", refuse)
    monkeypatch.setattr(model_rewards, "load_tokenizer", refuse)


def _build(**kwargs: object):
    return build_reward_fns([RewardFnConfig(fn="builtin:reward_model", kwargs=kwargs)])


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_reward_model_directory_is_accepted(rm_dir: Path, tmp_path: Path, monkeypatch) -> None:
    assert [rf.name for rf in _build(path=str(rm_dir))] == ["reward_model"]
    # `~` is the home directory, as when the model loads
    monkeypatch.setenv("HOME", str(tmp_path))
    _copy(rm_dir, tmp_path / "rm")
    assert [rf.name for rf in _build(path="~/rm", dtype="bfloat16", batch_size=8)] == ["reward_model"]


def test_a_causal_lm_without_a_trained_score_head_is_refused(lm_dir: Path) -> None:
    with pytest.raises(RewardLoadError, match=(
        rf"reward 'reward_model': kwargs.path '{lm_dir}' holds no trained `score` head \(a causal LM, "
        r"not a reward model\): its scores would be a random head's; train one with "
        r"algo.name=reward_model and `rltune export` it"
    )):
        _build(path=str(lm_dir))


def test_a_builtin_model_is_refused() -> None:
    with pytest.raises(RewardLoadError, match=r"kwargs.path 'builtin:tiny' names a built-in causal LM, "
                                              r"not a reward model: it has no trained `score` head"):
        _build(path="builtin:tiny")


def test_a_sharded_model_is_checked_through_its_index(rm_dir: Path, tmp_path: Path) -> None:
    sharded = _copy(rm_dir, tmp_path / "sharded")
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00001.safetensors")
    index = sharded / "model.safetensors.index.json"
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00001.safetensors"}
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(RewardLoadError, match="holds no trained `score` head"):
        _build(path=str(sharded))
    weight_map["score.weight"] = "model-00001-of-00001.safetensors"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert len(_build(path=str(sharded))) == 1


@pytest.mark.parametrize(("damage", "message"), [
    pytest.param(lambda d: (d / "config.json").unlink(),
                 r"kwargs.path '.*' has no config.json, so it is not a Hugging Face model directory",
                 id="no-config"),
    pytest.param(lambda d: (d / "config.json").write_text("{not json"),
                 r"kwargs.path '.*': config.json is not valid JSON", id="config-not-json"),
    pytest.param(lambda d: (d / "config.json").write_text("[1]"),
                 r"kwargs.path '.*': config.json holds a JSON list, not an object", id="config-a-list"),
    pytest.param(lambda d: (d / "config.json").write_text('{"model_type": "no_such_arch"}'),
                 r"kwargs.path '.*': transformers has no sequence-classification model for its "
                 r"model_type 'no_such_arch'", id="no-classifier"),
    pytest.param(lambda d: (d / "tokenizer.json").unlink(),
                 r"kwargs.path '.*' holds no tokenizer \(none of tokenizer.json", id="no-tokenizer"),
    pytest.param(lambda d: (d / "model.safetensors").write_bytes(b"\x01\x02"),
                 r".*/broken/model.safetensors: truncated or not a safetensors file", id="bad-weights"),
])
def test_a_damaged_directory_is_refused_at_load(rm_dir: Path, tmp_path: Path, damage, message: str) -> None:
    broken = _copy(rm_dir, tmp_path / "broken")
    damage(broken)
    with pytest.raises(RewardLoadError, match=r"reward 'reward_model': " + message):
        _build(path=str(broken))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"dtype": "fp16"}, r"kwargs.dtype 'fp16' is not one of \['bfloat16', 'float32'\]"),
    ({"batch_size": 0}, r"kwargs.batch_size must be a positive integer, got 0"),
    ({"scale": float("inf")}, r"kwargs.scale must be a finite number, got inf"),
])
def test_bad_settings_are_refused_at_load(rm_dir: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(RewardLoadError, match=r"reward 'reward_model': " + message):
        _build(path=str(rm_dir), **kwargs)
