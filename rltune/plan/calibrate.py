"""``rltune plan --calibrate``: fit the cost model's constants on the machine at hand.

Short measured steps on this CPU: an fp32 matmul (peak FLOP rate), a memory stream
(bandwidth), rltune's learner step, forward and optimizer step on tiny Qwen2 models of
two sizes at several token counts, its generator at several batch sizes and lengths, and
a gloo all-reduce between two processes at two sizes. Each is a :class:`Probe`: seconds
measured against what :func:`rltune.plan.timing.step_time` predicts for the workload and
layout that describe it; :func:`fit_efficiency` chooses the ``Efficiency`` constants that
minimise the probes' squared relative error.

The CPU as a cluster. A device is ``threads`` cores (torch's intra-op threads); the
machine holds ``cores // threads`` of them, in one node, sharing its memory. ``tflops``
is the measured fp32 matmul rate of one device and ``fp32_ratio`` is 1: fp32 is the CPU's
native rate (no faster 16-bit path is measured; a bf16 workload is predicted at the fp32
rate). ``hbm_gbps``, ``intra_gbps``, ``inter_gbps`` and ``host_gbps`` are all the
measured memory stream bandwidth: two processes on one machine communicate through
memory, and the fitted ``comm_bandwidth`` is the share of it a gloo all-reduce reaches.

The fit. Every time of the model is work over a rate times an efficiency (linear in
``1/efficiency``) plus fixed seconds, possibly under a ``max`` of two regimes (a
roofline): in the coordinates ``theta`` (:data:`INVERSE` inverted, :data:`DIRECT` as they
are) each probe's prediction is ``a . theta + b`` near any point. :func:`fit_efficiency` reads ``a`` and
``b`` off the timing model itself (differences along each coordinate), solves the
weighted least squares ``min sum_i ((a_i . theta + b_i) / y_i - 1)^2`` under bounds
(seconds >= 0, efficiencies <= 1000), and repeats from the solution until the regimes
stop changing (Gauss-Newton on a piecewise-linear model, exact where it is linear).
The one planner module that imports torch (inside the measuring functions).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from rltune.plan.calibration_file import save_calibration
from rltune.plan.catalogue import CATALOGUE
from rltune.plan.errors import PlanError
from rltune.plan.spec import Candidate, Cluster, Efficiency, LearnerLayout, ModelSpec, Workload

INVERSE = ("train_mfu", "prefill_mfu", "decode_bandwidth", "decode_mfu", "comm_bandwidth")
"""Efficiencies the model divides by: fitted as their inverse."""
DIRECT = ("layer_overhead_s", "token_overhead_s", "step_overhead_s", "comm_latency_s", "score_s")
"""Fixed seconds the model adds: fitted as they are."""
FITTED = INVERSE + DIRECT
_MAX_EFFICIENCY = 1000.0
"""Bound of a fitted efficiency (caches can beat the memory stream, not by 1000x)."""


@dataclass(frozen=True)
class Probe:
    """Seconds measured, and what the cost model says of them: ``phase`` of
    ``step_time(spec, work, cand, ...)`` (a :class:`StepTime` field or property, or
    ``comm:KIND``), or ``all_reduce:BYTES``, a collective alone (spec, work, cand unused)."""

    what: str
    spec: ModelSpec
    work: Workload
    cand: Candidate
    phase: str
    seconds: float


Predict = Callable[[Probe, Cluster, Efficiency], float]


def predict_probe(probe: Probe, cluster: Cluster, eff: Efficiency) -> float:
    """What the timing model says ``probe`` takes on ``cluster`` at ``eff``: the
    ``phase`` of :func:`~rltune.plan.timing.step_time`, or for ``all_reduce:BYTES`` a ring
    all-reduce of that many bytes between two devices of the node."""
    from rltune.plan import timing
    from rltune.plan.collectives import all_reduce_s, link_bandwidth

    if probe.phase.startswith("all_reduce:"):
        nbytes = float(probe.phase.removeprefix("all_reduce:"))
        return all_reduce_s(nbytes, 2, link_bandwidth(cluster, 2, 1, eff), eff.comm_latency_s)
    t = timing.step_time(probe.spec, probe.work, probe.cand, cluster, eff)
    kind = probe.phase.removeprefix("comm:")
    return t.comm.get(kind, 0.0) if kind != probe.phase else float(getattr(t, probe.phase))


# ----------------------------------------------------------------------------- the fit


def coordinates(eff: Efficiency, names: Sequence[str] = FITTED) -> np.ndarray:
    """``eff`` in the fit's coordinates: ``1/x`` for :data:`INVERSE`, ``x`` otherwise."""
    return np.array([1.0 / getattr(eff, n) if n in INVERSE else getattr(eff, n) for n in names])


