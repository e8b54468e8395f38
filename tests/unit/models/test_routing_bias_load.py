"""A saved aux-free routing bias is read back by ``load_model`` (transformers' routers
have no such buffer and would drop it), so an exported MoE model routes as it trained."""

from __future__ import annotations

import logging

import pytest
import torch

from rltune.models.load import ModelLoadError, load_model
from rltune.models.routing import BIAS_BUFFER, find_routers, install_routing, restore_routing_bias

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def saved_with_bias(tiny_moe_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """builtin:tiny-moe with a bias that reorders its top-k choices, saved as an export is."""
    model = load_model(tiny_moe_dir)
    install_routing(model, aux_free_bias=0.01)
    for layer, gate in enumerate(find_routers(model)):
        # 0.3 per expert step moves a softmax probability's rank for most tokens
        gate.routing_bias.copy_(torch.arange(gate.num_experts, dtype=torch.float32) * 0.3 * (layer + 1))
    out = tmp_path_factory.mktemp("with-bias")
    model.save_pretrained(out, safe_serialization=True)
    return model, out


def _routes(model, ids: torch.Tensor) -> list[torch.Tensor]:
    x = model.model.embed_tokens(ids).reshape(-1, model.config.hidden_size)
    return [gate(x)[2] for gate in find_routers(model)]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_load_model_restores_the_saved_bias_and_routes_as_the_saved_model(saved_with_bias, tiny_moe_dir):
    saved, out = saved_with_bias
    # a handler of transformers' own logger, where its load report goes (whatever propagates)
    records, hf_logger = _Records(), logging.getLogger("transformers")
    hf_logger.addHandler(records)
    try:
        loaded = load_model(str(out))
    finally:
        hf_logger.removeHandler(records)
    gates = find_routers(loaded)
    assert all(BIAS_BUFFER in g._buffers for g in gates)
    for got, want in zip(gates, find_routers(saved), strict=True):
        assert torch.equal(got.routing_bias, want.routing_bias)
    assert not any("routing_bias" in m for m in records.messages)  # read back, so not reported as unexpected
    ids = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for got, want in zip(_routes(loaded, ids), _routes(saved, ids), strict=True):
            assert torch.equal(got, want)
        # the bias matters: the model without it routes some token otherwise
        plain = load_model(tiny_moe_dir)
        assert any(not torch.equal(a, b) for a, b in zip(_routes(plain, ids), _routes(saved, ids), strict=True))
    # a run's install keeps the values and sets its own rate
    install_routing(loaded, aux_free_bias=0.05)
    assert torch.equal(gates[0].routing_bias, find_routers(saved)[0].routing_bias)
    assert gates[0].__dict__["_rltune_rate"] == 0.05


def test_a_bias_of_the_wrong_size_is_refused_naming_the_tensor(saved_with_bias, tmp_path):
    saved, _ = saved_with_bias
    state = {k: v.clone() for k, v in saved.state_dict().items()}
    name = f"model.layers.0.mlp.gate.{BIAS_BUFFER}"
    state[name] = torch.zeros(3)
    from safetensors.torch import save_file

    import shutil

    shutil.copytree(saved_with_bias[1], tmp_path / "bad")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "bad" / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=rf"{name} should be a \[\d+\] tensor .* got \[3\]"):
        load_model(str(tmp_path / "bad"))


def test_names_that_are_not_a_router_bias_are_left_alone(tiny_moe_dir) -> None:
    model = load_model(tiny_moe_dir)
    assert restore_routing_bias(model, tiny_moe_dir, ["score.weight", "model.norm.routing_bias"]) == []
    assert not any(BIAS_BUFFER in g._buffers for g in find_routers(model))
