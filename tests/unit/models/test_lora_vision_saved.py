"""LoRA's ``modules_to_save`` on a vision-language model: with ``model.freeze_vision`` (the
default) the vision tower and projector stay as loaded, so naming one of them, or a
module holding them, is refused; without it they train in full like any saved module."""

from __future__ import annotations

import pytest

from rltune.config.schema import Config, LoraConfig
from rltune.models.load import ModelLoadError, load_model
from rltune.models.lora import apply_lora
from rltune.runtime.roles import load_policy

pytest.importorskip("peft")

REWARD = [{"fn": "a:b"}]


def _lora(modules_to_save: list[str], **model: object) -> Config:
    return Config(reward=REWARD, model={"lora": {"modules_to_save": modules_to_save}, **model})


def test_saving_the_projector_of_a_frozen_vision_model_is_refused(tiny_vl_dir: str) -> None:
    with pytest.raises(ModelLoadError) as err:
        load_policy(_lora(["merger"]), tiny_vl_dir)
    assert str(err.value) == (
        "model.lora.modules_to_save: 'merger' names model.visual.merger of Qwen2VLForConditionalGeneration, part of "
        "its vision tower or projector model.visual, which model.freeze_vision: true keeps fixed; name only modules "
        "of the language model, or set `model.freeze_vision: false` to train the vision parts too"
    )


def test_saving_a_module_that_holds_the_vision_parts_is_refused(tiny_llava_dir: str) -> None:
    with pytest.raises(ModelLoadError, match=r"^model.lora.modules_to_save: 'multi_modal_projector' names "
                                             r"model.multi_modal_projector of LlavaForConditionalGeneration, part of"):
        load_policy(_lora(["multi_modal_projector"]), tiny_llava_dir)
    with pytest.raises(ModelLoadError, match=r"'model' names model of LlavaForConditionalGeneration, holding its "
                                             r"vision tower or projector model.vision_tower"):
        apply_lora(load_model(tiny_llava_dir), LoraConfig(modules_to_save=("model",)))


def test_without_freeze_vision_the_saved_projector_trains(tiny_vl_dir: str) -> None:
    model = load_policy(_lora(["merger"], freeze_vision=False), tiny_vl_dir)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(".visual.merger.modules_to_save." in n for n in trained)


def test_a_saved_language_model_module_is_accepted_with_the_vision_frozen(tiny_vl_dir: str) -> None:
    model = load_policy(_lora(["lm_head"]), tiny_vl_dir)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("lm_head.modules_to_save." in n for n in trained)
    assert not any(".visual." in n for n in trained)