def from_coordinates(theta: np.ndarray, base: Efficiency, names: Sequence[str] = FITTED) -> Efficiency:
    """The inverse of :func:`coordinates`: ``base`` with ``names`` set from ``theta``."""
    values = {n: (1.0 / t if n in INVERSE else t) for n, t in zip(names, theta.tolist())}
    return dataclasses.replace(base, **values)


def linearise(probes: Sequence[Probe], cluster: Cluster, eff: Efficiency, *, names: Sequence[str] = FITTED,
              predict: Predict = predict_probe) -> tuple[np.ndarray, np.ndarray]:
    """``(A [P, N], b [P])`` with ``prediction_i = A_i . theta + b_i`` near ``eff``, read
    off the model by a difference of 10^-6 of each coordinate (exact where it is linear)."""
    theta = coordinates(eff, names)
    f0 = np.array([predict(p, cluster, eff) for p in probes])
    a = np.zeros((len(probes), len(names)))
    for j, name in enumerate(names):
        step = 1e-6 * max(abs(theta[j]), 1.0 if name in INVERSE else 1e-3)
        moved = theta.copy()
        moved[j] += step
        shifted = from_coordinates(moved, eff, names)
        a[:, j] = (np.array([predict(p, cluster, shifted) for p in probes]) - f0) / step
    return a, f0 - a @ theta


def _bounded_lstsq(a: np.ndarray, r: np.ndarray, lower: np.ndarray) -> np.ndarray:
    """``min |a x - r|^2`` with ``x >= lower``: an active set that pins the most violated
    coordinate at its bound and solves again (few coordinates, few passes)."""
    pinned = np.zeros(a.shape[1], dtype=bool)
    while True:
        x = lower.copy()
        free = ~pinned
        if free.any():
            rhs = r - a[:, pinned] @ lower[pinned]
            x[free] = np.linalg.lstsq(a[:, free], rhs, rcond=None)[0]
        low = np.where(free & (x < lower))[0]
        if not len(low):
            return x
        pinned[low[np.argmin(x[low] - lower[low])]] = True


def fit_efficiency(probes: Sequence[Probe], cluster: Cluster, *, start: Efficiency = Efficiency(),
                   names: Sequence[str] = FITTED, predict: Predict = predict_probe,
                   rounds: int = 20) -> tuple[Efficiency, tuple[str, ...]]:
    """The :class:`Efficiency` that minimises the probes' squared relative error (see the
    module docstring), and the names of the constants the probes determine; a constant
    no probe's time depends on keeps its value in ``start``."""
    if not probes:
        raise PlanError("calibration: no measurements to fit")
    y = np.array([p.seconds for p in probes])
    if (y <= 0).any():
        raise PlanError(f"calibration: a measured time is not positive: {y.tolist()}")
    eff, fitted = start, tuple(names)
    for _ in range(rounds):
        a, b = linearise(probes, cluster, eff, names=fitted, predict=predict)
        used = np.abs(a).max(axis=0) > 0
        fitted = tuple(n for n, u in zip(fitted, used) if u)
        a = a[:, used]
        lower = np.array([1.0 / _MAX_EFFICIENCY if n in INVERSE else 0.0 for n in fitted])
        theta = _bounded_lstsq(a / y[:, None], (y - b) / y, lower)
        old = coordinates(eff, fitted)
        eff = from_coordinates(theta, eff, fitted)
        if np.allclose(theta, old, rtol=1e-12, atol=0.0):
            break
    return eff, fitted


