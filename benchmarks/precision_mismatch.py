"""Engine-learner log-prob mismatch per precision on CPU: short GRPO runs of
``builtin:tiny`` (the e2e tests' digit-share task) at each ``train.precision`` a CPU can
run, with the generator at the learner's precision (``rollout.precision: auto``) and,
for bf16 and fp16, at fp32; prints the run's mean ``logprob_mismatch`` (mean |engine -
learner| log-prob per token), the seconds per step and the reward at the end.

    python benchmarks/precision_mismatch.py [--steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from rltune.config import load_config
from rltune.runtime.local import build_run
from rltune.runtime.loop import train

REWARD = '''
def digit_share(prompt, completion, **meta):
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)
'''
RUNS = [("fp32", "auto"), ("bf16", "auto"), ("bf16", "fp32"), ("fp16", "auto"), ("fp16", "fp32")]


def one_run(root: Path, precision: str, rollout: str, steps: int) -> dict:
    cfg = load_config(None, [
        f"name={precision}-{rollout}", "model.path=builtin:tiny", "algo.name=grpo", "algo.group_size=8",
        "data.train=builtin:arith_small/train", f"reward.0.fn={root / 'reward.py'}:digit_share",
        "rollout.max_new_tokens=8", f"train.steps={steps}", "train.prompts_per_step=4", "train.lr=5e-3",
        f"train.precision={precision}", f"rollout.precision={rollout}", "train.threads=1",
        f"log.dir={root / 'runs'}", "log.console=false", "checkpoint.final=false",
    ])
    start = time.perf_counter()
    history = train(build_run(cfg))
    return {"s_per_step": (time.perf_counter() - start) / steps,
            "mismatch": statistics.mean(m["logprob_mismatch"] for m in history),
            "reward": history[-1]["reward/mean"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="precision-"))
    (root / "reward.py").write_text(REWARD)
    print(f"{'train.precision':16s} {'rollout.precision':18s} {'mismatch':>10s} {'s/step':>7s} {'reward':>7s}")
    for precision, rollout in RUNS:
        r = one_run(root, precision, rollout, args.steps)
        print(f"{precision:16s} {rollout:18s} {r['mismatch']:10.2e} {r['s_per_step']:7.2f} {r['reward']:7.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
