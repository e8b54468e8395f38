"""LoRA through peft: which parameters train, what the adapted layer computes (against the
formula written out by hand), the base model with adapters off, and errors a user can fix."""

from __future__ import annotations

import contextlib
import copy
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, Qwen2Config

from rltune.config.schema import LoraConfig, TrainConfig
from rltune.learner.optim import build_optimizer
from rltune.models.load import ModelLoadError
from rltune.models.lora import adapters_disabled, apply_lora, is_lora

VOCAB = 40
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, initializer_range=0.3,
)
CONFIGS = {
    "qwen2": lambda: Qwen2Config(**_COMMON, tie_word_embeddings=True),
    "llama": lambda: LlamaConfig(**_COMMON, tie_word_embeddings=False),
}
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
pytestmark = pytest.mark.usefixtures("one_thread")

IDS = torch.tensor([[3, 7, 1, 22, 9, 14], [5, 5, 30, 2, 11, 39]])


def _base(arch: str) -> PreTrainedModel:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIGS[arch]()).eval()


def _perturb_adapters(model: torch.nn.Module, seed: int = 1) -> None:
    """B starts at zero (the adapted model is the base); give every adapter weight a value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.copy_(torch.randn(param.shape, generator=g) * 0.2)


@pytest.fixture(params=sorted(CONFIGS))
def arch(request) -> str:
    return request.param


def test_all_linear_adapts_every_projection_but_not_lm_head(arch: str) -> None:
    model = apply_lora(_base(arch), LoraConfig(r=4))
    assert is_lora(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    prefix = "base_model.model.model.layers"
    expected = {
        f"{prefix}.{layer}.{linear}.lora_{ab}.default.weight"
        for layer in range(2) for linear in LINEARS for ab in "AB"
    }
    assert trainable == expected
    assert type(model.get_base_model().lm_head) is torch.nn.Linear  # never wrapped
    q = model.get_base_model().model.layers[0].self_attn.q_proj
    assert q.lora_A["default"].weight.shape == (4, 16) and q.lora_B["default"].weight.shape == (16, 4)
    assert torch.count_nonzero(q.lora_B["default"].weight) == 0


def test_named_targets_and_modules_to_save(arch: str) -> None:
    cfg = LoraConfig(r=2, target_modules=("q_proj", "v_proj"), modules_to_save=("lm_head",))
    model = apply_lora(_base(arch), cfg)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    adapters = {
        f"base_model.model.model.layers.{layer}.self_attn.{proj}.lora_{ab}.default.weight"
        for layer in range(2) for proj in ("q_proj", "v_proj") for ab in "AB"
    }
    assert trainable == adapters | {"base_model.model.lm_head.modules_to_save.default.weight"}


def test_fresh_adapters_compute_the_base_model_exactly(arch: str) -> None:
    base = _base(arch)
    expected = base(input_ids=IDS).logits
    model = apply_lora(copy.deepcopy(base), LoraConfig(r=4, alpha=32.0))
    assert torch.equal(model(input_ids=IDS).logits, expected)  # B = 0 adds exact zeros


def test_adapted_layer_is_w_x_plus_alpha_over_r_b_a_x(arch: str) -> None:
    model = apply_lora(_base(arch), LoraConfig(r=4, alpha=6.0))
    _perturb_adapters(model)
    layer = model.get_base_model().model.layers[1].mlp.up_proj
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    w = layer.base_layer.weight.detach()
    a, b = layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach()
    expected = torch.zeros(3, 24)
    for row in range(3):  # W x + (alpha / r) * B (A x), one row at a time
        ax = [sum(float(a[k, i]) * float(x[row, i]) for i in range(16)) for k in range(4)]
        for o in range(24):
            wx = sum(float(w[o, i]) * float(x[row, i]) for i in range(16))
            expected[row, o] = wx + 6.0 / 4 * sum(float(b[o, k]) * ax[k] for k in range(4))
    torch.testing.assert_close(layer(x).detach(), expected, atol=1e-5, rtol=0)


def test_adapters_disabled_is_the_base_model_bitwise(arch: str) -> None:
    base = _base(arch)
    expected = base(input_ids=IDS).logits
    model = apply_lora(copy.deepcopy(base), LoraConfig(r=4, modules_to_save=("lm_head",)))
    _perturb_adapters(model)
    adapted = model(input_ids=IDS).logits
    assert (adapted - expected).abs().max() > 1e-2
    with adapters_disabled(model):
        assert torch.equal(model(input_ids=IDS).logits, expected)
    assert torch.equal(model(input_ids=IDS).logits, adapted)  # back on after the context


def test_adapters_come_back_on_after_an_error() -> None:
    model = apply_lora(_base("qwen2"), LoraConfig(r=2))
    _perturb_adapters(model)
    adapted = model(input_ids=IDS).logits
    with pytest.raises(RuntimeError, match="inside"), adapters_disabled(model):
        raise RuntimeError("inside")
    assert torch.equal(model(input_ids=IDS).logits, adapted)


def test_adapters_disabled_on_a_plain_model_changes_nothing() -> None:
    base = _base("llama")
    context = adapters_disabled(base)
    assert isinstance(context, contextlib.nullcontext)
    assert not is_lora(base)


def test_one_adamw_step_moves_only_adapters_and_first_only_b(arch: str) -> None:
    """With B = 0 the gradient of A, (alpha/r) B^T dL/dh x^T, is zero, so the first step
    moves only B; the second moves A too. Frozen weights never move."""
    model = apply_lora(_base(arch), LoraConfig(r=4))
    opt = build_optimizer(model.parameters(), TrainConfig(lr=1e-2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def step() -> None:
        opt.zero_grad()
        logits = model(input_ids=IDS).logits
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), IDS[:, 1:].reshape(-1)).backward()
        opt.step()

    step()
    after = dict(model.named_parameters())
    for name, old in before.items():
        moved = not torch.equal(after[name].detach(), old)
        assert moved == (".lora_B." in name), name
    step()
    for name, old in before.items():
        moved = not torch.equal(after[name].detach(), old)
        assert moved == (".lora_" in name), name
    assert sum(len(g["params"]) for g in opt.param_groups) == 2 * 7 * 2


def test_unknown_target_module_is_named(arch: str) -> None:
    with pytest.raises(ModelLoadError, match=r"model.lora.target_modules: \w+ForCausalLM has no module "
                       r"named 'qproj'; the names of its layers are .*q_proj"):
        apply_lora(_base(arch), LoraConfig(target_modules=("q_proj", "qproj")))
    with pytest.raises(ModelLoadError, match="model.lora.modules_to_save: .* no module named 'head'"):
        apply_lora(_base(arch), LoraConfig(modules_to_save=("head",)))


def test_a_target_lora_cannot_adapt_is_an_error() -> None:
    with pytest.raises(ModelLoadError, match="(?s)model.lora: peft cannot adapt Qwen2ForCausalLM: .*not supported"):
        apply_lora(_base("qwen2"), LoraConfig(target_modules=("self_attn",)))


def test_adapters_are_applied_once() -> None:
    model = apply_lora(_base("qwen2"), LoraConfig(r=2))
    with pytest.raises(ModelLoadError, match="already has LoRA adapters"):
        apply_lora(model, LoraConfig(r=2))


def test_missing_peft_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    base = _base("qwen2")
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` now raises ImportError
    assert not is_lora(base)
    with pytest.raises(ModelLoadError, match=r"peft package, which is not installed; .*pip install 'rltune\[lora\]'"):
        apply_lora(base, LoraConfig())
