"""CPU time per step of the generating thread and of the learning thread in rltune's run
of the GRPO benchmark (``grpo_vs_trl.py``'s settings, one seed), synchronous or with
generation one step ahead, and the rate a quiet machine would give.

On a shared machine the wall-clock rate of a run says little; the CPU time each thread
spends per step (``time.thread_time``) is disturbed far less. Synchronous: the step's
CPU time, rate ``8 / step``. With ``--staleness 1`` the producer thread's CPU time per
batch (generate and score, ``Collector.collect``) and the learner thread's per step run
on two cores at once, so a quiet 2-core machine runs ``8 / max(producer, learner)``
completions per second (an estimate: it leaves out the waits of the hand-over, which
the learner's idle share, ``async/learner_idle_frac``, shows on a quiet machine). Each
thread runs one torch thread (1 + 1 with ``--staleness 1``). Medians after 5 warm-up
steps::

    python benchmarks/grpo_async_cpu.py --staleness 0
    python benchmarks/grpo_async_cpu.py --staleness 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_common as common  # noqa: E402

GROUP = 8
WARMUP = 5


def measure(size: str, staleness: int, steps: int, seed: int) -> tuple[list[float], list[float]]:
    """CPU seconds of each ``collect`` (in whichever thread generates) and of each
    learner step (in the main thread, which waits without using CPU)."""
    from rltune.config import load_config
    from rltune.runtime import collect, loop
    from rltune.runtime.local import build_run

    generate, learn = [], []
    original_collect, original_step = collect.Collector.collect, loop.train_step

    def timed_collect(self, *args, **kwargs):
        start = time.thread_time()
        try:
            return original_collect(self, *args, **kwargs)
        finally:
            generate.append(time.thread_time() - start)

    def timed_step(run, samples_log, *, watch=None):
        start = time.thread_time()
        try:
            return original_step(run, samples_log, watch=watch)
        finally:
            learn.append(time.thread_time() - start)

    collect.Collector.collect, loop.train_step = timed_collect, timed_step
    ahead = [f"runtime.max_staleness={staleness}", "algo.importance_correction=token-truncate"] if staleness else []
    with tempfile.TemporaryDirectory() as tmp:
        common._prepare({"directory": tmp, "size": size,
                         "files": {"prompts.jsonl": ("arith", "train", None, ("prompt", "answer"))}})
        cfg = load_config(None, [
            "name=bench", f"model.path={tmp}/model", "algo.name=grpo", f"algo.group_size={GROUP}",
            f"data.train={tmp}/prompts.jsonl", "data.shuffle=false", "data.chat_template=false",
            f"reward.0.fn={common.__file__}:digit_share", "rollout.max_new_tokens=32",
            f"train.steps={steps}", "train.prompts_per_step=1", "train.lr=3e-4", f"train.seed={seed}",
            f"log.dir={tmp}", "log.console=false", "checkpoint.final=false", *ahead,
        ])
        loop.train(build_run(cfg))
    return generate[WARMUP:], learn[WARMUP:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(common.SIZES), default="3m")
    parser.add_argument("--staleness", type=int, choices=(0, 1), default=1)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the learner's; the producer's split gives it 1 too
    generate, learn = measure(args.size, args.staleness, args.steps, args.seed)
    gen, step = statistics.median(generate), statistics.median(learn)
    if args.staleness:
        print(f"{args.size} staleness 1: producer {gen * 1e3:.1f} ms CPU/batch, learner {step * 1e3:.1f} ms "
              f"CPU/step -> {GROUP / max(gen, step):.1f} completions/s on a quiet machine (estimate)")
    else:
        print(f"{args.size} synchronous: step {step * 1e3:.1f} ms CPU (generate and score {gen * 1e3:.1f}) "
              f"-> {GROUP / step:.1f} completions/s")


if __name__ == "__main__":
    main()
