"""What ``rltune plan`` prints and writes: a table of the best layouts, a paragraph of
reasons for the first one built from the numbers, the most common rejections, the config
sections of a plan (to paste, or merged into the input config with ``--write``) and the
same as one JSON object (``--json``). No torch."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from rltune.config.runtime import RAY_ONLY
from rltune.plan.errors import PlanError
from rltune.plan.search import PlanResult
from rltune.plan.spec import GB, Candidate, Cluster, Plan, StepTime, Workload

COLUMNS = ("#", "layout", "stale", "mbt", "ckpt", "offload", "sync", "learner GB", "gen GB",
           "generate s", "learn s", "comm s", "sync s", "step s", "samples/s", "gen busy", "learn busy")
"""The table's columns: memory is per device of each role; ``learn s`` holds the
reference forwards, forward and backward, optimizer and exposed communication, ``comm s``
that communication alone (with the pipeline's bubble, its stages' idle time); ``sync s``
the weight sync; busy shares of the step."""


def layout_text(c: Candidate) -> str:
    """One line for a candidate's devices: ``3 gen x tp1 + 5 learn [dp_shard=5]`` apart,
    ``8 colocated [dp_shard=4 tp=2]`` colocated (generators on the learners' devices)."""
    degrees = " ".join(f"{k}={getattr(c.learner, k)}" for k in ("dp_replicate", "dp_shard", "tp", "pp", "ep")
                       if getattr(c.learner, k) > 1) or "one rank"
    if c.colocate:
        return f"{c.learner_gpus} colocated [{degrees}]"
    if c.generator_replicas == 0:
        return f"{c.learner_gpus} learn [{degrees}]"
    return f"{c.generator_replicas} gen x tp{c.generator_tp} + {c.learner_gpus} learn [{degrees}]"


def _row(rank: int, p: Plan) -> list[str]:
    c, t = p.candidate, p.time
    gen = p.memory.get("generator")
    busy = p.utilisation
    return [str(rank), layout_text(c), str(c.max_staleness), str(c.micro_batch_tokens), c.activation_checkpointing,
            c.offload, "-" if c.colocate or gen is None else c.weight_sync.replace("object_store", "store"),
            f"{p.memory['learner'].total / GB:.1f}", "-" if gen is None else f"{gen.total / GB:.1f}",
            f"{t.generate + t.score:.2f}", f"{t.learn:.2f}", f"{sum(t.comm.values()):.2f}", f"{t.weight_sync:.2f}",
            f"{t.step:.2f}", f"{p.samples_per_s:.2f}",
            f"{busy['generator']:.0%}" if "generator" in busy else "-", f"{busy.get('learner', 0.0):.0%}"]


def format_table(plans: tuple[Plan, ...] | list[Plan]) -> str:
    """The plans as a plain-text table, one row each, columns :data:`COLUMNS`."""
    rows = [list(COLUMNS)] + [_row(i + 1, p) for i, p in enumerate(plans)]
    widths = [max(len(r[j]) for r in rows) for j in range(len(COLUMNS))]
    lines = ["  ".join(cell.rjust(w) if j != 1 else cell.ljust(w) for j, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def search_line(result: PlanResult, cluster: Cluster) -> str:
    """How the answer was found: how many candidates, which method, how many fit."""
    how = ("every candidate priced" if result.method == "exhaustive" else
           f"Optuna TPE, {result.suggestions} trials (seed {result.seed}) and a climb over "
           f"{result.climbed} one-knob changes from its best plans of 5 role splits")
    return (f"{cluster.gpus} x {cluster.name} ({cluster.memory_gb:g} GB): {result.space_size:,} candidates, "
            f"{result.evaluated:,} evaluated ({how}); {result.fitting:,} of those fit")


def rejections_text(result: PlanResult, most: int = 3) -> str:
    """The most common reasons candidates were rejected, with counts and one example."""
    if not result.rejected:
        return "every evaluated candidate fits in memory"
    lines = [f"{result.evaluated - result.fitting:,} rejected; most common reasons:"]
    for kind, count in list(result.rejected.items())[:most]:
        lines.append(f"  {count:,} x {result.examples[kind]}")
    return "\n".join(lines)


def _pct(a: float, b: float) -> str:
    """How much faster ``a`` is than ``b``, as a percentage of ``b`` (``+25%``)."""
    if b <= 0:
        return "n/a"
    gain = a / b - 1
    return f"{gain:+.1%}" if abs(gain) < 0.01 else f"{gain:+.0%}"


def _placement_reason(best: Plan, result: PlanResult) -> str:
    c, t = best.candidate, best.time
    if c.generator_replicas == 0:
        return "The algorithm learns from a fixed dataset, so every device learns."
    other = result.alternatives.get("apart" if c.colocate else "colocated")
    if c.colocate:
        head = (f"Colocated: all {c.learner_gpus} devices generate ({t.generate:.2f} s) then learn ({t.learn:.2f} s) "
                f"in turn, holding both roles' memory ({best.memory['learner'].total / GB + best.memory['generator'].total / GB:.1f} GB a device).")
        if other is None:
            return head + " No layout with generators on devices of their own fits or was found."
        return head + (f" The best layout with generators apart ({layout_text(other.candidate)}) reaches "
                       f"{other.samples_per_s:.2f} samples/s (this plan: {_pct(best.samples_per_s, other.samples_per_s)}); "
                       f"its step is {other.time.step:.2f} s.")
    head = (f"Generators apart: {c.generator_replicas} engine(s) of TP {c.generator_tp} on {c.generator_gpus} devices, "
            f"{c.learner_gpus} learner devices.")
    if other is None:
        return head + " No colocated layout fits (both roles' memory on one device)."
    return head + (f" Colocated, every device would generate and learn in turn: the best such layout "
                   f"({layout_text(other.candidate)}) takes {other.time.step:.2f} s a step, "
                   f"{other.samples_per_s:.2f} samples/s (this plan: {_pct(best.samples_per_s, other.samples_per_s)}).")


def _staleness_reason(best: Plan, result: PlanResult) -> str:
    c, t = best.candidate, best.time
    others = {k: p for k, p in result.alternatives.items() if k.startswith("staleness=") and k != f"staleness={c.max_staleness}"}
    if c.generator_replicas == 0:
        return ""
    if c.max_staleness > 0:
        zero = others.get("staleness=0")
        text = (f"max_staleness {c.max_staleness}: the next batch is generated while this one is learned, so the step is "
                f"max(generate + score {t.generate + t.score:.2f}, learn {t.learn:.2f}) + sync {t.weight_sync:.2f} = {t.step:.2f} s")
        if zero is not None:
            text += (f"; on-policy (staleness 0) the best plan reaches {zero.samples_per_s:.2f} samples/s "
                     f"(this plan: {_pct(best.samples_per_s, zero.samples_per_s)})")
        return text + "."
    faster = [p for p in others.values() if p.samples_per_s > best.samples_per_s * (1 + 1e-9)]
    if not others:
        return "Staleness 0 only was searched (raise it with --max-staleness or runtime.max_staleness)."
    if faster:  # cannot happen for the best plan; kept honest
        return ""
    why = "colocated devices cannot overlap the two phases" if c.colocate else "overlap gains nothing here"
    return f"Staleness 0 (on-policy): a stale plan is no faster ({why}), so none is taken."


def _dominant(t: StepTime) -> tuple[str, float]:
    parts = {"prefill": t.prefill, "decode": t.decode, "scoring": t.score, "reference forwards": t.reference,
             "forward and backward": t.forward_backward, "optimizer": t.optimizer, "weight sync": t.weight_sync}
    parts |= {f"{kind} communication": s for kind, s in t.comm.items()}
    return max(parts.items(), key=lambda kv: (kv[1], kv[0]))


def _dominant_reason(best: Plan) -> str:
    t = best.time
    name, seconds = _dominant(t)
    total = t.generate + t.score + t.learn + t.weight_sync
    busy = ", ".join(f"{role}s busy {share:.0%}" for role, share in sorted(best.utilisation.items()))
    return (f"The step ({t.step:.2f} s) is dominated by {name}: {seconds:.2f} s, {seconds / total:.0%} of the "
            f"work of a step (generate {t.generate:.2f}, score {t.score:.2f}, learn {t.learn:.2f} of which "
            f"communication {sum(t.comm.values()):.2f}, sync {t.weight_sync:.2f}); {busy}.")


_FIELDS = ("colocate", "generator_tp", "generator_replicas", "micro_batch_tokens", "activation_checkpointing",
           "offload", "max_staleness", "weight_sync")


def differences(a: Candidate, b: Candidate) -> list[str]:
    """``field a -> b`` for each knob where ``b`` differs from ``a``."""
    out = [f"{k} {getattr(a.learner, k)} -> {getattr(b.learner, k)}" for k in ("dp_replicate", "dp_shard", "tp", "pp", "ep")
           if getattr(a.learner, k) != getattr(b.learner, k)]
    return out + [f"{k} {getattr(a, k)} -> {getattr(b, k)}" for k in _FIELDS if getattr(a, k) != getattr(b, k)]


def _runner_up_reason(result: PlanResult) -> str:
    if len(result.plans) < 2:
        return ""
    best = result.plans[0]
    # the first whose devices differ, else the next one (a knob such as the sync may be all that differs)
    second = next((p for p in result.plans[1:] if layout_text(p.candidate) != layout_text(best.candidate)),
                  result.plans[1])
    peak = lambda p: max(m.total for m in p.memory.values()) / GB  # noqa: E731
    return (f"The runner-up ({', '.join(differences(best.candidate, second.candidate))}) reaches "
            f"{second.samples_per_s:.2f} samples/s ({_pct(second.samples_per_s, best.samples_per_s)}) with "
            f"{peak(second):.1f} GB on its fullest device against {peak(best):.1f}.")


def reasons(result: PlanResult) -> str:
    """A paragraph on the first plan, built from the search's numbers: why colocated or
    not, why this staleness, what dominates the step, what the runner-up trades."""
    if not result.plans:
        return "No plan fits."
    best = result.plans[0]
    parts = [_placement_reason(best, result), _staleness_reason(best, result), _dominant_reason(best),
             _runner_up_reason(result)]
    return " ".join(p for p in parts if p)


def runtime_notes(plan: Plan, work: Workload) -> list[str]:
    """What the written config asks of the cluster beyond the plan's devices: on Ray, the
    reference model of an online run with a KL term and PPO's critic are actors of their
    own, each reserving a learner's resources (``rltune.runtime.ray.roles.model_roles``),
    while the cost model holds them on the learner devices."""
    if plan.candidate.gpus == 1:
        return []
    extra = [role for role, needed in (("reference model", work.generates and work.reference),
                                       ("critic", work.critic)) if needed]
    if not extra:
        return []
    return [f"on Ray, rltune runs the {' and the '.join(extra)} as actor(s) of their own, each reserving a "
            f"learner's resources (runtime.placement.learner): the run needs {plan.candidate.gpus + len(extra)} "
            f"devices, not {plan.candidate.gpus}; the memory and time above count them on the learner devices"]


def _resources(gpus: float, cluster: Cluster | None) -> dict[str, float]:
    """A role's ``RoleResources``: on a CPU cluster one core and no GPU."""
    if cluster is not None and cluster.kind == "cpu":
        return {"cpus": 1.0, "gpus": 0.0}
    return {"cpus": 1.0, "gpus": float(gpus)}




def _runtime_section(c: Candidate, cluster: Cluster | None, *, parallel: bool) -> dict[str, Any]:
    """``runtime`` of a candidate: one device is the local runtime (``mode``, ``device``,
    ``max_staleness``); more are Ray actors placed by ``placement``, with the weight sync.
    ``learner_strategy`` is written only for a learner without ``train.parallel``: where
    there is one, its degrees are the layout and rltune reads no strategy beside them."""
    if c.gpus == 1:
        runtime: dict[str, Any] = {"mode": "local", "max_staleness": c.max_staleness}
        if cluster is not None:
            runtime["device"] = "cpu" if cluster.kind == "cpu" else "cuda"
        return runtime
    learner_gpu, generator_gpu = (0.5, 0.5) if c.colocate else (1.0, float(c.generator_tp))
    placement: dict[str, Any] = {"generators": max(1, c.generator_replicas), "learners": c.learner_gpus,
                                 "colocate": c.colocate}
    if not parallel:
        placement["learner_strategy"] = "fsdp2" if c.learner.dp_shard > 1 else "ddp"
    placement["learner"] = _resources(learner_gpu, cluster)
    placement["generator"] = _resources(0.0 if c.generator_replicas == 0 else generator_gpu, cluster)
    return {"mode": "ray", "placement": placement, "max_staleness": c.max_staleness, "weight_sync": c.weight_sync}


def config_sections(plan: Plan, cluster: Cluster | None = None, base: Any = None) -> dict[str, Any]:
    """The config keys of ``plan`` as nested sections: ``runtime`` (:func:`_runtime_section`:
    ``mode``, and ``placement`` and ``weight_sync`` on Ray, ``max_staleness``), ``train``
    (``parallel``, ``micro_batch_tokens``, ``activation_checkpointing``, ``offload``),
    ``rollout.vllm.tensor_parallel_size`` for engines over several devices, and
    ``algo.importance_correction: token-truncate`` when the plan is stale and ``base`` (the
    loaded input ``Config``, or None) has none (rltune refuses staleness without it). One
    device is the local runtime (one process, ``runtime.device`` the cluster's kind:
    ``cuda`` or ``cpu``); more are Ray actors, a learner a device, a generator
    ``generator_tp`` devices, or half of a learner's device each when colocated. A plan
    with ``offload: optimizer`` (a replicated learner, see
    :func:`~rltune.plan.search.offload_ok`) has no ``train.parallel``: its learners are a
    DDP group (``learner_strategy: ddp``), whose parameters stay whole, as that offload
    needs; so has a LoRA plan on Ray (``base.model.lora``: rltune writes a LoRA
    checkpoint from a DDP group only, and the search gives it no other layout); every
    other plan's layout is its ``train.parallel``, with no ``learner_strategy``. The
    input's ``sequence_parallel: true`` stays where the plan has tp > 1 and pp = 1 (the
    search does not price it; it only shrinks activations) and is set false elsewhere."""
    c, lay = plan.candidate, plan.candidate.learner
    lora_on_ray = c.gpus > 1 and base is not None and base.model.lora is not None
    parallel = c.offload != "optimizer" and not lora_on_ray
    train: dict[str, Any] = {}
    if parallel:
        train["parallel"] = {"dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard, "tp": lay.tp, "pp": lay.pp,
                             "ep": lay.ep, "pp_schedule": lay.pp_schedule}
        if base is not None and base.train.parallel.sequence_parallel:  # kept where the plan's layout can have it
            train["parallel"]["sequence_parallel"] = lay.tp > 1 and lay.pp == 1
    train |= {"micro_batch_tokens": c.micro_batch_tokens, "activation_checkpointing": c.activation_checkpointing,
              "offload": c.offload}
    sections: dict[str, Any] = {"runtime": _runtime_section(c, cluster, parallel=parallel), "train": train}
    if c.max_staleness > 0 and (base is None or base.algo.importance_correction == "none"):
        sections["algo"] = {"importance_correction": "token-truncate"}
    if c.generator_tp > 1 and not c.colocate:
        sections["rollout"] = {"vllm": {"tensor_parallel_size": c.generator_tp}}
    return sections


def _drop_replaced(merged: dict[str, Any], sections: dict[str, Any]) -> None:
    """Remove from ``merged`` the input's keys that the plan's sections replace by leaving
    them out: ``train.parallel`` for a DDP learner (the input's layout would shard it),
    ``runtime.placement.learner_strategy`` beside a planned ``train.parallel`` (not read
    there), the Ray keys (:data:`~rltune.config.runtime.RAY_ONLY`) of a local plan, and ``runtime.device`` of a
    Ray plan (each actor's device comes from its placement)."""
    train, runtime = merged.get("train"), merged.get("runtime")
    if "parallel" not in sections["train"] and isinstance(train, dict):
        train.pop("parallel", None)
    if not isinstance(runtime, dict):
        return
    if sections["runtime"]["mode"] == "local":
        for key in RAY_ONLY:
            runtime.pop(key, None)
        return
    runtime.pop("device", None)
    placement = runtime.get("placement")
    if "parallel" in sections["train"] and isinstance(placement, dict):
        placement.pop("learner_strategy", None)


def sections_yaml(sections: dict[str, Any]) -> str:
    """The sections as YAML to paste into a config."""
    return yaml.safe_dump(sections, sort_keys=False)


def merge(base: dict[str, Any], sections: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``sections`` written over it key by key (nested mappings merged)."""
    out = dict(base)
    for key, value in sections.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def write_config(base_cfg_path: str | Path, plan: Plan, out_path: str | Path, cluster: Cluster | None = None) -> Path:
    """Write the input config with the plan's sections merged in to ``out_path`` as YAML,
    and check that rltune's loader accepts it. Relative paths in a config (data, reward
    files) resolve against its own directory, so the result is meant to sit beside the
    input. Raises ``PlanError`` naming the file when either cannot be read or written, or
    the merged config is refused."""
    from rltune.config import ConfigError, load_config

    base_path, out = Path(base_cfg_path), Path(out_path)
    if out.resolve() == base_path.resolve():
        raise PlanError(f"--write {out} is the input config: writing it would replace the file (its comments "
                        "and layout lost); write the plan to another file beside it")
    try:
        base_cfg = load_config(base_path)
        data = yaml.safe_load(base_path.read_text(encoding="utf-8")) or {}
    except (OSError, ConfigError) as err:
        raise PlanError(f"--write: cannot read the input config {base_path}: {err}") from None
    sections = config_sections(plan, cluster, base_cfg)
    merged = merge(data, sections)
    _drop_replaced(merged, sections)
    # written beside ``out`` and checked there (its relative paths resolve from that
    # directory), then renamed over it: a refused plan leaves a file already at ``out`` as it was
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(yaml.safe_dump(merged, sort_keys=False, allow_unicode=True), encoding="utf-8")
        load_config(tmp)
        os.replace(tmp, out)
    except OSError as err:
        raise PlanError(f"--write: cannot write {out}: {err.strerror}") from None
    except ConfigError as err:
        raise PlanError(f"--write: the planned config for {out} is refused by rltune (nothing written): "
                        f"{str(err).replace(str(tmp), str(out))}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return out


def layout_json(c: Candidate) -> dict[str, Any]:
    """A candidate in the config's names."""
    return {"colocate": c.colocate, "generators": c.generator_replicas, "generator_tp": c.generator_tp,
            "generator_gpus": c.generator_gpus, "learners": c.learner_gpus,
            "dp_replicate": c.learner.dp_replicate, "dp_shard": c.learner.dp_shard, "tp": c.learner.tp,
            "pp": c.learner.pp, "ep": c.learner.ep, "pp_schedule": c.learner.pp_schedule,
            "micro_batch_tokens": c.micro_batch_tokens, "activation_checkpointing": c.activation_checkpointing,
            "offload": c.offload, "max_staleness": c.max_staleness, "weight_sync": c.weight_sync}


def plan_json(p: Plan) -> dict[str, Any]:
    """One plan: ``fits``, ``memory_gb`` per role (total and by kind), ``step_s``, the
    step's phases in seconds, ``samples_per_s``, ``utilisation``, ``layout``, ``problems``."""
    t = p.time
    return {"fits": p.fits, "memory_gb": {role: round(m.total / GB, 3) for role, m in p.memory.items()},
            "memory_gb_by_kind": {role: {k: round(v, 3) for k, v in m.as_gb().items()} for role, m in p.memory.items()},
            "step_s": t.step, "time_s": {"generate": t.generate, "prefill": t.prefill, "decode": t.decode,
                                         "score": t.score, "learn": t.learn, "reference": t.reference,
                                         "forward_backward": t.forward_backward, "optimizer": t.optimizer,
                                         "comm": dict(t.comm), "weight_sync": t.weight_sync},
            "samples_per_s": p.samples_per_s, "utilisation": dict(p.utilisation), "layout": layout_json(p.candidate),
            "problems": list(p.problems)}


def to_json(result: PlanResult, *, model: str, params: int, cluster: Cluster, base: Any = None,
            work: Workload | None = None, notes: tuple[str, ...] = ()) -> dict[str, Any]:
    """The answer as one JSON-able object: the model and its ``params``, whether any plan
    ``fits``, the best plan's ``memory_gb``, ``step_s``, ``samples_per_s`` and ``layout``
    at the top level, then the search's account, the ranked ``plans``, the rejection
    counts, the reasons, the ``notes`` (what the config kept out of the search, then what
    the written config asks of the cluster) and the best plan's config sections."""
    best = result.plans[0] if result.plans else None
    top = plan_json(best) if best is not None else {"memory_gb": {}, "step_s": None, "samples_per_s": 0.0, "layout": None}
    return {"model": model, "params": params, "gpus": cluster.gpus, "cluster": cluster.name,
            "fits": best is not None, "memory_gb": top["memory_gb"], "step_s": top["step_s"],
            "samples_per_s": top["samples_per_s"], "layout": top["layout"],
            "search": {"method": result.method, "space_size": result.space_size, "evaluated": result.evaluated,
                       "suggestions": result.suggestions, "climbed": result.climbed, "fitting": result.fitting,
                       "seed": result.seed},
            "plans": [plan_json(p) for p in result.plans],
            "rejected": [{"reason": result.examples[k], "kind": k, "count": n} for k, n in result.rejected.items()],
            "reasons": reasons(result),
            "notes": [*notes, *(runtime_notes(best, work) if best is not None and work is not None else [])],
            "config": config_sections(best, cluster, base) if best is not None else None}
