"""models.vision: finding a VLM's parts, freezing them, batching pixel inputs; LoRA targets."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rltune.config.schema import Config
from rltune.models.load import load_model
from rltune.models.lora import apply_lora
from rltune.models.vision import (
    VisionLayoutError,
    batch_vision_inputs,
    freeze_vision,
    image_token_ids,
    is_vision_language,
    language_model_prefix,
)
from rltune.runtime.roles import load_policy

REWARD = [{"fn": "a:b"}]


def _numel(model: nn.Module, *prefixes: str) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if n.startswith(prefixes))


def test_batch_vision_inputs_concatenates_rows_with_images_in_order() -> None:
    a = {"pixel_values": torch.tensor([[1.0], [2.0]]), "image_grid_thw": torch.tensor([[1, 1, 2]])}
    b = {"pixel_values": torch.tensor([[3.0]]), "image_grid_thw": torch.tensor([[1, 1, 1]])}
    out = batch_vision_inputs([a, None, b, a])
    assert out["pixel_values"].flatten().tolist() == [1.0, 2.0, 3.0, 1.0, 2.0]
    assert out["image_grid_thw"].tolist() == [[1, 1, 2], [1, 1, 1], [1, 1, 2]]
    assert batch_vision_inputs([None, None]) is None
    assert batch_vision_inputs([]) is None
    with pytest.raises(ValueError, match="different keys"):
        batch_vision_inputs([a, {"pixel_values": torch.zeros(1, 1)}])


def test_freeze_vision_freezes_exactly_qwen2_vl_tower_and_merger(tiny_vl_dir: str, tiny_dir: str) -> None:
    model = load_model(tiny_vl_dir)
    assert is_vision_language(model) and not is_vision_language(load_model(tiny_dir))
    vision = _numel(model, "model.visual.")  # Qwen2-VL's projector is the tower's `merger`
    assert vision > 0 and _numel(model, "model.visual.merger.") > 0
    assert freeze_vision(model) == vision
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, _ in model.named_parameters() if n.startswith("model.visual.")}
    assert freeze_vision(model) == 0  # already frozen
    assert language_model_prefix(model) == "model.language_model"
    assert image_token_ids(model) == [262, 263]


def test_freeze_vision_freezes_llava_tower_and_projector(tiny_llava_dir: str) -> None:
    model = load_model(tiny_llava_dir)
    parts = ("model.vision_tower.", "model.multi_modal_projector.")
    assert freeze_vision(model) == _numel(model, *parts) > 0
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in model.named_parameters() if not n.startswith(parts)}
    assert any(n.startswith("model.language_model.") for n in trainable)
    assert image_token_ids(model) == [260]


def test_an_unknown_layout_is_an_error_not_a_silent_no_op() -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.eyes = nn.Linear(2, 2)
            self.brain = nn.Linear(2, 2)

    with pytest.raises(VisionLayoutError, match=r"Odd has no vision tower.*\['eyes', 'brain'\].*freeze_vision: false"):
        freeze_vision(Odd())
    with pytest.raises(VisionLayoutError, match="no `language_model`.*target_modules"):
        language_model_prefix(Odd())


@pytest.mark.parametrize("directory", ["tiny_vl_dir", "tiny_llava_dir"])
def test_lora_all_linear_adapts_only_the_language_model(directory: str, request: pytest.FixtureRequest) -> None:
    pytest.importorskip("peft")
    from rltune.config.schema import LoraConfig

    base = load_model(request.getfixturevalue(directory))
    linears = {n for n, m in base.named_modules() if isinstance(m, nn.Linear)}
    expected = {n for n in linears if n.startswith("model.language_model.")}
    model = apply_lora(base, LoraConfig())
    adapted = {n.removeprefix("base_model.model.").removesuffix(".lora_A.default")
               for n, _ in model.named_modules() if n.endswith("lora_A.default")}
    assert adapted == expected and len(expected) == 4 * 7  # 4 layers x q, k, v, o, gate, up, down
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names and all("lora_" in n and ".language_model." in n for n in names)


def test_lora_named_targets_stay_in_the_language_model_unless_vision_trains(tiny_llava_dir: str) -> None:
    pytest.importorskip("peft")
    from rltune.config.schema import LoraConfig

    # CLIP's attention also has q_proj: only the language model's are adapted by default.
    model = apply_lora(load_model(tiny_llava_dir), LoraConfig(target_modules=("q_proj",)))
    adapted = [n for n, _ in model.named_modules() if n.endswith("q_proj.lora_A.default")]
    assert len(adapted) == 4 and all(".language_model." in n for n in adapted)
    everywhere = apply_lora(load_model(tiny_llava_dir), LoraConfig(target_modules=("q_proj",)),
                            language_model_only=False)
    adapted = [n for n, _ in everywhere.named_modules() if n.endswith("q_proj.lora_A.default")]
    assert len(adapted) == 4 + 2  # and the 2 CLIP layers'


def test_load_policy_applies_model_freeze_vision(tiny_vl_dir: str) -> None:
    frozen = load_policy(Config(reward=REWARD), tiny_vl_dir)
    assert {n for n, p in frozen.named_parameters() if not p.requires_grad} == {
        n for n, _ in frozen.named_parameters() if n.startswith("model.visual.")
    }
    trained = load_policy(Config(reward=REWARD, model={"freeze_vision": False}), tiny_vl_dir)
    assert all(p.requires_grad for p in trained.parameters())


def test_the_dpo_policy_freezes_its_vision_parts_too(tiny_llava_dir: str) -> None:
    from rltune.runtime.preference import load_preference_model

    model = load_preference_model(Config(algo={"name": "dpo"}), tiny_llava_dir)
    parts = ("model.vision_tower.", "model.multi_modal_projector.")
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == {
        n for n, _ in model.named_parameters() if n.startswith(parts)
    }


def _qwen2_5_vl():
    from transformers import Qwen2_5_VLConfig

    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}
    return Qwen2_5_VLConfig(
        text_config={**_TEXT, "rope_parameters": rope},
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=64, fullatt_block_indexes=[0]),
        image_token_id=290, video_token_id=291, vision_start_token_id=292, vision_end_token_id=293,
    )


def _gemma3():
    from transformers import Gemma3Config

    return Gemma3Config(
        text_config={**_TEXT, "head_dim": 16},
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=1, image_token_id=290, boi_token_id=291, eoi_token_id=292,
    )


_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300, bos_token_id=1, eos_token_id=2, pad_token_id=0)


@pytest.mark.parametrize(("config", "vision"), [
    (_qwen2_5_vl, ("model.visual.",)),
    (_gemma3, ("model.vision_tower.", "model.multi_modal_projector.")),
])
def test_freeze_vision_finds_the_parts_of_other_families(config, vision: tuple[str, ...]) -> None:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_config(config())
    assert is_vision_language(model)
    assert freeze_vision(model) == _numel(model, *vision) > 0
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == {
        n for n, _ in model.named_parameters() if n.startswith(vision)
    }
    assert language_model_prefix(model) == "model.language_model"
