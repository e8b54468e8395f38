"""Training throughput of the learner layouts on this machine's CPU (gloo): tokens per
second of GRPO optimizer steps at 1, 2 and 4 processes for each layout that runs.

Each layout is a group of processes started by ``spawn_learner_group`` (no Ray), each
rank a ``LocalLearner`` with ``MeshParallelism`` on its data shard of the same global
batch (``--rows`` rows of ``--prompt`` + ``--completion`` tokens, every completion
token in the loss). One warm-up step, then ``--steps`` timed steps; the figure is the
global batch's loss tokens per step over the median step time (the slowest rank's, as
the group waits for it). The model is ``builtin:tiny`` (``builtin:tiny-moe`` for layouts
with ``ep``, whose one-process figure is measured too).

On a machine with fewer cores than processes the ranks share cores: the table then shows
what communication and oversubscription cost, not what the layout gains on real devices
(``benchmarks/gpu/parallel.py`` measures GPUs).

    python benchmarks/parallel_scaling.py
    python benchmarks/parallel_scaling.py --rows 64 --steps 5 --only "dp_shard=2" "tp=2"
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

LAYOUTS: list[tuple[str, str, dict]] = [
    ("1 process", "builtin:tiny", {}),
    ("dp_replicate=2", "builtin:tiny", {"dp_replicate": 2}),
    ("dp_shard=2", "builtin:tiny", {"dp_shard": 2}),
    ("tp=2", "builtin:tiny", {"tp": 2}),
    ("pp=2", "builtin:tiny", {"pp": 2}),
    ("dp_shard=4", "builtin:tiny", {"dp_shard": 4}),
    ("dp_replicate=2 x dp_shard=2", "builtin:tiny", {"dp_replicate": 2, "dp_shard": 2}),
    ("dp_shard=2 x tp=2", "builtin:tiny", {"dp_shard": 2, "tp": 2}),
    ("pp=2 x dp_shard=2", "builtin:tiny", {"pp": 2, "dp_shard": 2}),
    ("1 process (moe)", "builtin:tiny-moe", {}),
    ("ep=2 (moe)", "builtin:tiny-moe", {"ep": 2}),
    ("dp_shard=2 x ep=2 (moe)", "builtin:tiny-moe", {"dp_shard": 2, "ep": 2}),
]


def make_batch(rows: int, prompt: int, completion: int, seed: int = 0):
    """A GRPO batch of fixed-length rows, random tokens and advantages; old and reference
    log-probs zero (the ratio clip is then active on some tokens, as in training)."""
    from rltune.data.records import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 260, (rows, prompt + completion), generator=g)
    mask = torch.ones(rows, completion)
    logprobs = torch.full((rows, completion), -5.0)
    return TrainBatch(input_ids=ids, attention_mask=torch.ones_like(ids), prompt_len=prompt, loss_mask=mask,
                      advantages=torch.randn(rows, 1, generator=g).expand(rows, completion).contiguous(),
                      old_logprobs=logprobs, ref_logprobs=logprobs.clone())


def timed_steps(model_dir: str, layout: dict, rows: int, prompt: int, completion: int, steps: int) -> list[float]:
    """One rank (or the one process, ``layout`` empty): the seconds of each timed step."""
    from rltune.algos import ALGORITHMS
    from rltune.config.schema import AlgoConfig, TrainConfig
    from rltune.learner.distributed import shard_batch
    from rltune.learner.learner import LocalLearner
    from rltune.learner.objectives import build_objective
    from rltune.learner.parallel import NoParallelism
    from rltune.models.load import load_model
    from rltune.parallel.layout import Layout
    from rltune.parallel.strategy import MeshParallelism

    torch.set_num_threads(1)
    parallelism = MeshParallelism(Layout(**layout)) if layout else NoParallelism()
    objective = build_objective(ALGORITHMS["grpo"], AlgoConfig(name="grpo", kl_coef=0.1))
    learner = LocalLearner(load_model(model_dir), objective, TrainConfig(lr=1e-5, micro_batch_tokens=8192),
                           parallelism=parallelism)
    batch = shard_batch(make_batch(rows, prompt, completion), parallelism.rank, parallelism.world)
    times = []
    for step in range(steps + 1):
        start = time.perf_counter()
        learner.step(batch)
        if step:  # the first step is the warm-up
            times.append(time.perf_counter() - start)
    return times


def measure(name: str, model: str, layout: dict, args: argparse.Namespace) -> dict:
    from rltune.learner.launch import spawn_learner_group
    from rltune.models.load import resolve_model
    from rltune.parallel.layout import Layout, check_layout, model_config_of

    model_dir = resolve_model(model)
    shape = Layout(**layout)
    check_layout(shape, shape.world, model_config_of(model))
    work = (model_dir, layout, args.rows, args.prompt, args.completion, args.steps)
    if layout:
        per_rank = spawn_learner_group(shape.world, timed_steps, *work, backend="gloo", timeout_s=1200)
    else:
        per_rank = [timed_steps(*work)]
    step_s = statistics.median(max(ranks) for ranks in zip(*per_rank))
    return {"layout": name, "processes": shape.world, "step_s": step_s,
            "tokens_per_s": args.rows * args.completion / step_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--completion", type=int, default=96)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=None, help="layout names to run (default: all)")
    args = parser.parse_args()
    print(f"{'layout':<30} {'procs':>5} {'step s':>8} {'tokens/s':>9}", flush=True)
    for name, model, layout in LAYOUTS:
        if args.only and name not in args.only:
            continue
        try:
            row = measure(name, model, layout, args)
        except Exception as err:  # noqa: BLE001 - a layout that does not run is reported, not fatal
            lines = [line for line in str(err).splitlines() if "Error" in line] or [str(err)]
            print(f"{name:<30} failed: {lines[-1].strip()[:300]}", flush=True)
            continue
        print(f"{row['layout']:<30} {row['processes']:>5} {row['step_s']:>8.3f} {row['tokens_per_s']:>9.0f}",
              flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
