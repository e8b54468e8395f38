"""MoE expert compute: transformers' per-expert Python loop (``eager``) against rltune's
grouped compute (``rltune_grouped``, :mod:`rltune.models.experts`), with transformers'
``grouped_mm`` and two other loop-free forms for reference: a padded batched matmul over
``[E, capacity, H]`` (written here) and transformers' ``batched_mm`` (one weight gather per
(token, slot): memory-bound, slow on CPU; ``--batched-mm`` adds it).

The model is a stack of ``--layers`` sparse MoE blocks (router + experts, residual between
them) of a Qwen3-MoE or Mixtral config, ``--hidden`` wide, with random router weights (a
zero router would send every token to the same experts). One measurement is the forward and
backward of the stack over ``--tokens`` tokens (loss: the output dotted with a fixed random
tensor); the implementations take turns, and each figure is the median over ``--repeats``
rounds after ``--warmup`` rounds, as wall time (tokens/s) and as process CPU time. Before
timing, every implementation's output and gradients are checked against ``eager``'s.

On a machine shared with other jobs, run with ``--threads 1`` and read the CPU columns:
with more threads than free cores, every matmul's parallel region waits for descheduled
threads, which charges implementations by their number of calls rather than their work.

    .venv/bin/python benchmarks/moe_experts.py --threads 1      # Qwen3-MoE, 8/16/64 experts
    .venv/bin/python benchmarks/moe_experts.py --threads 1 --arch mixtral --experts 8 16
    .venv/bin/python benchmarks/moe_experts.py --threads 1 --tokens 256 --experts 16 --batched-mm
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
    return hidden.new_zeros(n, width).index_add_(0, order // k, out)


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


def medians(fns: dict[str, Callable[[], object]], warmup: int,
            repeats: int) -> dict[str, tuple[float, float]]:
    """Median (wall, process CPU) seconds of each function after ``warmup`` untimed calls.

    The functions take turns, one call each per round, so a load change on a shared
    machine falls on all of them alike. CPU seconds are the work done whatever else runs
    on the machine (with one thread, the figure least disturbed by other processes)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {name: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t))
            for name, t in times.items()}


def timed_step(model: Stack, config: object, impl: str, x: torch.Tensor,
               probe: torch.Tensor) -> Callable[[], object]:
    """One forward and backward under ``impl`` (selected anew, as the turns alternate)."""
    def run() -> object:
        config._experts_implementation = impl
        return step(model, x, probe)
    return run


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
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--batched-mm", action="store_true", help="also time transformers' batched_mm")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    impls = ["eager", IMPLEMENTATION, "grouped_mm", PADDED] + (["batched_mm"] if args.batched_mm else [])
    print(f"{args.arch}, {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, "
          f"top-2, {args.tokens} tokens, fp32, {torch.get_num_threads()} threads; forward+backward")
    print(f"{'experts':>7} {'implementation':>15} {'wall ms':>8} {'tokens/s':>9} {'x eager':>7} "
          f"{'cpu ms':>8} {'x eager':>7} {'max rel gap':>11}")
    for experts in args.experts:
        model, config = build(args.arch, experts, args.hidden, args.intermediate, args.layers)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(1, args.tokens, args.hidden, generator=gen)
        probe = torch.randn(1, args.tokens, args.hidden, generator=gen)
        gaps = {impl: 0.0 if impl == "eager" else check(model, config, impl, x, probe) for impl in impls}
        fns = {impl: timed_step(model, config, impl, x, probe) for impl in impls}
        times = medians(fns, args.warmup, args.repeats)
        (base_wall, base_cpu) = times["eager"]
        for impl in impls:
            wall, cpu = times[impl]
            print(f"{experts:>7} {impl:>15} {wall * 1e3:>8.1f} {args.tokens / wall:>9.0f} "
                  f"{base_wall / wall:>7.2f} {cpu * 1e3:>8.1f} {base_cpu / cpu:>7.2f} "
                  f"{gaps[impl]:>11.1e}", flush=True)

if __name__ == "__main__":
    main()
