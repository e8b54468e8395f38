"""Weights by broadcast (``runtime.weight_sync: broadcast``, gloo on CPU): the generators
end up with the learner's exact weights, a run trains step for step as it does with the
object store, and a generator that died between syncs is replaced and the channel formed
again with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray", reason="the ray extra is not installed")

from rltune.config import load_config  # noqa: E402
from rltune.models.load import resolve_model  # noqa: E402
from rltune.runtime.build import build_run as build_with_roles  # noqa: E402
from rltune.runtime.loop import train  # noqa: E402
from rltune.runtime.ray import sync  # noqa: E402
from rltune.runtime.ray.cluster import place  # noqa: E402
from rltune.runtime.ray.roles import RayRoles  # noqa: E402

REWARD = '''
def digit_share(prompt, completion, **meta):
    return sum(ch.isdigit() for ch in completion) / max(1, len(completion))
'''


def test_buckets_split_by_dtype_and_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sync, "BUCKET_BYTES", 40)
    tensors = {
        "a": torch.zeros(4),                      # 16 bytes
        "b": torch.zeros(4),                      # 16: a+b = 32 <= 40
        "c": torch.zeros(4),                      # would make 48: new bucket
        "d": torch.zeros(2, dtype=torch.float64),  # another dtype: new bucket
        "e": torch.zeros(20),                     # 80 bytes, larger than a bucket: its own
    }
    assert sync.buckets(tensors) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert sync.layout(tensors)[3] == ("d", (2,), "torch.float64")


@pytest.fixture
def config(tmp_path: Path):
    (tmp_path / "rewards.py").write_text(REWARD)
    model = resolve_model("builtin:tiny", cache_dir=str(tmp_path / "builtin"))

    def make(*overrides: str):
        return load_config(None, [
            "name=sync", f"model.path={model}", "algo.name=grpo", "algo.group_size=4",
            "data.train=builtin:arith_small/train", f"reward.0.fn={tmp_path / 'rewards.py'}:digit_share",
            "rollout.max_new_tokens=8", "train.steps=4", "train.prompts_per_step=4", "train.lr=1e-3",
            f"log.dir={tmp_path / 'runs'}", "log.console=false", "checkpoint.final=false",
            "runtime.mode=ray", "runtime.placement.generators=2", *overrides,
        ])

    return make


def start(cfg):
    placement = place(cfg.runtime.placement, name=f"test-{cfg.name}")
    roles = RayRoles(placement, None, Path(cfg.log.dir) / cfg.name)
    run = build_with_roles(cfg, roles)
    return run, lambda: (roles.close(), placement.remove())


def test_a_broadcast_run_trains_step_for_step_as_an_object_store_run(ray_cluster, config) -> None:
    histories = {}
    for sync_mode in ("object_store", "broadcast"):
        # one generator: the channel is the same group with one member fewer, and each run
        # starts two actor processes fewer (the slow test below forms it with two)
        run, close = start(config(f"name={sync_mode}", f"runtime.weight_sync={sync_mode}",
                                  "runtime.placement.generators=1"))
        try:
            histories[sync_mode] = train(run)
            if sync_mode == "broadcast":
                learner = run.learner.fetch_weights()
                for held in run.generator.pool.call_all("weights"):
                    assert held.keys() == learner.keys()
                    for name, value in learner.items():
                        assert torch.equal(held[name], value), name
                assert run.generator.version == run.learner.version == 4
        finally:
            close()
    rewards = {mode: [m["reward/mean"] for m in h] for mode, h in histories.items()}
    assert rewards["broadcast"] == rewards["object_store"]
    assert [m["loss"] for m in histories["broadcast"]] == [m["loss"] for m in histories["object_store"]]


@pytest.mark.slow
def test_a_generator_dead_between_syncs_is_replaced_and_the_channel_formed_again(ray_cluster, config) -> None:
    run, close = start(config("name=dead", "runtime.weight_sync=broadcast"))
    try:
        train(run)  # channel formed, 4 syncs
        pid = ray.get(run.generator.pool.actors[1].pid.remote())
        import os
        import signal
        os.kill(pid, signal.SIGKILL)
        run.generator.load_weights(run.learner.version, run.learner.export_weights())
        events = [(f["actor"], f["event"]) for f in map(json.loads, (run.run_dir / "faults.jsonl").read_text().splitlines())]
        assert sorted(events) == [(0, "reset"), (1, "restarted")]
        learner = run.learner.fetch_weights()
        for held in run.generator.pool.call_all("weights"):
            assert all(torch.equal(held[k], v) for k, v in learner.items())
        assert run.generator.version == run.learner.version
    finally:
        close()