def _proc_line(path: str, prefix: str) -> str | None:
    """What follows ``prefix`` on the first line of ``path`` that starts with it (Linux's
    /proc files), or None where there is no such file or line."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    return next((line[len(prefix):].strip(" \t:") for line in lines if line.startswith(prefix)), None)


def describe_machine(threads: int) -> dict[str, Any]:
    """CPU model, cores, memory, torch version, threads per device, date (UTC)."""
    import torch

    memory_kb = _proc_line("/proc/meminfo", "MemTotal:")
    return {
        "cpu": _proc_line("/proc/cpuinfo", "model name") or platform.processor() or platform.machine(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gb": int(memory_kb.split()[0]) * 1024 / 1e9 if memory_kb else float("nan"),
        "threads_per_device": threads, "torch": torch.__version__, "python": platform.python_version(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def cpu_cluster(machine: dict[str, Any], *, flops: float, stream_bytes_s: float) -> Cluster:
    """The machine as a :class:`Cluster` (see the module docstring): ``cores // threads``
    devices of ``threads`` cores, the measured fp32 rate and memory bandwidth."""
    threads = machine["threads_per_device"]
    devices = max(1, machine["cores"] // threads)
    gbps = stream_bytes_s / 1e9
    return Cluster(
        gpus=devices, gpus_per_node=devices, memory_gb=machine["memory_gb"] / devices,
        tflops=flops / 1e12, hbm_gbps=gbps, intra_gbps=gbps, inter_gbps=gbps, host_gbps=gbps,
        fp32_ratio=1.0, kind="cpu", name=f"{machine['cpu']}, {threads} thread(s) per device", fp8=False,
    )


def timed(fn: Callable[[], Any], *, repeats: int, warmup: int = 1) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ----------------------------------------------------------------------------- measuring

SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=128, layers=4, heads=4, kv_heads=2),
    "3m": dict(hidden_size=256, layers=3, heads=4, kv_heads=2),
}
"""The calibration's models, ``build_tiny`` arguments: ``builtin:tiny`` (~1 M parameters)
and the 3 M shape of ``benchmarks/trl_common.py``; layers and widths vary apart. On a CPU
a matmul's efficiency falls with its width (a 64-wide model reaches a third of what a
256-wide one does), so the constants hold for models of about these widths."""
LEARN_SHAPES = ((8, 23, 8), (32, 23, 16), (64, 23, 24))
"""(rows, prompt tokens, completion tokens) of the learner steps measured: 250 to 3,000
tokens, prompts as long as ``builtin:arith_small``'s (23 tokens)."""
GEN_SHAPES = ((2, 4, 23, 8), (4, 8, 23, 16), (8, 8, 23, 24), (4, 2, 200, 4))
"""(prompts, samples per prompt, prompt tokens, new tokens) of the generations measured;
the last one's long prompts make the prefill's share large enough to fit."""
BUDGET = 8192
"""Micro-batch token budget of the learner probes (``train.micro_batch_tokens``' default)."""
ALLREDUCE_ELEMENTS = (1 << 10, 1 << 22)
"""fp32 elements all-reduced between two processes: latency-bound, bandwidth-bound."""


def tiny_model(name: str) -> tuple[Any, ModelSpec]:
    """An in-memory random Qwen2 model of :data:`SIZES` ``name`` and its spec."""
    import torch
    from transformers import AutoModelForCausalLM

    from rltune.models.tiny import ARCH_CONFIGS, build_tokenizer
    from rltune.plan.catalogue import spec_from_config, tiny_config

    args = SIZES[name]
    vocab = len(build_tokenizer())
    config = ARCH_CONFIGS["qwen2"](vocab_size=vocab, **args)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    shape = tiny_config("qwen2", args["hidden_size"], args["layers"], args["heads"], args["kv_heads"])
    return model, spec_from_config(shape, source=f"calibration model {name}", name=name)


def learner_only(rows: int, prompt: int, completion: int) -> Workload:
    """A step of ``rows`` sequences learned without generation (one sample per prompt)."""
    return Workload(algo="grpo", generates=False, critic=False, reference=False, prompts_per_step=rows,
                    group_size=1, prompt_tokens=prompt, completion_tokens=completion, precision="fp32",
                    rollout_precision="fp32")


def scored_online(rows: int, prompt: int, completion: int) -> Workload:
    """``rows`` generated sequences with a reference model: one no-gradient forward each
    (``StepTime.reference``)."""
    return dataclasses.replace(learner_only(rows, prompt, completion), generates=True, reference=True)


def measure_peaks(repeats: int) -> tuple[float, float]:
    """FLOP/s of a 1024^3 fp32 matmul (2 n^3 FLOPs) and bytes/s of copying 64 MB (read
    and write: 128 MB moved), at torch's current threads."""
    import torch

    a, b, dst = torch.randn(1024, 1024), torch.randn(1024, 1024), torch.empty(1 << 24)
    src = torch.rand(1 << 24)
    return (2 * 1024**3 / timed(lambda: a @ b, repeats=repeats, warmup=2),
            2 * src.numel() * 4 / timed(lambda: dst.copy_(src), repeats=repeats, warmup=2))


