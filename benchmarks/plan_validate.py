"""The planner's cost model against real rltune steps on this CPU.

Calibrate (``rltune.plan.calibrate``), then run real training steps of several configs of
the built-in models and compare each run's median step time with what
``rltune.plan.timing.step_time`` predicts for the candidate that describes it, on the
CPU cluster the calibration measured. Calibration and runs are interleaved, round after
round, so the machine's speed and load over the rounds reach both alike; the figures are
medians over the rounds.

How a run maps onto a candidate (a device is ``threads`` cores, ``train.threads`` =
the calibration's threads, 1 here, so this 2-core machine is a cluster of 2 devices):

* local, ``runtime.max_staleness: 0``: the generator runs on the learner's module, in
  turn with it, on one device: ``Candidate(colocate=True)``;
* local, ``runtime.max_staleness: 1``: a producer thread generates the next batch on a
  copy of the model while the learner learns, each with its own share of the cores
  (``rollout.threads``, ``train.threads``): a generator on one device and a learner on the
  other, ``Candidate(colocate=False, max_staleness=1)``, the weights copied between them
  after each step. (Before the threads were split, the two shared one OpenMP team and
  mostly took turns: 0.351 s a step against 0.368 s at staleness 0.) How far they overlap
  depends on a free core for each: on a machine busy with other work they take turns again.
* two learner processes: a gloo group of two ranks (DDP), each on one core, learning a
  fixed GRPO batch (no generation): ``LearnerLayout(dp_replicate=2)`` and a workload
  that does not generate.

    .venv/bin/python benchmarks/plan_validate.py [--rounds 3] [--steps 4] [--configs all]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from rltune.plan.calibrate import run_calibration, synthetic_batch
from rltune.plan.calibration_file import load_calibration
from rltune.plan.spec import Candidate, Cluster, Efficiency, LearnerLayout, ModelSpec, Workload

DIGIT_REWARD = (
    "def digit_share(prompt, completion, **meta):\n"
    "    return sum(ch.isdigit() for ch in completion) / max(1, len(completion))\n"
)
THREE_M = dict(hidden_size=256, layers=3, heads=4, kv_heads=2)
"""The 3 M shape of ``benchmarks/trl_common.py``."""


@dataclass(frozen=True)
class Setup:
    """One validation config: the model (``builtin:tiny`` or ``3m``), prompts per step,
    group size, completion length, staleness, learner processes (2: a learner group on
    a fixed batch)."""

    name: str
    model: str
    prompts: int
    group: int
    completion: int
    staleness: int = 0
    learners: int = 1


SETUPS = (
    Setup("tiny g8 c16 s0", "tiny", 8, 8, 16),
    Setup("tiny g8 c16 s1", "tiny", 8, 8, 16, staleness=1),
    Setup("tiny g4 c32 s0", "tiny", 8, 4, 32),
    Setup("3m g4 c16 s0", "3m", 4, 4, 16),
    Setup("3m g8 c16 s1", "3m", 4, 8, 16, staleness=1),
    Setup("tiny g16 c8 s1", "tiny", 4, 16, 8, staleness=1),
    Setup("tiny 2 learners 64x(23+16)", "tiny", 8, 8, 16, learners=2),
)
"""The validation configs; ``QUICK`` names the quick set (two sizes, staleness 0)."""
QUICK = ("tiny g8 c16 s0", "3m g4 c16 s0")
"""Staleness 0 only: a local staleness-1 run overlaps its two threads as far as the machine
has a free core for them, so on a machine loaded by other work it is load, not the model,
that moves it (one such run: +32 %); the staleness-1 configs are in the slow set."""


def model_path(model: str, root: Path) -> str:
    """``builtin:tiny``, or the 3 M model built once under ``root``."""
    if model == "tiny":
        return "builtin:tiny"
    from rltune.models.tiny import build_tiny

    directory = root / "model-3m"
    if not (directory / "model.safetensors").exists():
        build_tiny(directory, **THREE_M)
    return str(directory)


def run_config(setup: Setup, root: Path, *, steps: int, threads: int, tag: str) -> Any:
    """The loaded rltune config of ``setup`` (GRPO, ``builtin:arith_small``, the digit
    reward, ``train.threads`` = ``threads``)."""
    from rltune.config import load_config

    reward = root / "digit_reward.py"
    reward.write_text(DIGIT_REWARD)
    overrides = [
        f"name={tag}", f"model.path={model_path(setup.model, root)}", "algo.name=grpo",
        f"algo.group_size={setup.group}", "data.train=builtin:arith_small/train",
        f"reward.0.fn={reward}:digit_share", f"rollout.max_new_tokens={setup.completion}",
        f"train.steps={steps}", f"train.prompts_per_step={setup.prompts}", f"train.threads={threads}",
        f"log.dir={root / 'runs'}", "log.console=false", "checkpoint.final=false", "checkpoint.every=0",
        "checkpoint.overwrite=true",
        f"runtime.max_staleness={setup.staleness}",
    ]
    if setup.staleness:
        overrides.append("algo.importance_correction=token-truncate")
    return load_config(None, overrides)


def measure_local(setup: Setup, root: Path, *, steps: int, threads: int, tag: str) -> list[float]:
    """Seconds of each step after the first (``time/step`` of the run's metrics)."""
    from rltune.runtime.local import build_run
    from rltune.runtime.loop import train

    history = train(build_run(run_config(setup, root, steps=steps, threads=threads, tag=tag)))
    return [m["time/step"] for m in history[1:]]


def _group_steps(model_dir: str, rows: int, prompt: int, completion: int, steps: int, threads: int) -> list[float]:
    """On each rank of a gloo group: seconds of each DDP learner step after the first on
    this rank's half of a fixed GRPO batch."""
    import torch.distributed as dist

    from rltune.algos import ALGORITHMS
    from rltune.config.schema import AlgoConfig, TrainConfig
    from rltune.learner.distributed import shard_batch
    from rltune.learner.learner import LocalLearner
    from rltune.learner.objectives import build_objective
    from rltune.learner.parallel import make_parallelism
    from rltune.models.load import load_model

    torch.set_num_threads(threads)
    learner = LocalLearner(load_model(model_dir), build_objective(ALGORITHMS["grpo"], AlgoConfig(name="grpo")),
                           TrainConfig(lr=1e-6), parallelism=make_parallelism("ddp"))
    shard = shard_batch(synthetic_batch(rows, prompt, completion), dist.get_rank(), dist.get_world_size())
    out = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        learner.step(shard)
        out.append(time.perf_counter() - start)
    return out[1:]


def measure_group(setup: Setup, root: Path, *, steps: int, threads: int, prompt: int) -> list[float]:
    """Seconds of each learner-group step after the first (the slower rank's)."""
    from rltune.learner.launch import spawn_learner_group
    from rltune.models.load import resolve_model

    model_dir = resolve_model(model_path(setup.model, root), cache_dir=str(root / "builtin"))
    ranks = spawn_learner_group(2, _group_steps, model_dir, setup.prompts * setup.group, prompt,
                                setup.completion, steps, threads, backend="gloo")
    return [max(times) for times in zip(*ranks)]


def _concurrent_reference(threads: int) -> float:
    torch.set_num_threads(threads)
    return SpeedReference(threads).seconds()


def concurrent_reference_s(threads: int) -> float:
    """The reference step's time on one device while another device runs it too (the
    slower of two processes): the machine's speed for a run that keeps two devices busy."""
    from rltune.learner.launch import spawn_learner_group

    return max(spawn_learner_group(2, _concurrent_reference, threads, backend="gloo"))


def concurrency_slowdown(threads: int) -> float:
    """How much two of this machine's devices slow each other: the reference step's
    time in each of two processes running it at once (the slower) over its time in one
    process alone. 1: independent devices, as the timing model assumes; 2: no faster
    than one device."""
    alone = SpeedReference(threads).seconds()
    return concurrent_reference_s(threads) / alone


def describe(setup: Setup, root: Path, *, prompt: int) -> tuple[ModelSpec, Workload, Candidate]:
    """The model, workload and candidate that describe ``setup`` (module docstring)."""
    from rltune.models.load import resolve_model
    from rltune.plan.catalogue import load_model_spec
    from rltune.plan.workload import workload_from_config

    cfg = run_config(setup, root, steps=1, threads=1, tag="describe")
    spec = load_model_spec(resolve_model(model_path(setup.model, root), cache_dir=str(root / "builtin")))
    work = workload_from_config(cfg, prompt_tokens=prompt, completion_tokens=setup.completion)
    layout = LearnerLayout(dp_replicate=setup.learners)
    if setup.learners > 1:
        return spec, replace(work, generates=False), Candidate(layout, micro_batch_tokens=cfg.train.micro_batch_tokens)
    # staleness 0: generator and learner take turns on the process's device; staleness 1:
    # the producer thread generates on a core of its own while the learner learns on the
    # other (rollout.threads and train.threads split the cores), weights copied between them
    cand = Candidate(layout, colocate=setup.staleness == 0, max_staleness=setup.staleness,
                     micro_batch_tokens=cfg.train.micro_batch_tokens)
    return spec, work, cand


def predict(setup: Setup, root: Path, cluster: Cluster, eff: Efficiency, *, prompt: int) -> float:
    from rltune.plan.timing import step_time

    spec, work, cand = describe(setup, root, prompt=prompt)
    return step_time(spec, work, cand, cluster, eff).step


def prompt_tokens(root: Path) -> int:
    """Mean tokens of a ``builtin:arith_small`` prompt in the chat template (23: all are
    equal), read from the loaded data."""
    from rltune.rollout.hf import prompt_ids
    from rltune.runtime.local import build_run

    run = build_run(run_config(SETUPS[0], root, steps=1, threads=torch.get_num_threads(), tag="prompts"))
    run.source.close()
    return round(statistics.mean(len(prompt_ids(p)) for p in run.train_prompts))


class SpeedReference:
    """The machine's speed now (:func:`rltune.plan.calibrate.speed_reference`, at
    ``threads``). A calibration scales its probes to the reference's time at its start
    (``machine.reference_s``); a run's prediction is scaled by the reference's time next to
    the run over that, so the load's drift between calibration and run cancels."""

    def __init__(self, threads: int) -> None:
        from rltune.plan.calibrate import speed_reference

        self.threads = threads
        self._clock = speed_reference()

    def seconds(self) -> float:
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            return self._clock()
        finally:
            torch.set_num_threads(before)


def _measure(setup: Setup, root: Path, *, steps: int, threads: int, prompt: int, tag: str) -> list[float]:
    if setup.learners > 1:
        return measure_group(setup, root, steps=steps, threads=threads, prompt=prompt)
    return measure_local(setup, root, steps=steps, threads=threads, tag=tag)


def validate(setups: tuple[Setup, ...], root: Path, *, rounds: int, steps: int, threads: int = 1,
             quick: bool = True) -> list[dict[str, Any]]:
    """Interleave ``rounds`` of (calibration, every setup's run); return one row per setup:
    predicted (median over the rounds' calibrations), measured (median over all steps of
    all rounds), ``raw_error`` = predicted / measured - 1, and ``error``, the median of
    ``round_errors``, each round's same ratio with the prediction scaled by :class:`SpeedReference` (the
    machine's speed at the run against its speed at the round's calibration; for a run
    of two learner processes, the speed of one device while two run the reference at
    once, since on a shared CPU two busy devices slow each other, which the timing model,
    written for devices that do not share cores, leaves out)."""
    root.mkdir(parents=True, exist_ok=True)
    prompt = prompt_tokens(root)
    reference = SpeedReference(threads)
    measured: dict[str, list[float]] = {s.name: [] for s in setups}
    predicted: dict[str, list[float]] = {s.name: [] for s in setups}
    corrected: dict[str, list[float]] = {s.name: [] for s in setups}
    for r in range(rounds):
        path = run_calibration(root / f"calibration-{r}.json", threads=threads, quick=quick)
        cluster, eff = load_calibration(path)
        at_calibration = json.loads(path.read_text())["machine"]["reference_s"]
        for i, setup in enumerate(setups):
            # a run of two devices is set against the machine's speed with two devices busy
            speed = reference.seconds if setup.learners == 1 else (lambda: concurrent_reference_s(threads))
            now = speed()
            times = _measure(setup, root, steps=steps, threads=threads, prompt=prompt, tag=f"r{r}-{i}")
            now = (now + speed()) / 2
            p = predict(setup, root, cluster, eff, prompt=prompt)
            measured[setup.name] += times
            predicted[setup.name].append(p)
            corrected[setup.name].append(p * now / at_calibration / statistics.median(times) - 1.0)
    rows = []
    for setup in setups:
        p, m = statistics.median(predicted[setup.name]), statistics.median(measured[setup.name])
        rows.append({"config": setup.name, "predicted_s": p, "measured_s": m, "raw_error": p / m - 1.0,
                     "error": statistics.median(corrected[setup.name]), "round_errors": corrected[setup.name]})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table; the last column, each round's drift-removed error, shows
    how far one round moves (the error column is their median)."""
    lines = ["| config | predicted s/step | measured s/step | error | error, speed drift removed | each round |",
             "|---|---:|---:|---:|---:|---|"]
    lines += [f"| {r['config']} | {r['predicted_s']:.3f} | {r['measured_s']:.3f} | {r['raw_error']:+.1%} "
              f"| {r['error']:+.1%} | {', '.join(f'{e:+.1%}' for e in r['round_errors'])} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--configs", choices=("all", "quick"), default="all")
    parser.add_argument("--full-calibration", action="store_true", help="calibrate without quick=True")
    parser.add_argument("--out", type=Path, default=Path("/tmp/rltune-plan-validate"))
    args = parser.parse_args(argv)
    setups = SETUPS if args.configs == "all" else tuple(s for s in SETUPS if s.name in QUICK)
    rows = validate(setups, args.out, rounds=args.rounds, steps=args.steps, quick=not args.full_calibration)
    print(table(rows))
    print(f"two devices at once run {concurrency_slowdown(1):.2f}x slower each than one alone")


if __name__ == "__main__":
    sys.exit(main())
