"""Grouped expert compute: equal to transformers' per-expert loop, switched on at load, and
no Python loop over experts anywhere in rltune's training or generation path."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from rltune.data.records import Prompt, SamplingParams
from rltune.models.experts import (
    IMPLEMENTATION,
    ExpertsLayoutError,
    experts_by_group,
    grouped_experts,
    use_grouped_experts,
)
from rltune.models.load import load_model, load_tokenizer
from rltune.models.tiny import TINY_SPECS, build_tiny
from rltune.rollout.hf import HFGenerator

# fp32 tolerances. The grouped compute multiplies every (token, expert) row by the same
# weights as the loop, so outputs differ only where BLAS blocks a dot product of H=64 or
# I=32 terms differently (a few ulps, eps = 1.2e-7); gradients additionally sum the
# per-row terms of a weight gradient or of a token's gradient in another order (at most
# N*k = 120 terms here). 1e-5 of each tensor's largest magnitude is ~80 ulps: far above
# reordering noise, far below any real error (a wrong expert, weight or slot moves
# entries by O(1) of the tensor's scale).
RTOL = 1e-5

ARCHS = {
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeExperts, "moe_intermediate_size"),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeExperts, "moe_intermediate_size"),
    "mixtral": (MixtralConfig, MixtralExperts, "intermediate_size"),
}


def _experts(arch: str, experts: int = 6) -> torch.nn.Module:
    config_cls, experts_cls, inter_key = ARCHS[arch]
    key = "num_local_experts" if arch == "mixtral" else "num_experts"
    config = config_cls(hidden_size=64, num_experts_per_tok=2, **{key: experts, inter_key: 32})
    torch.manual_seed(0)
    module = experts_cls(config)
    with torch.no_grad():
        module.gate_up_proj.normal_(0, 0.2)
        module.down_proj.normal_(0, 0.2)
    return module


def _routing(tokens: int, experts: int, k: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Random distinct top-k experts per token, expert 1 never chosen (an empty group)."""
    gen = torch.Generator().manual_seed(1)
    scores = torch.rand(tokens, experts, generator=gen)
    scores[:, 1] = -1.0
    index = scores.topk(k, dim=-1).indices
    weights = torch.rand(tokens, k, generator=gen).softmax(-1)
    return index, weights


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    gap = float((actual - expected).detach().abs().max())
    scale = float(expected.detach().abs().max())
    assert gap <= RTOL * scale, f"{what}: max gap {gap:.3e} over scale {scale:.3e}"


def _run(module: torch.nn.Module, impl: str, hidden: torch.Tensor, index: torch.Tensor,
         weights: torch.Tensor) -> list[torch.Tensor]:
    module.config._experts_implementation = impl
    module.zero_grad(set_to_none=True)
    h, w = hidden.clone().requires_grad_(True), weights.clone().requires_grad_(True)
    out = module(h, index, w)
    probe = torch.linspace(-1, 1, out.numel()).view_as(out)
    (out * probe).sum().backward()
    return [out.detach(), h.grad, w.grad, module.gate_up_proj.grad, module.down_proj.grad]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_grouped_equals_the_eager_loop(arch: str) -> None:
    module = _experts(arch)
    hidden = torch.randn(60, 64, generator=torch.Generator().manual_seed(2))
    index, weights = _routing(60, 6)
    got = _run(module, IMPLEMENTATION, hidden, index, weights)
    want = _run(module, "eager", hidden, index, weights)
    names = ["output", "d hidden", "d routing weights", "d gate_up_proj", "d down_proj"]
    for name, a, b in zip(names, got, want):
        _close(a, b, f"{arch} {name}")
    assert float(got[3][1].abs().max()) == 0.0  # the expert no token chose gets no gradient