def _allreduce_times(elements: tuple[int, ...], repeats: int, threads: int) -> list[float]:
    """On each rank of a gloo group: median seconds of one all-reduce of each size."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    out = []
    for n in elements:
        x = torch.ones(n)
        dist.barrier()
        out.append(timed(lambda: dist.all_reduce(x), repeats=repeats, warmup=2))
    return out


def synthetic_batch(rows: int, prompt: int, completion: int, *, seed: int = 0) -> Any:
    """A GRPO ``TrainBatch``: random tokens, every completion token trained, random
    per-sequence advantages, on-policy (no old log-probs)."""
    import torch

    from rltune.data.records import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 260, (rows, prompt + completion), generator=g)
    return TrainBatch(input_ids=ids, attention_mask=torch.ones_like(ids), prompt_len=prompt,
                      loss_mask=torch.ones(rows, completion),
                      advantages=torch.randn(rows, generator=g)[:, None].expand(rows, completion))


def grpo_learner(model: Any, budget: int = BUDGET) -> Any:
    """rltune's ``LocalLearner`` of ``model`` with the GRPO objective (defaults) and the
    micro-batch token budget ``budget``."""
    from rltune.algos import ALGORITHMS
    from rltune.config.schema import AlgoConfig, TrainConfig
    from rltune.learner.learner import LocalLearner
    from rltune.learner.objectives import build_objective

    return LocalLearner(model, build_objective(ALGORITHMS["grpo"], AlgoConfig(name="grpo")),
                        TrainConfig(lr=1e-6, micro_batch_tokens=budget))


def speed_reference(repeats: int = 9) -> Callable[[], float]:
    """A clock of the machine's speed: the median seconds of a fixed ``builtin:tiny``
    learner step (8 x (23 + 8) tokens). On a machine that other jobs load, speed drifts
    from one minute to the next; each probe group is scaled by this reference's time at
    the start over its time next to the group, so the probes all describe the machine
    as it was at the start (``machine.reference_s`` in the file)."""
    learner, batch = grpo_learner(tiny_model("tiny")[0]), synthetic_batch(8, 23, 8)
    return lambda: timed(lambda: learner.step(batch), repeats=repeats)


def learner_probes(name: str, *, repeats: int, budget: int = BUDGET, shapes: Sequence[tuple[int, int, int]] = LEARN_SHAPES,
                   forward: bool = True) -> list[Probe]:
    """rltune's GRPO learner step (forward, backward, AdamW), its optimizer step alone
    and its no-gradient forward (log-probs), on model ``name`` at :data:`LEARN_SHAPES`
    (or ``shapes``) with the micro-batch token budget ``budget``; ``forward`` False: no
    forward probes."""
    import torch

    from rltune.learner.objectives import logprobs_only

    model, spec = tiny_model(name)
    learner = grpo_learner(model, budget)
    cand = Candidate(LearnerLayout(), micro_batch_tokens=budget)
    probes = []
    for rows, prompt, completion in shapes:
        batch = synthetic_batch(rows, prompt, completion)
        shape = f"{name} {rows}x({prompt}+{completion})"
        probes.append(Probe(f"learner step {shape}", spec, learner_only(rows, prompt, completion), cand, "step",
                            timed(lambda: learner.step(batch), repeats=repeats)))
        if forward:
            probes.append(Probe(f"forward {shape}", spec, scored_online(rows, prompt, completion), cand, "reference",
                                timed(lambda: learner.predict(batch, logprobs_only, "logprobs"), repeats=repeats)))
    for param in model.parameters():  # the step after the last one above, on fresh gradients
        param.grad = torch.full_like(param, 1e-3)
    probes.append(Probe(f"optimizer step {name}", spec, learner_only(1, 1, 1), cand, "optimizer",
                        timed(learner.optimizer.step, repeats=repeats)))
    return probes


def generator_probes(name: str, *, repeats: int) -> list[Probe]:
    """rltune's generator (the lean decoder: one prefill per prompt, then one step per
    token over all samples) on model ``name`` at :data:`GEN_SHAPES`. The steps run until
    every sample has ended, so a random model's rare early EOS changes nothing."""
    import torch

    from rltune.data.records import Prompt, SamplingParams
    from rltune.models.tiny import build_tokenizer
    from rltune.rollout.hf import HFGenerator

    model, spec = tiny_model(name)
    tokenizer = build_tokenizer()
    generator = HFGenerator(model, tokenizer, rng=torch.Generator().manual_seed(0))
    probes = []
    for prompts, n, prompt, new in GEN_SHAPES:
        batch = [Prompt(id=str(i), text="x", input_ids=list(range(10 + i, 10 + i + prompt))) for i in range(prompts)]
        params = SamplingParams(n=n, max_new_tokens=new)
        work = Workload(algo="grpo", generates=True, critic=False, reference=False, prompts_per_step=prompts,
                        group_size=n, prompt_tokens=prompt, completion_tokens=new, precision="fp32",
                        rollout_precision="fp32")
        probes.append(Probe(f"generate {name} {prompts}x{n} ({prompt}+{new})", spec, work,
                            Candidate(LearnerLayout(), colocate=True), "generate",
                            timed(lambda: generator.generate(batch, params), repeats=repeats)))
    return probes


