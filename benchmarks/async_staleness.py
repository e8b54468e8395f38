"""Throughput of generating ahead of the learner: ``runtime.max_staleness`` 0 (generate,
score and learn in turn) against 1 and 2 (the next batches are generated while the
learner learns), same model, data and settings, on this machine's CPU.

The settings make generation and learning take comparable time per step on the built-in
tiny model (32 prompts x group 4, 8 new tokens). Each setting runs in its own process,
``rltune train`` as a user would run it; the figure is samples per second over the steps
after a warm-up (median step time, from metrics.jsonl), and the ratio to ``0``.

    python benchmarks/async_staleness.py                 # 0, 1 and 2
    python benchmarks/async_staleness.py --steps 40 --staleness 0 1
    python benchmarks/async_staleness.py --ray --staleness 0 1 --generators 1 2

With ``--ray`` the runs use ``runtime.mode: ray`` (a local Ray, one learner actor and
``--generators`` generator actors of one CPU each) and every combination of staleness and
generator count is measured; the ratio is to staleness 0 with one generator.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from runs import train_rows

WARMUP = 3


def run(staleness: int, steps: int, root: Path, threads: int, generators: int | None = None) -> dict[str, float]:
    overrides = [
        "model.path=builtin:tiny", "algo.name=grpo", "algo.group_size=4",
        "algo.importance_correction=token-truncate", f"runtime.max_staleness={staleness}",
        "data.train=builtin:arith/train",
        "rollout.max_new_tokens=8", f"train.steps={steps}", "train.prompts_per_step=32",
        "train.lr=1e-4", f"train.threads={threads}",
    ]
    if generators is not None:
        overrides += ["runtime.mode=ray", f"runtime.placement.generators={generators}"]
    rows = train_rows(root, overrides, what=f"max_staleness={staleness}, generators={generators}")[WARMUP:]
    step_s = statistics.median(r["time/step"] for r in rows)
    return {
        "samples_per_s": 32 * 4 / step_s,
        "step_s": step_s,
        "staleness": statistics.mean(r["staleness/mean"] for r in rows),
        "learner_idle": statistics.mean(r.get("async/learner_idle_frac", 0.0) for r in rows),
        "reward_last": statistics.mean(r["reward/mean"] for r in rows[-5:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (per process: generation and learning each get them)")
    parser.add_argument("--ray", action="store_true", help="runtime.mode=ray on a local Ray")
    parser.add_argument("--generators", type=int, nargs="+", default=[1],
                        help="generator actors (with --ray)")
    args = parser.parse_args()
    settings = [(k, g if args.ray else None) for g in args.generators for k in args.staleness]
    results = {}
    for k, g in settings:
        with tempfile.TemporaryDirectory() as tmp:
            results[(k, g)] = run(k, args.steps, Path(tmp), args.threads, g)
    base = results.get((0, args.generators[0] if args.ray else None))
    print(f"{'max_staleness':>13} {'generators':>10} {'samples/s':>10} {'s/step':>8} {'staleness':>9} "
          f"{'learner idle':>12} {'reward (last 5)':>15} {'ratio':>6}")
    for (k, g), r in results.items():
        ratio = r["samples_per_s"] / base["samples_per_s"] if base else float("nan")
        print(f"{k:>13} {g or '-':>10} {r['samples_per_s']:>10.1f} {r['step_s']:>8.3f} {r['staleness']:>9.2f} "
              f"{r['learner_idle']:>12.2f} {r['reward_last']:>15.3f} {ratio:>6.2f}")


if __name__ == "__main__":
    main()