def test_pure_function_and_grouped_core_agree() -> None:
    module = _experts("qwen3_moe")
    hidden = torch.randn(10, 64)
    index, weights = _routing(10, 6)
    out = grouped_experts(hidden, index, weights, module.gate_up_proj, module.down_proj, module.act_fn)
    # The same through the core, with the pairs grouped by hand.
    order = torch.argsort(index.reshape(-1), stable=True)
    rows = experts_by_group(hidden[order // 2], torch.bincount(index.reshape(-1), minlength=6),
                            module.gate_up_proj, module.down_proj, module.act_fn)
    pairs = torch.empty_like(rows).index_put((order,), rows * weights.reshape(-1)[order, None])
    _close(out, pairs.view(10, 2, 64).sum(1), "grouped_experts against experts_by_group")



def test_no_tokens_gives_zero_gradients_not_none() -> None:
    """A rank whose experts drew no token still reports (zero) expert gradients."""
    module = _experts("qwen3_moe")
    empty = grouped_experts(torch.randn(0, 64), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2),
                            module.gate_up_proj, module.down_proj, module.act_fn)
    assert empty.shape == (0, 64)
    empty.sum().backward()
    for weight in (module.gate_up_proj, module.down_proj):
        assert weight.grad is not None and not weight.grad.any()


def test_bad_inputs_are_named() -> None:
    module = _experts("qwen3_moe")
    hidden = torch.randn(4, 64)
    index, weights = _routing(4, 6)
    with pytest.raises(ExpertsLayoutError, match=r"expert ids in \[1, 6\] but the weights hold 6 experts"):
        grouped_experts(hidden, index.clamp(max=5) + 1, weights, module.gate_up_proj,
                        module.down_proj, module.act_fn)
    with pytest.raises(ExpertsLayoutError, match="do not fit"):
        grouped_experts(hidden, index, weights, module.down_proj, module.down_proj, module.act_fn)
    with pytest.raises(ExpertsLayoutError, match=r"sum 3\) must hold one count per expert \(6\) summing to the 4 rows"):
        experts_by_group(hidden, torch.tensor([1, 0, 2, 0, 0, 0]), module.gate_up_proj,
                         module.down_proj, module.act_fn)
    with pytest.raises(ExpertsLayoutError, match=r"top_k_index and top_k_weights \[N, k\]"):
        grouped_experts(hidden, index[:3], weights, module.gate_up_proj, module.down_proj, module.act_fn)


def test_load_switches_the_loop_and_logs_it(tiny_moe_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="rltune.models.experts"):
        model = load_model(tiny_moe_dir)
    assert model.config._experts_implementation == IMPLEMENTATION
    lines = [r.getMessage() for r in caplog.records if r.name == "rltune.models.experts"]
    assert lines == [f"experts implementation of Qwen2MoeForCausalLM: grouped_mm replaced by {IMPLEMENTATION}"]
    model.set_experts_implementation("eager")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rltune.models.experts"):
        assert use_grouped_experts(model) == IMPLEMENTATION
    assert "eager replaced by rltune_grouped" in caplog.text


class _MatmulCount(TorchDispatchMode):
    """Counts the matmul ops that reach the dispatcher (a grouped matmul is one op)."""

    OPS = {"mm", "bmm", "addmm", "matmul", "linear", "_grouped_mm", "baddbmm"}

    def __init__(self) -> None:
        super().__init__()
        self.count: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if name in self.OPS:
            self.count[name] += 1
        return func(*args, **(kwargs or {}))


def _matmuls(directory: str) -> Counter[str]:
    """Matmul ops of one forward+backward and one 3-token generation of the model as rltune
    loads it, over enough tokens that every expert is chosen."""
    model = load_model(directory)
    ids = torch.randint(4, 260, (4, 24), generator=torch.Generator().manual_seed(0))
    generator = HFGenerator(model, load_tokenizer(directory), rng=torch.Generator().manual_seed(0))
    prompts = [Prompt(id=str(i), text="", input_ids=ids[i].tolist()) for i in range(4)]
    with _MatmulCount() as counter:
        model(ids).logits.sum().backward()
        generator.generate(prompts, SamplingParams(n=1, max_new_tokens=3))
    return counter.count


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    spec = dict(TINY_SPECS["tiny-moe"], moe_intermediate_size=32)
    return {e: str(build_tiny(Path(tmp_path_factory.mktemp(f"moe{e}")), **{**spec, "num_experts": e}))
            for e in (4, 16)}


def test_no_python_loop_over_experts(moe_dirs: dict[int, str]) -> None:
    few, many = _matmuls(moe_dirs[4]), _matmuls(moe_dirs[16])
    # The loop would run one matmul pair per chosen expert and layer (forward and backward,
    # every decode step): 4x the experts would add hundreds of ops.
    assert few == many, f"matmul ops grow with the number of experts: 4 -> {dict(few)}, 16 -> {dict(many)}"
    assert few["_grouped_mm"] > 0
