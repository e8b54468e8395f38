"""The asynchronous pipeline at 8 to 1,024 GPUs, simulated (``rltune.plan.simulate``):
samples per second and the generators' and learners' utilisation against the staleness
bound (``runtime.max_staleness``) and the share of devices that generate, for three ways
of filling a generator's slots: ``static`` waves (rltune's ``hf`` engine), ``refill``
within a replica's share of the step (rltune's ``vllm`` engine) and ``continuous``
streaming across steps (an asynchronous system's).

The workload: GRPO on Qwen2.5-7B (``builtin:qwen2.5-7b``), 512 prompts x 8 samples per
step, 512 prompt tokens, completions up to 8,192 tokens drawn lognormal (median 1,024,
sigma 0.99: the 99th percentile at 10x the median, clipped at the limit), on H100 80 GB
nodes of 8 with the planner's default efficiencies; generators of one GPU each (tp 1),
learners FSDP within a node and replicated across nodes, every block checkpointed, the
weights broadcast from learner rank 0. Each layout is simulated for ``--steps`` learner
steps; figures are over the steps after ``--warmup``.

    python benchmarks/plan_simulation.py                       # the docs' table and chart
    python benchmarks/plan_simulation.py --gpus 8 64 --staleness 0 1 --all

It prints, per GPU count and staleness, the best split (by samples/s, among those whose
learner fits in memory) for each way, beside what the closed form of
``rltune.plan.timing`` predicts for the ``refill`` one's layout (every completion at the
limit, the planner's worst case, and at the mean length); with ``--all`` every layout; ``--chart PATH`` writes the PNG (matplotlib, Agg canvas).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace
from pathlib import Path

from rltune.plan import timing
from rltune.plan.catalogue import load_model_spec
from rltune.plan.errors import PlanError
from rltune.plan.simulate import LognormalLengths
from rltune.plan.simulate_layout import LayoutSimulation, mean_length, simulate_layout
from rltune.plan.spec import Cluster, Efficiency, ModelSpec, Workload

MODES = ("static", "refill", "continuous")


@dataclass(frozen=True)
class Row:
    gpus: int
    staleness: int
    share: float
    mode: str
    sim: LayoutSimulation
    closed_max: float
    """``rltune.plan.timing``'s samples/s for this layout, every completion at the limit."""
    closed_mean: float
    """The same with every completion at the simulated distribution's mean length."""

    @property
    def fits(self) -> bool:
        return not self.sim.problems


def run(args: argparse.Namespace) -> list[Row]:
    spec = load_model_spec(args.model)
    work = Workload(algo="grpo", generates=True, critic=False, reference=False, prompts_per_step=args.prompts,
                    group_size=args.group, prompt_tokens=args.prompt_tokens, completion_tokens=args.completion_tokens)
    lengths = LognormalLengths(args.median, args.sigma, args.completion_tokens)
    rows = []
    for gpus in args.gpus:
        for k in args.staleness:
            for share in args.shares:
                for mode in MODES:
                    try:
                        sim = simulate_layout(spec, work, Cluster(gpus=gpus), Efficiency(), gpus, share, k,
                                              lengths=lengths, batching=mode, steps=args.steps,
                                              warmup=args.warmup, seed=args.seed, weight_sync="broadcast",
                                              activation_checkpointing="full")
                    except PlanError as err:
                        print(f"# {gpus} GPUs, share {share:.0%}, k={k}, {mode}: {err}")
                        continue
                    rows.append(Row(gpus, k, share, mode, sim, closed_form(spec, work, sim, gpus, None),
                                    closed_form(spec, work, sim, gpus, mean_length(lengths))))
    return rows


def closed_form(spec: ModelSpec, work: Workload, sim: LayoutSimulation, gpus: int, mean: float | None) -> float:
    """``rltune.plan.timing``'s samples/s for the simulated layout, its step ``max(generate,
    learn) + sync`` (k > 0) or their sum (k = 0), with every completion at the limit
    (``mean`` None: the planner's worst case) or at ``mean`` tokens."""
    if mean is not None:
        work = replace(work, completion_tokens=round(mean))
    t = timing.step_time(spec, work, sim.candidate, Cluster(gpus=gpus), Efficiency())
    return timing.samples_per_second(work, t)


def best(rows: list[Row], gpus: int, k: int, mode: str) -> Row | None:
    fitting = [r for r in rows if (r.gpus, r.staleness, r.mode) == (gpus, k, mode) and r.fits]
    return max(fitting, key=lambda r: r.sim.result.samples_per_s, default=None)


def cells(row: Row | None) -> list[str]:
    """Best split: generators' share, samples/s, generators busy / slots used, learners busy."""
    if row is None:
        return ["n/a"] * 4
    r = row.sim.result
    return [f"{row.share:.0%}", f"**{r.samples_per_s:.1f}**", f"{r.generator_busy:.2f} / {r.generator_slot_use:.2f}",
            f"{r.learner_busy + r.learner_sync:.2f}"]


