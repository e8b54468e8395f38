"""A LoRA rank above what the update of every adapted layer can have is refused when the
adapters are built; a rank above the bound of some layers only is not."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from rltune.config.schema import LoraConfig
from rltune.models.load import ModelLoadError, load_model
from rltune.models.lora import apply_lora, is_lora

# hidden 16; k_proj and v_proj are 8 x 16 (two KV heads of 4)
_SIZES = dict(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32)


def _base() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Qwen2Config(**_SIZES))


def test_a_rank_past_the_hidden_size_is_refused() -> None:
    with pytest.raises(ModelLoadError, match=(
            r"^model.lora.r=17 is above 16, the highest rank an update of any adapted layer can have "
            r"\(model.layers.0.self_attn.q_proj is 16 x 16\): every adapter would be over-full and cost more than "
            r"training its layer in full; set model.lora.r <= 16, or train without LoRA$")):
        apply_lora(_base(), LoraConfig(r=17))
    assert is_lora(apply_lora(_base(), LoraConfig(r=16)))  # full rank: the bound itself


def test_the_bound_is_that_of_the_named_layers() -> None:
    with pytest.raises(ModelLoadError, match=r"r=9 is above 8, .*\(model.layers.0.self_attn.k_proj is 8 x 16\)"):
        apply_lora(_base(), LoraConfig(r=9, target_modules=("k_proj", "v_proj")))
    # k_proj's bound is 8, q_proj's 16: a rank between them is over-full for k_proj only
    assert is_lora(apply_lora(_base(), LoraConfig(r=12, target_modules=("q_proj", "k_proj"))))


def test_an_moe_model_with_a_one_output_gate_keeps_the_default_rank(tiny_moe_dir: str) -> None:
    from peft.tuners.lora import LoraLayer

    model = apply_lora(load_model(tiny_moe_dir), LoraConfig())  # r = 8
    gates = [m for n, m in model.named_modules() if n.endswith("shared_expert_gate") and isinstance(m, LoraLayer)]
    assert gates and all(gate.out_features == 1 for gate in gates)  # adapted, its bound 1 < r
