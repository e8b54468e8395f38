"""The ``model.lora`` section: defaults, the shapes ``target_modules`` takes, the round trip
through the resolved config, and the errors."""

from __future__ import annotations

import pytest

from rltune.config import ConfigError, dump_config, load_config
from rltune.config.schema import LoraConfig

BASE = ["algo.name=sft"]


def test_unset_by_default_and_the_defaults_when_set():
    assert load_config(None, BASE).model.lora is None
    lora = load_config(None, [*BASE, "model.lora={}"]).model.lora
    assert lora == LoraConfig(r=8, alpha=16.0, dropout=0.0, target_modules="all-linear", modules_to_save=None)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("all-linear", "all-linear"), ("q_proj", ("q_proj",)), ("[q_proj, v_proj]", ("q_proj", "v_proj"))],
)
def test_target_modules_shapes(value, expected):
    lora = load_config(None, [*BASE, f"model.lora.target_modules={value}"]).model.lora
    assert lora.target_modules == expected


def test_one_module_to_save_may_be_given_as_text():
    assert load_config(None, [*BASE, "model.lora.modules_to_save=lm_head"]).model.lora.modules_to_save == ("lm_head",)


def test_round_trip_through_the_resolved_config(tmp_path):
    cfg = load_config(None, [*BASE, "model.lora.r=4", "model.lora.target_modules=[q_proj]",
                             "model.lora.modules_to_save=[lm_head]", "model.lora.dropout=0.05"])
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.lora.target_modules=[]", "model.lora: target_modules is empty; name at least one module or use all-linear"),
        ("model.lora.modules_to_save=[]", "model.lora: modules_to_save is empty; leave it unset (null) for none"),
        ("model.lora.r=0", "model.lora.r: must be >= 1 (got 0)"),
        ("model.lora.dropout=1", "model.lora.dropout: must be < 1.0 (got 1)"),
        ("model.lora.rank=4", "unknown key `model.lora.rank`; valid keys in `model.lora`: r, alpha"),
    ],
)
def test_errors_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [*BASE, override])
    assert message in str(err.value)
