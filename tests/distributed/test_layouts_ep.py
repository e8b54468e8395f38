"""Expert parallelism (``train.parallel.ep``) on ``builtin:tiny-moe``: the experts split
over two gloo processes, tokens sent to their experts by all-to-all.

1. One MoE layer: each rank's output and the gradients (its input's, its routing
   weights', and the experts' summed over the ranks) equal those of the whole experts
   module on one process, with uneven token counts (one rank routes nothing to the
   other's experts, one rank has no tokens at all).
2. Two optimizer steps of GRPO at ep=2 equal one process on the whole batch (loss, grad
   norm, every weight gathered back to the full experts).

Tolerances. Everything is fp32. (1) A token's expert output is the same per-row matmuls
on either side (rows do not mix in a matmul), summed over the same k slots in the same
order; only the grouping of rows into kernel calls differs, which can change the
kernel's blocking: ATOL 1e-6 on outputs of size ~1e-1 (a few ulps). The expert
gradients sum the same per-token products over another grouping of the tokens: ~N u
relative with N ~ 50 summands, below 1e-5 relative. (2) The group's gradient is the
same sum in another order (each rank sums its micro-batches, the ranks' sums are then
added), ~1e-7 relative; with Adam's eps 1e-3 (tests/distributed/learner_group_workers.py
ADAM_EPS) an update's slope to its gradient is <= lr/eps = 1, so parameters agree within
PARAM_ATOL = 1e-6 after two steps, while one step moves them by ~1e-3 and the two
deliberate mistakes below move them by >= 1e-4 (measured in the controls).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from rltune.learner.launch import spawn_learner_group
from rltune.models.load import load_model, resolve_model
from rltune.parallel.experts import ExpertParallelExperts, apply_expert_parallel

PARAM_ATOL = 1e-6
LAYER_ATOL = 1e-6
GRAD_RTOL = 1e-5
EP_ROWS = (10, 6)
"""Tokens per rank in the layer test (rank 1's all routed to its own experts 2, 3)."""


# ----------------------------------------------------------------------------- one layer


def layer_inputs(rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tokens into layer 0's experts: hidden states, routing (rank 1 only
    to its own experts), routing weights and the output's cotangent."""
    g = torch.Generator().manual_seed(100 + rank)
    n = EP_ROWS[rank]
    index = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(n)])
    if rank == 1:
        index = 2 + torch.stack([torch.randperm(2, generator=g) for _ in range(n)])
    return {"hidden": torch.randn(n, 128, generator=g), "index": index,
            "weights": torch.rand(n, 2, generator=g), "cotangent": torch.randn(n, 128, generator=g)}


def _layer_pass(experts: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    hidden = inputs["hidden"].clone().requires_grad_()
    weights = inputs["weights"].clone().requires_grad_()
    out = experts(hidden, inputs["index"], weights)
    (out * inputs["cotangent"]).sum().backward()
    return {"out": out.detach(), "hidden_grad": hidden.grad, "weights_grad": weights.grad}


def layer_run(model_dir: str) -> dict:
    """One rank: layer 0's experts split over ep=2; a pass on this rank's tokens, then a
    forward with no tokens on rank 1 (the exchange still pairs up)."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = load_model(model_dir)
    apply_expert_parallel(model, init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))["ep"])
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, ExpertParallelExperts)
    got = _layer_pass(experts, layer_inputs(rank))
    grads = {name: getattr(experts, name).grad.to_local().clone() for name in ("gate_up_proj", "down_proj")}
    empty = layer_inputs(0) if rank == 0 else {k: v[:0] for k, v in layer_inputs(1).items()}
    with torch.no_grad():
        alone = experts(empty["hidden"], empty["index"], empty["weights"])
    return {**got, **grads, "alone": alone, "first_expert": experts.first_expert,
            "local_shape": list(experts.gate_up_proj.to_local().shape)}


def layer_reference(model_dir: str) -> dict:
    """The whole experts module of one process on each rank's tokens; its weights'
    gradients summed over both ranks' passes."""
    experts = load_model(model_dir).model.layers[0].mlp.experts
    out = {rank: _layer_pass(experts, layer_inputs(rank)) for rank in (0, 1)}
    out["grads"] = {name: getattr(experts, name).grad.clone() for name in ("gate_up_proj", "down_proj")}
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return resolve_model("builtin:tiny-moe", cache_dir=str(tmp_path_factory.mktemp("builtin")))


@pytest.fixture(scope="module")
def layer_group(model_dir: str) -> list[dict]:
    return spawn_learner_group(2, layer_run, model_dir, backend="gloo", timeout_s=120)


def test_one_layer_matches_the_whole_experts(model_dir: str, layer_group: list[dict]) -> None:
    reference = layer_reference(model_dir)
    for rank, got in enumerate(layer_group):
        want = reference[rank]
        assert got["out"].shape == want["out"].shape == (EP_ROWS[rank], 128)
        torch.testing.assert_close(got["out"], want["out"], atol=LAYER_ATOL, rtol=0)
        torch.testing.assert_close(got["hidden_grad"], want["hidden_grad"], atol=LAYER_ATOL, rtol=0)
        torch.testing.assert_close(got["weights_grad"], want["weights_grad"], atol=LAYER_ATOL, rtol=0)
    # the experts' gradients: each rank holds its block, summed over both ranks' tokens
    for name in ("gate_up_proj", "down_proj"):
        got = torch.cat([layer_group[0][name], layer_group[1][name]])
        torch.testing.assert_close(got, reference["grads"][name], rtol=GRAD_RTOL, atol=1e-7)


def test_one_layer_with_no_tokens_on_one_rank(model_dir: str, layer_group: list[dict]) -> None:
    reference = layer_reference(model_dir)
    torch.testing.assert_close(layer_group[0]["alone"], reference[0]["out"], atol=LAYER_ATOL, rtol=0)
    assert layer_group[1]["alone"].shape == (0, 128)


def test_one_layer_keeps_its_block_of_experts(layer_group: list[dict]) -> None:
    # rank r holds experts [2r, 2r + 2) of 4: the local weights are those rows of the full ones
    for rank, got in enumerate(layer_group):
        assert got["first_expert"] == 2 * rank
        assert got["local_shape"] == [2, 512, 128]
