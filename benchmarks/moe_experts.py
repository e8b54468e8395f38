"""MoE expert compute: transformers' per-expert Python loop (``eager``) against rltune's
grouped compute (``rltune_grouped``, :mod:`rltune.models.experts`), with transformers'
``grouped_mm`` and two other loop-free forms for reference: a padded batched matmul over
``[E, capacity, H]`` (written here) and transformers' ``batched_mm`` (one weight gather per
(token, slot): memory-bound, slow on CPU; ``--batched-mm`` adds it).

The model is a stack of ``--layers`` sparse MoE blocks (router + experts, residual between
them) of a Qwen3-MoE or Mixtral config, ``--hidden`` wide, with random router weights (a
zero router would send every token to the same experts). One measurement is the forward and
backward of the stack over ``--tokens`` tokens (loss: the output dotted with a fixed random
tensor); the figure is the median over ``--repeats`` after ``--warmup`` runs. Before timing,
every implementation's output and gradients are checked against ``eager``'s.

    .venv/bin/python benchmarks/moe_experts.py                   # Qwen3-MoE, 8/16/64 experts
    .venv/bin/python benchmarks/moe_experts.py --arch mixtral --experts 8 16
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.integrations.moe import ExpertsInterface
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from rltune.models.experts import IMPLEMENTATION

PADDED = "padded_bmm"


def padded_bmm_forward(self: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """Experts as two ``bmm`` over ``[E, capacity, H]``: rows sorted by expert and padded
    with zeros up to the busiest expert's count (the alternative to a grouped matmul)."""
    n, width = hidden.shape
    experts, k = self.gate_up_proj.shape[0], top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat[order]
    counts = torch.bincount(flat, minlength=experts)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(flat.numel()) - starts[sorted_ids]
    capacity = int(counts.max())
    padded = hidden.new_zeros(experts, capacity, width).index_put((sorted_ids, slot), hidden[order // k])
    gate, up = torch.bmm(padded, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
    out = torch.bmm(self.act_fn(gate) * up, self.down_proj.transpose(1, 2))[sorted_ids, slot]
    out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    pairs = torch.empty_like(out).index_put((order,), out)
    return pairs.view(n, k, width).sum(dim=1)


ExpertsInterface.register(PADDED, padded_bmm_forward)


class Stack(nn.Module):
    """``layers`` sparse MoE blocks with a residual connection around each."""

    def __init__(self, config: object, block: type[nn.Module], layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block(config) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def build(arch: str, experts: int, hidden: int, intermediate: int, layers: int) -> tuple[Stack, object]:
    """The stack and its config (whose ``_experts_implementation`` selects the compute)."""
    common = dict(hidden_size=hidden, num_experts_per_tok=2, hidden_act="silu")
    if arch == "mixtral":
        config = MixtralConfig(num_local_experts=experts, intermediate_size=intermediate, **common)
        block: type[nn.Module] = MixtralSparseMoeBlock
    else:
        config = Qwen3MoeConfig(num_experts=experts, moe_intermediate_size=intermediate,
                                norm_topk_prob=True, **common)
        block = Qwen3MoeSparseMoeBlock
    torch.manual_seed(0)
    model = Stack(config, block, layers)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, hidden ** -0.5)
    return model, config


def step(model: Stack, x: torch.Tensor, probe: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward and backward; the output and the gradients (input first)."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    out = model(x)
    (out * probe).sum().backward()
    return out.detach(), [x.grad, *(p.grad for p in model.parameters())]


def check(model: Stack, config: object, impl: str, x: torch.Tensor, probe: torch.Tensor) -> float:
    """The largest gap to ``eager`` over output and gradients, relative to each tensor's
    largest magnitude; raises past 1e-4 (fp32 sums in another order agree to ~1e-6)."""
    config._experts_implementation = "eager"
    ref_out, ref_grads = step(model, x, probe)
    config._experts_implementation = impl
    out, grads = step(model, x, probe)
    gap = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
              for a, b in zip([out, *grads], [ref_out, *ref_grads]))
    if gap > 1e-4:
        raise AssertionError(f"{impl}: output or gradients differ from eager by {gap:.2e} (relative)")
    return gap


def seconds(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    """Median wall seconds of ``fn`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=["qwen3_moe", "mixtral"], default="qwen3_moe")
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batched-mm", action="store_true", help="also time transformers' batched_mm")
    args = parser.parse_args()
    impls = ["eager", IMPLEMENTATION, "grouped_mm", PADDED] + (["batched_mm"] if args.batched_mm else [])
    print(f"{args.arch}, {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, "
          f"top-2, {args.tokens} tokens, fp32, {torch.get_num_threads()} threads; forward+backward")
    print(f"{'experts':>7} {'implementation':>15} {'ms':>9} {'tokens/s':>10} {'x eager':>8} {'max rel gap':>11}")
    for experts in args.experts:
        model, config = build(args.arch, experts, args.hidden, args.intermediate, args.layers)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(1, args.tokens, args.hidden, generator=gen)
        probe = torch.randn(1, args.tokens, args.hidden, generator=gen)
        base = None
        for impl in impls:
            gap = 0.0 if impl == "eager" else check(model, config, impl, x, probe)
            config._experts_implementation = impl
            t = seconds(lambda: step(model, x, probe), args.warmup, args.repeats)
            base = t if base is None else base
            print(f"{experts:>7} {impl:>15} {t * 1e3:>9.1f} {args.tokens / t:>10.0f} "
                  f"{base / t:>8.2f} {gap:>11.1e}", flush=True)


if __name__ == "__main__":
    main()
