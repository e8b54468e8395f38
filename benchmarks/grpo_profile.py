"""Where the time of one rltune GRPO step goes, phase by phase, on CPU.

The run is the GRPO benchmark's (``benchmarks/grpo_vs_trl.py``): an untrained Qwen2 built
locally, one prompt a step, a group of 8, 32 new tokens, fp32, no KL, one optimizer step per
batch. The functions that make up a step are wrapped with wall-clock timers (nothing else
changes), and the seconds per step of each phase are printed as a table, the median over
the steps after a warm-up; "other" is the step's time that no timer covers (the loop,
the clock, Python between the phases).

    python benchmarks/grpo_profile.py                       # the 3 M model
    python benchmarks/grpo_profile.py --size 25m            # the ~25 M model
    python benchmarks/grpo_profile.py --set rollout.compile=true
    python benchmarks/grpo_profile.py --threads 1 --clock cpu  # on a shared machine

Phases: ``decode`` the sampling loop (prefill, one forward a token, sampling), ``detok``
the tokenizer's decode of the completions, ``rollouts`` the rest of building them,
``score`` the reward functions, ``collate`` the batch made from the rollouts (with any
reference/old log-prob forwards), ``rollout_metrics``, ``split`` the micro-batches,
``forward`` the training forward (log-probs, entropy), ``loss``, ``backward``,
``optimizer`` (clip, step, zero), ``samples`` writing ``samples.jsonl``, ``log`` writing
``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CLOCK = [time.perf_counter]
"""The clock the phases are read with: wall time, or with ``--clock cpu`` this thread's CPU
time (with ``--threads 1`` all of the step's compute runs on it), which other processes
on a shared machine disturb far less."""

SIZES = {
    "3m": dict(arch="qwen2", hidden_size=256, layers=3, heads=4, kv_heads=2),
    "25m": dict(arch="qwen2", hidden_size=512, layers=6, heads=8, kv_heads=4),
}


class Timers:
    """Seconds spent in each wrapped function during the current step."""

    def __init__(self) -> None:
        self.now: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self._inner: list[float] = []

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        """Replace ``owner.name`` by a timed call of it."""
        setattr(owner, name, self.timed(getattr(owner, name), phase))

    def timed(self, inner: Callable, phase: str) -> Callable:
        """``inner`` with its time added to ``phase``; the time of a timed call inside it
        goes to that call's phase instead (each phase is exclusive)."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._inner.append(0.0)
            start = CLOCK[0]()
            try:
                return inner(*args, **kwargs)
            finally:
                spent = CLOCK[0]() - start
                self.now[phase] += spent - self._inner.pop()
                if self._inner:
                    self._inner[-1] += spent

        return timed

    def end_step(self, total: float) -> None:
        step = dict(self.now)
        step["other"] = total - sum(step.values())
        step["step"] = total
        self.steps.append(step)
        self.now = defaultdict(float)


def instrument(timers: Timers) -> None:
    """Wrap the functions of a local GRPO step (module attributes, so the run's calls
    go through the wrappers)."""
    from transformers import PreTrainedTokenizerBase

    from rltune.learner import learner
    from rltune.rewards.scorer import LocalScorer
    from rltune.rollout import hf
    from rltune.runtime import loop, sinks, sources

    timers.wrap(hf.HFGenerator, "_decode", "decode")
    timers.wrap(PreTrainedTokenizerBase, "batch_decode", "detok")
    timers.wrap(hf.HFGenerator, "generate", "rollouts")
    timers.wrap(LocalScorer, "score", "score")
    timers.wrap(sources, "make_experience", "collate")
    timers.wrap(sources, "rollout_metrics", "rollout_metrics")
    timers.wrap(learner, "split_by_tokens", "split")
    timers.wrap(learner.LocalLearner, "_apply_gradients", "optimizer")
    timers.wrap(torch.Tensor, "backward", "backward")
    timers.wrap(loop, "_write_samples", "samples")
    timers.wrap(sinks.MetricSinks, "log", "log")
    original = learner.LocalLearner._learn

    def learn(self, mb, denominator, rows, agg):  # forward and loss timed apart
        objective = self.objective
        self.objective = dataclasses.replace(
            objective, forward=timers.timed(objective.forward, "forward"), loss=timers.timed(objective.loss, "loss"))
        try:
            return original(self, mb, denominator, rows, agg)
        finally:
            self.objective = objective

    learner.LocalLearner._learn = learn


def run(size: str, steps: int, warmup: int, overrides: list[str]) -> list[dict[str, float]]:
    from rltune.config import load_config
    from rltune.models.tiny import build_tiny
    from rltune.runtime import loop
    from rltune.runtime.local import build_run

    timers = Timers()
    instrument(timers)
    original_step = loop.train_step

    def train_step(run, samples_log, *, watch=None):
        start = CLOCK[0]()
        metrics = original_step(run, samples_log, watch=watch)
        # the metrics line is written after train_step returns: counted in the next step
        timers.end_step(CLOCK[0]() - start)
        return metrics

    loop.train_step = train_step
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny(Path(tmp) / "model", seed=0, **SIZES[size])
        cfg = load_config(None, [
            "name=profile", f"model.path={model_dir}", "algo.name=grpo", "algo.group_size=8",
            "data.train=builtin:arith/train", "data.chat_template=false",
            "reward.0.fn=builtin:exact_numeric", "rollout.max_new_tokens=32",
            f"train.steps={steps}", "train.prompts_per_step=1", "train.lr=1e-5",
            f"log.dir={tmp}", "log.console=false", "checkpoint.final=false", *overrides,
        ])
        loop.train(build_run(cfg))
    return timers.steps[warmup:]


def table(steps: list[dict[str, float]]) -> str:
    phases = [p for p in steps[0] if p != "step"] + ["step"]
    lines = [f"{'phase':<16} {'s/step':>8} {'share':>6}"]
    total = statistics.median(s["step"] for s in steps)
    for phase in phases:
        value = statistics.median(s.get(phase, 0.0) for s in steps)
        lines.append(f"{phase:<16} {value:8.4f} {value / total:6.1%}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="3m")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--set", action="append", default=[], help="a config override, KEY=VALUE")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        CLOCK[0] = time.thread_time
    steps = run(args.size, args.steps, args.warmup, args.set)
    print(f"GRPO step, {args.size}, {len(steps)} steps after {args.warmup} warm-up, torch threads "
          f"{torch.get_num_threads()}, {args.clock} clock", file=sys.stderr)
    print(table(steps))


if __name__ == "__main__":
    main()
