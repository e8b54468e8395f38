"""LoRA checkpoints: what is saved, exact resume through the store (4 AdamW steps straight
== 2 steps, save, a freshly built and wrapped model, load, 2 steps), and the errors when
the model does not fit the checkpoint."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen2Config

from rltune.checkpoint import (
    CheckpointError,
    load_checkpoint,
    optimizer_from_state,
    optimizer_to_state,
    save_checkpoint,
)
from rltune.checkpoint.model import frozen_fingerprint, model_from_state, model_to_state, tied_keys
from rltune.config.schema import LoraConfig
from rltune.models.lora import apply_lora

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 40
IDS = torch.tensor([[3, 7, 1, 22, 9, 14], [5, 5, 30, 2, 11, 39]])
LINEARS_PER_LAYER, LAYERS = 7, 2


def _base(seed: int = 0) -> PreTrainedModel:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    return AutoModelForCausalLM.from_config(config)


def _lora(*, base_seed: int = 0, init_seed: int = 0, **cfg) -> torch.nn.Module:
    base = _base(base_seed)
    torch.manual_seed(init_seed)  # A's random init
    return apply_lora(base, LoraConfig(**{"r": 4, "dropout": 0.1, **cfg}))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    model.train()  # LoRA dropout draws from torch's global RNG
    for _ in range(steps):
        opt.zero_grad()
        logits = model(input_ids=IDS).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), IDS[:, 1:].reshape(-1))
        loss.backward()
        opt.step()


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def test_adapter_checkpoint_holds_only_the_trainable_entries() -> None:
    model = _lora(modules_to_save=("lm_head",))
    tensors, meta = model_to_state(model)
    assert len(tensors) == LAYERS * LINEARS_PER_LAYER * 2 + 1  # A and B per linear, the lm_head copy
    assert all(".lora_A." in k or ".lora_B." in k for k in tensors if "lm_head" not in k)
    assert "base_model.model.lm_head.modules_to_save.default.weight" in tensors
    assert meta["format"] == "lora-adapters" and len(meta["frozen"]) == 64
    state = model.state_dict()
    assert all(tensors[k] is state[k] or torch.equal(tensors[k], state[k]) for k in tensors)


def test_a_plain_model_saves_its_whole_state_dict() -> None:
    model = _base()
    tensors, meta = model_to_state(model)
    assert meta == {"format": "full"} and set(tensors) == set(model.state_dict())


@pytest.mark.parametrize("fmt", ["adapters", "full state_dict"])
def test_lora_resume_is_exact(tmp_path: Path, fmt: str) -> None:
    """``full state_dict`` is what a runtime that saves ``model.state_dict()`` writes, with
    no model meta: names line up with a freshly wrapped model's as well."""
    torch.manual_seed(5)
    straight = _lora()
    opt = _adamw(straight)
    _train(straight, opt, 2)
    if fmt == "adapters":
        model_tensors, model_meta = model_to_state(straight)
    else:
        model_tensors, model_meta = straight.state_dict(), None
    opt_tensors, opt_meta = optimizer_to_state(opt)
    save_checkpoint(
        tmp_path, 2, tensors={"model": model_tensors, "optimizer": opt_tensors, "rng": {"cpu": torch.get_rng_state()}},
        meta={"model": model_meta, "optimizer": opt_meta}, keep=1,
    )
    _train(straight, opt, 2)

    resumed = _lora(init_seed=123)  # other initial adapters: all of them must come from the file
    resumed_opt = _adamw(resumed)
    tensors, meta = load_checkpoint(tmp_path / "step-2")
    model_from_state(resumed, tensors["model"], meta["model"], where="step-2")
    optimizer_from_state(resumed_opt, tensors["optimizer"], meta["optimizer"])
    torch.set_rng_state(tensors["rng"]["cpu"])
    _train(resumed, resumed_opt, 2)

    want, got = straight.state_dict(), resumed.state_dict()
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert not torch.equal(want["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"],
                           _lora().state_dict()["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"])


def test_adapters_need_a_lora_model() -> None:
    tensors, meta = model_to_state(_lora())
    with pytest.raises(CheckpointError, match="ck: the checkpoint holds LoRA adapters but the model has none; set `model.lora`"):
        model_from_state(_base(), tensors, meta, where="ck")


def test_a_full_lora_state_dict_into_a_plain_model_says_to_set_lora() -> None:
    with pytest.raises(CheckpointError, match=r"ck: the saved model weights do not fit .* set `model.lora`"):
        model_from_state(_base(), _lora().state_dict(), None, where="ck")


def test_a_plain_state_dict_into_a_lora_model_says_to_unset_lora() -> None:
    with pytest.raises(CheckpointError, match=r"do not fit the model .* unset `model.lora`"):
        model_from_state(_lora(), _base().state_dict(), {"format": "full"}, where="ck")


def test_other_base_weights_under_the_adapters_are_an_error() -> None:
    tensors, meta = model_to_state(_lora(base_seed=0))
    model = _lora(base_seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="ck: the frozen base weights differ from those the adapters were trained on"):
        model_from_state(model, tensors, meta, where="ck")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # left as it was


def test_another_rank_is_an_error_naming_the_shapes() -> None:
    tensors, meta = model_to_state(_lora(r=4))
    with pytest.raises(CheckpointError, match=r"lora_A.default.weight has shape \(4, 16\) in the checkpoint but "
                       r"\(2, 16\) in the model built from the config; set `model.lora` \(its rank\)"):
        model_from_state(_lora(r=2), tensors, meta, where="ck")


def test_unknown_format_is_an_error() -> None:
    with pytest.raises(CheckpointError, match="unknown model checkpoint format 'deltas'"):
        model_from_state(_base(), {}, {"format": "deltas"}, where="ck")


def test_a_tied_weight_may_be_absent_from_a_full_checkpoint() -> None:
    source = _base(seed=3)
    tensors = dict(source.state_dict())
    del tensors["lm_head.weight"]
    model = _base(seed=4)
    assert tied_keys(model) == {"lm_head.weight"}
    model_from_state(model, tensors, None, where="ck")
    assert torch.equal(model.lm_head.weight, source.lm_head.weight)


def test_fingerprint_sees_frozen_weights_not_adapters() -> None:
    model = _lora()
    print_0 = frozen_fingerprint(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.add_(1.0)
    assert frozen_fingerprint(model) == print_0
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.get_base_model().model.layers[1].mlp.down_proj.base_layer.weight.mul_(1.5)
    assert frozen_fingerprint(other) != print_0
    halved = copy.deepcopy(model).to(torch.bfloat16)
    assert frozen_fingerprint(halved) != print_0


def test_fingerprint_of_a_tensor_past_float32s_exact_integers() -> None:
    """The sample's positions are float32: past 2**24 elements the last one rounded up to
    the element count (Qwen2.5-0.5B's 151936 x 896 embedding) and indexed past the end.
    uint8, so the buffer is 16 MB."""
    holder = torch.nn.Module()
    holder.register_buffer("big", torch.zeros(2**24 + 4, dtype=torch.uint8))
    holder.big[-1] = 7
    first = frozen_fingerprint(holder)
    holder.big[-1] = 8  # the last element is one of the sample's
    assert frozen_fingerprint(holder) != first
