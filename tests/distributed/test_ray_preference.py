"""Preference methods with ``runtime.mode: ray``: the learner group (two ranks, DDP or
FSDP2, each given whole chosen/rejected pairs) trains DPO and a reward model step for step as one
process does, and the held-out preference metrics, computed by the ranks (the driver
loads no model), match the local run's.

Tolerance: the two ranks' gradients are averaged by an all-reduce, a different order of
float32 sums than one process's, so losses agree to ~1e-6 relative, not bitwise (as in
test_learner_group.py); 1e-4 leaves room for that over a few steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the ray extra is not installed")

from rltune.config import load_config  # noqa: E402
from rltune.runtime import preference as runtime_preference  # noqa: E402
from rltune.runtime import roles as runtime_roles  # noqa: E402
from rltune.models.load import resolve_model  # noqa: E402
from rltune.runtime.build import build_run as build_with_roles  # noqa: E402
from rltune.runtime.local import build_run  # noqa: E402
from rltune.runtime.loop import train  # noqa: E402
from rltune.runtime.ray.cluster import place  # noqa: E402
from rltune.runtime.ray.roles import RayRoles  # noqa: E402

METHODS = {"dpo": ["algo.beta=0.1", "train.lr=2e-3"], "reward_model": ["train.lr=1e-3"]}


def _not_on_the_driver(*args, **kwargs):
    raise AssertionError("a Ray run's driver loaded the preference model")


def history(tmp_path: Path, algo: str, mode: str, strategy: str = "ddp") -> list[dict]:
    model = resolve_model("builtin:tiny", cache_dir=str(tmp_path / "builtin"))
    cfg = load_config(None, [
        f"name={algo}-{mode}", f"model.path={model}", f"algo.name={algo}", *METHODS[algo],
        "data.train=builtin:arith_prefs/train", "data.eval=builtin:arith_prefs/eval",
        "data.chat_template=false", "train.steps=6", "train.prompts_per_step=16",
        "eval.every=3", "eval.max_prompts=64", f"log.dir={tmp_path / mode}", "log.console=false",
        "checkpoint.final=false", f"runtime.mode={mode}", "runtime.placement.learners=2",
        f"runtime.placement.learner_strategy={strategy}",
    ])
    if mode == "local":
        return train(build_run(cfg))
    placement = place(cfg.runtime.placement, name=f"test-{cfg.name}")
    roles = RayRoles(placement, None, Path(cfg.log.dir) / cfg.name)
    try:
        return train(build_with_roles(cfg, roles))
    finally:
        roles.close()
        placement.remove()


def held_out(tmp_path: Path, algo: str, mode: str, step: int) -> dict[str, float]:
    """The held-out preference metrics the run of ``history`` logged at ``step`` (those
    before the first step and after the last are in metrics.jsonl, not in the history)."""
    lines = (tmp_path / mode / f"{algo}-{mode}" / "metrics.jsonl").read_text().splitlines()
    evals = [m for m in map(json.loads, lines)
             if m["step"] == step and "eval/pref/accuracy" in m]
    assert len(evals) == 1, (mode, step, evals)
    return {k: v for k, v in evals[0].items() if k.startswith("eval/pref/")}


@pytest.mark.parametrize(("algo", "strategy"), [
    ("dpo", "ddp"),
    pytest.param("reward_model", "ddp", marks=pytest.mark.slow),
    pytest.param("reward_model", "fsdp2", marks=pytest.mark.slow),
])
def test_a_preference_method_trains_on_the_learner_group_as_in_one_process(
    ray_cluster, tmp_path: Path, algo: str, strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = history(tmp_path, algo, "local")
    # the Ray run's driver loads no model: the ranks compute DPO's reference and the
    # held-out metrics (the actors are other processes, which this does not touch)
    for where in (runtime_preference, runtime_roles):
        monkeypatch.setattr(where, "load_preference_model", _not_on_the_driver)
    ray_run = history(tmp_path, algo, "ray", strategy)
    assert len(local) == len(ray_run) == 6
    assert [m["loss"] for m in ray_run] == pytest.approx([m["loss"] for m in local], rel=1e-4)
    for mode in ("local", "ray"):  # it learned: held-out accuracy (past chance) and margin rose
        start, end = held_out(tmp_path, algo, mode, 0), held_out(tmp_path, algo, mode, 6)
        assert end["eval/pref/accuracy"] > max(start["eval/pref/accuracy"], 0.5), (mode, start, end)
        assert end["eval/pref/margin"] > start["eval/pref/margin"], (mode, start, end)
    evals = [(i, k) for i, m in enumerate(local) for k in m if k.startswith("eval/pref/")]
    assert {k for _, k in evals} == {"eval/pref/accuracy", "eval/pref/margin"}
    for i, key in evals:
        assert ray_run[i][key] == pytest.approx(local[i][key], rel=1e-4, abs=1e-6), (i, key)