def collective_probes(repeats: int, threads: int) -> list[Probe]:
    """A gloo all-reduce between two processes at :data:`ALLREDUCE_ELEMENTS` (fp32); a
    size's time is the slower rank's."""
    from rltune.learner.launch import spawn_learner_group

    ranks = spawn_learner_group(2, _allreduce_times, ALLREDUCE_ELEMENTS, repeats, threads, backend="gloo")
    work, cand = learner_only(1, 1, 1), Candidate(LearnerLayout(dp_replicate=2))
    return [Probe(f"all-reduce {4 * n} bytes, 2 processes", CATALOGUE["tiny"], work, cand, f"all_reduce:{4 * n}",
                  max(r[i] for r in ranks)) for i, n in enumerate(ALLREDUCE_ELEMENTS)]


def _probe_row(p: Probe, cluster: Cluster, eff: Efficiency) -> dict[str, Any]:
    predicted = predict_probe(p, cluster, eff)
    return {"what": p.what, "phase": p.phase, "measured_s": p.seconds, "predicted_s": predicted,
            "error": predicted / p.seconds - 1.0}


def measure_probes(*, threads: int, quick: bool) -> tuple[dict[str, Any], Cluster, list[Probe]]:
    """The machine, its cluster and every probe, measured at ``threads`` torch threads
    (restored after)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        repeats, reference = (3 if quick else 5), speed_reference()
        machine = describe_machine(threads) | {"reference_s": reference()}
        flops, stream = measure_peaks(repeats + 2)
        cluster = cpu_cluster(machine, flops=flops, stream_bytes_s=stream)
        groups: list[Callable[[], list[Probe]]] = []
        for name in SIZES:
            # quick: the largest model's longest step (a few seconds) and the forwards left out
            shapes = LEARN_SHAPES[:2] if quick and name == "3m" else LEARN_SHAPES
            groups.append(lambda name=name, shapes=shapes: learner_probes(name, repeats=repeats, shapes=shapes,
                                                                          forward=not quick))
            groups.append(lambda name=name: generator_probes(name, repeats=repeats))
        groups.append(lambda: collective_probes(repeats * 3, threads))
        probes = []
        for group in groups:
            ahead, measured = reference(), group()
            scale = machine["reference_s"] / ((ahead + reference()) / 2)
            probes += [dataclasses.replace(p, seconds=p.seconds * scale) for p in measured]
        return machine, cluster, probes
    finally:
        torch.set_num_threads(before)


def run_calibration(out: Path, *, threads: int | None = None, quick: bool = False) -> Path:
    """Measure this machine (:func:`measure_probes`), fit :class:`Efficiency` to the
    probes (:func:`fit_efficiency`) and write both, with the CPU :class:`Cluster`, to
    the JSON file ``out``; returns ``out``. ``threads``: cores of one device (torch's
    intra-op threads; None: 1, so that every core is a device). ``quick``: fewer
    repeats, no forward-only probes, the largest learner step left out (~20 s instead of
    ~60 s on an idle 2-core machine)."""
    threads = 1 if threads is None else threads
    if threads < 1:
        raise PlanError(f"calibration: threads={threads} must be at least 1")
    machine, cluster, probes = measure_probes(threads=threads, quick=quick)
    start = Efficiency(train_mfu=0.5, prefill_mfu=0.5, decode_bandwidth=0.5, decode_mfu=0.5,
                       layer_overhead_s=1e-4, step_overhead_s=1e-3, comm_bandwidth=0.5, comm_latency_s=1e-4)
    eff, fitted = fit_efficiency(probes, cluster, start=start)
    rows = [_probe_row(p, cluster, eff) for p in probes]
    return save_calibration(out, cluster, eff, fitted=fitted, machine=machine, probes=rows)