def closed_cells(row: Row | None) -> list[str]:
    return ["n/a"] * 2 if row is None else [f"{row.closed_max:.1f}", f"{row.closed_mean:.1f}"]


def best_table(rows: list[Row], args: argparse.Namespace) -> str:
    per_mode = " | ".join(f"{m}: gen | samples/s | gen busy / slots | learner busy" for m in MODES)
    lines = [f"| GPUs | k | {per_mode} | closed form: at max | at mean |", "|" + "---:|" * (4 + 4 * len(MODES))]
    for gpus in args.gpus:
        for k in args.staleness:
            picked = [best(rows, gpus, k, m) for m in MODES]
            lines.append("| " + " | ".join([f"{gpus:,}", str(k), *(c for r in picked for c in cells(r)),
                                            *closed_cells(picked[MODES.index("refill")])]) + " |")
    return "\n".join(lines)


def all_table(rows: list[Row]) -> str:
    lines = ["| GPUs | k | gen share | mode | samples/s | gen busy | gen slots | learner busy | sync "
             "| idle: barrier | idle: bound | learner waits | staleness | learn s | sync s | slots | fits |",
             "|" + "---:|" * 17]
    for row in rows:
        r, p = row.sim.result, row.sim.pipeline
        lines.append("| " + " | ".join([
            f"{row.gpus:,}", str(row.staleness), f"{row.share:.0%}", row.mode, f"{r.samples_per_s:.1f}",
            f"{r.generator_busy:.2f}", f"{r.generator_slot_use:.2f}", f"{r.learner_busy:.2f}", f"{r.learner_sync:.3f}",
            f"{r.idle['generator/barrier']:.2f}", f"{r.idle['generator/staleness']:.2f}",
            f"{r.idle['learner/generation']:.2f}", f"{r.staleness_mean:.2f}", f"{p.learn_s:.1f}", f"{p.sync_s:.2f}", str(p.slots),
            "yes" if row.fits else "no"]) + " |")
    return "\n".join(lines)


def chart(rows: list[Row], args: argparse.Namespace, path: Path) -> None:
    """Per GPU count: samples/s of the best split against staleness (top) and the
    utilisation of that split's generators and learners (bottom), one line style a way."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3.2 * len(args.gpus), 6.4), layout="constrained")
    axes = fig.subplots(2, len(args.gpus), squeeze=False, sharex=True)
    styles = {"static": ":", "refill": "--", "continuous": "-"}
    for col, gpus in enumerate(args.gpus):
        top, bottom = axes[0][col], axes[1][col]
        for mode, style in styles.items():
            picked = [(k, best(rows, gpus, k, mode)) for k in args.staleness]
            picked = [(k, r) for k, r in picked if r is not None]
            ks = [k for k, _ in picked]
            top.plot(ks, [r.sim.result.samples_per_s for _, r in picked], style, marker="o", color="C0", label=mode)
            bottom.plot(ks, [r.sim.result.generator_busy for _, r in picked], style, marker="o", color="C1",
                        label=f"generators, {mode}")
            bottom.plot(ks, [r.sim.result.learner_busy + r.sim.result.learner_sync for _, r in picked], style,
                        marker="s", color="C2", label=f"learners, {mode}")
        top.set_title(f"{gpus:,} H100s")
        top.set_ylim(bottom=0)
        bottom.set_ylim(0, 1.05)
        bottom.set_xlabel("max_staleness")
        bottom.set_xticks(args.staleness)
    axes[0][0].set_ylabel("samples/s (best split)")
    axes[1][0].set_ylabel("busy share of the devices")
    axes[0][0].legend(fontsize="small")
    axes[1][0].legend(fontsize="x-small")
    fig.suptitle(f"{args.model}, GRPO {args.prompts} prompts x {args.group}; completions lognormal\n"
                 f"(median {args.median:g}, sigma {args.sigma:g}, max {args.completion_tokens}); "
                 "dotted: static waves, dashed: refill within a share (rltune), solid: continuous")
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig).print_png(str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:qwen2.5-7b")
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 32, 128, 512, 1024])
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--shares", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--completion-tokens", type=int, default=8192)
    parser.add_argument("--median", type=float, default=1024.0)
    parser.add_argument("--sigma", type=float, default=0.99)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--all", action="store_true", help="also print every layout")
    parser.add_argument("--chart", type=Path, default=None, help="write the chart (PNG) here")
    args = parser.parse_args()
    start = time.perf_counter()
    rows = run(args)
    print(best_table(rows, args))
    if args.all:
        print()
        print(all_table(rows))
    if args.chart:
        chart(rows, args, args.chart)
        print(f"\nchart: {args.chart}")
    print(f"\n{len(rows)} layouts simulated in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
