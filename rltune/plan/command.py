"""``rltune plan CONFIG.yaml --gpus N [...]``: the layout search for a config on a
cluster, printed as a table with reasons and the config sections (or ``--json``), and
optionally written into a copy of the config (``--write OUT.yaml``); ``rltune plan
--calibrate [--out FILE]`` fits the cost model's constants on this machine instead.

Bad input (flags that contradict each other, an unknown model, a cluster that cannot
hold the model at any layout) is a ``PlanError``: one line, exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

from rltune.plan.errors import PlanError
from rltune.plan.bounds import search_bound_problems

CLUSTER_FLAGS = ("gpus", "gpus_per_node", "gpu_memory_gb", "gpu_tflops", "intra_gbps", "inter_gbps", "preset")
DEFAULT_CALIBRATION = Path("plan-calibration.json")
SEED_MAX = 2**32 - 1
"""The largest ``--seed``: numpy's generator under Optuna's TPE sampler takes 0 .. 2**32-1."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``rltune plan`` flags."""
    p.add_argument("config", nargs="?", default=None, help="experiment YAML file (not with --calibrate)")
    p.add_argument("--gpus", type=int, default=None, help="devices in the cluster")
    p.add_argument("--gpus-per-node", type=int, default=None, help="devices per node (default: the preset's, 8)")
    p.add_argument("--gpu-memory-gb", type=float, default=None, help="memory of one device, GB")
    p.add_argument("--gpu-tflops", type=float, default=None, help="dense 16-bit TFLOP/s of one device")
    p.add_argument("--intra-gbps", type=float, default=None, help="GB/s between two devices of a node")
    p.add_argument("--inter-gbps", type=float, default=None, help="GB/s from a device to another node")
    p.add_argument("--preset", default=None, help="device preset: h100-80gb (default), a100-80gb, h200-141gb, b200-192gb")
    p.add_argument("--cluster", type=Path, default=None, help="the cluster as a YAML file (instead of the flags)")
    p.add_argument("--calibration", type=Path, default=None,
                   help="constants fitted by --calibrate (its CPU cluster unless --gpus changes the count)")
    p.add_argument("--score-s", type=float, default=None,
                   help="seconds the reward takes a sample, the run's reward workers together (time/score "
                        "of a run over its samples a step; default: the calibration's, else 0)")
    p.add_argument("--top", type=int, default=5, help="plans to show (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    p.add_argument("--write", type=Path, default=None, help="write the config with the best plan merged in")
    p.add_argument("--prompt-tokens", type=int, default=None, help="prompt length to plan for (default: data.max_prompt_tokens)")
    p.add_argument("--max-staleness", type=int, default=None,
                   help="search staleness 0..K (default: the config's runtime.max_staleness)")
    p.add_argument("--budget", type=int, default=20_000, help="enumerate spaces up to this size, else TPE (default 20000)")
    p.add_argument("--trials", type=int, default=400, help="TPE trials for larger spaces (default 400)")
    p.add_argument("--seed", type=int, default=0, help="TPE's seed (default 0)")
    p.add_argument("--calibrate", action="store_true", help="measure this machine and fit the cost model's constants")
    p.add_argument("--out", type=Path, default=None, help=f"with --calibrate: where to save them (default {DEFAULT_CALIBRATION})")


def flag_problems(args: argparse.Namespace) -> list[str]:
    """Every way the flags contradict each other or are out of range, one line each."""
    given = [f"--{f.replace('_', '-')}" for f in CLUSTER_FLAGS if getattr(args, f) is not None]
    problems = []
    if args.calibrate:
        others = (["CONFIG.yaml"] if args.config is not None else []) + given + [
            f"--{f.replace('_', '-')}" for f in ("write", "cluster", "calibration", "json", "score_s")
            if getattr(args, f) is not None and getattr(args, f) is not False]
        if others:
            problems.append(f"--calibrate measures this machine and writes --out; it takes no {', '.join(others)}")
        return problems + _path_problems("--out", args.out, makes_parent=True)
    if args.out is not None:
        problems.append("--out is where --calibrate saves its constants; to write a planned config use --write")
    problems += _path_problems("--write", args.write)
    if args.config is None:
        problems.append("give the experiment config: rltune plan CONFIG.yaml --gpus N")
    if args.cluster is not None and given:
        problems.append(f"--cluster FILE describes the cluster; drop {', '.join(given)} (or drop --cluster)")
    if args.calibration is not None and (args.cluster is not None or [g for g in given if g != "--gpus"]):
        problems.append("--calibration brings its own (CPU) cluster; only --gpus may change its device count")
    if args.cluster is None and args.calibration is None and args.gpus is None:
        problems.append("describe the cluster: --gpus N (with --preset, --gpu-memory-gb, ...), --cluster FILE "
                        "or --calibration FILE")
    for flag in ("gpus", "top", "trials", "budget", "prompt_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            problems.append(f"--{flag.replace('_', '-')} {value}: must be at least 1")
    if args.max_staleness is not None and args.max_staleness < 0:
        problems.append(f"--max-staleness {args.max_staleness}: must be 0 or more")
    problems += search_bound_problems(args.gpus or 0, args.max_staleness or 0)
    if not 0 <= args.seed <= SEED_MAX:
        problems.append(f"--seed {args.seed}: must be 0 .. 2**32-1 ({SEED_MAX}), the seeds TPE's sampler takes")
    if args.score_s is not None and not (math.isfinite(args.score_s) and args.score_s >= 0):
        problems.append(f"--score-s {args.score_s}: must be a finite number of seconds, 0 or more")
    return problems


def _path_problems(flag: str, path: Path | None, *, makes_parent: bool = False) -> list[str]:
    """Why ``path`` cannot be the file ``flag`` writes (checked before any work): empty,
    a directory, or in a directory that does not exist (unless the writer makes it)."""
    if path is None:
        return []
    if not str(path).strip() or path.name in ("", ".", ".."):
        return [f"{flag} {str(path)!r}: give a file name"]
    if path.is_dir():
        return [f"{flag} {path}: is a directory; give the path of a file"]
    if not makes_parent and not path.parent.is_dir():
        return [f"{flag} {path}: its directory {path.parent} does not exist"]
    return []


def cluster_and_efficiency(args: argparse.Namespace) -> tuple[Any, Any]:
    """The ``Cluster`` and ``Efficiency`` the flags describe, ``--score-s`` set in the latter."""
    cluster, eff = _cluster_and_efficiency(args)
    return cluster, eff if args.score_s is None else dataclasses.replace(eff, score_s=args.score_s)


def _cluster_and_efficiency(args: argparse.Namespace) -> tuple[Any, Any]:
    from rltune.plan.spec import Efficiency

    if args.calibration is not None:
        from rltune.plan.calibration_file import load_calibration

        cluster, eff = load_calibration(args.calibration)
        if args.gpus is not None:
            cluster = dataclasses.replace(cluster, gpus=args.gpus, gpus_per_node=max(args.gpus, cluster.gpus_per_node))
        return cluster, eff
    if args.cluster is not None:
        from rltune.plan.cluster import load_cluster

        return load_cluster(args.cluster), Efficiency()
    from rltune.plan.cluster import cluster_from_args

    return cluster_from_args(args.gpus, args.gpus_per_node, args.gpu_memory_gb, args.gpu_tflops, args.intra_gbps,
                             args.inter_gbps, args.preset or "h100-80gb"), Efficiency()


def nothing_fits(spec: Any, work: Any, cluster: Any, result: Any, engine: str = "vllm",
                 notes: tuple[str, ...] = ()) -> PlanError:
    """The error for a cluster on which no layout fits: how many devices the learner alone
    would need when it is too few, else the most common reason; ``notes``: what the
    config kept out of the search."""
    from rltune.plan.memory import min_devices_to_fit

    left_out = "".join(f"; {note}" for note in notes)
    need = min_devices_to_fit(spec, work, cluster)
    if need > cluster.gpus:
        return PlanError(f"{spec.name} does not fit {cluster.gpus} device(s) of {cluster.memory_gb:g} GB at any layout: "
                         f"its learner alone needs at least {need} such devices (fully sharded, every block "
                         f"checkpointed, parameters offloaded where that fits on fewer), before any "
                         f"generator{left_out}")
    top = next(iter(result.examples.values()), "no candidate")
    how = (f"all {result.space_size} evaluated" if result.method == "exhaustive" else
           f"{result.evaluated} of {result.space_size} evaluated by TPE; --budget {result.space_size} evaluates them all")
    hint = ""
    if engine != "vllm" and top.startswith("generator"):
        hint = ("; rollout.engine: hf holds the whole model on one generator device, rollout.engine: vllm "
                "lets the plan split it (rollout.vllm.tensor_parallel_size)")
    return PlanError(f"no layout of {spec.name} fits {cluster.gpus} device(s) of {cluster.memory_gb:g} GB "
                     f"({how}); most common reason: {top}{hint}{left_out}")


def cmd_plan(args: argparse.Namespace, console: Any) -> int:
    """``rltune plan``; returns the exit status."""
    problems = flag_problems(args)
    if problems:
        raise PlanError("; ".join(problems))
    if args.calibrate:
        from rltune.plan.calibrate import run_calibration  # imports torch: only here

        path = run_calibration(args.out or DEFAULT_CALIBRATION)
        console.print(f"calibration written to {path}")
        return 0
    from rltune.config import load_config
    from rltune.plan.catalogue import load_model_spec, param_count
    from rltune.plan.report import format_table, reasons, rejections_text, search_line, sections_yaml, to_json
    from rltune.plan.report import config_sections, runtime_notes, write_config
    from rltune.plan.search import default_space, plan
    from rltune.plan.workload import refused_degrees, workload_from_config

    cfg = load_config(args.config)
    cluster, eff = cluster_and_efficiency(args)
    spec = load_model_spec(cfg.model.path)
    work = workload_from_config(cfg, prompt_tokens=args.prompt_tokens)
    space = default_space(spec, work, cluster, engine=cfg.rollout.engine, max_staleness=args.max_staleness,
                          micro_batch_tokens=cfg.train.micro_batch_tokens, refused=refused_degrees(cfg, spec))
    result = plan(spec, work, cluster, eff, top=args.top, space=space, budget=args.budget, trials=args.trials,
                  seed=args.seed)
    if not result.plans:
        raise nothing_fits(spec, work, cluster, result, cfg.rollout.engine, space.notes)
    if args.write is not None:
        write_config(args.config, result.plans[0], args.write, cluster)
    if args.json:
        print(json.dumps(to_json(result, model=spec.name, params=param_count(spec), cluster=cluster, base=cfg,
                                 work=work, notes=space.notes), indent=1))
    else:
        out = [f"{spec.name} ({param_count(spec) / 1e9:.2f} B parameters), {work.algo}: "
               f"{work.prompts_per_step} prompts x {work.group_size}, {work.prompt_tokens} + {work.completion_tokens} tokens, "
               f"{work.precision}", search_line(result, cluster), "", format_table(result.plans), "",
               reasons(result), *[f"note: {n}" for n in (*space.notes, *runtime_notes(result.plans[0], work))], "",
               rejections_text(result), "", "# the best plan's config sections:",
               sections_yaml(config_sections(result.plans[0], cluster, cfg))]
        sys.stdout.write("\n".join(out))
    if args.write is not None:
        console.print(f"planned config written to {args.write}")
    return 0
