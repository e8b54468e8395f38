"""A Ray started here is not told of GPUs the machine does not have."""

from __future__ import annotations

import pytest
import torch

from rltune.config import load_config
from rltune.runtime.ray import cluster
from rltune.runtime.ray.cluster import RayRuntimeError, connect


def _runtime(*overrides: str):
    return load_config(None, ["reward.0.fn=m:f", "runtime.mode=ray", *overrides]).runtime


def test_a_placement_reserving_gpus_the_machine_lacks_is_refused_before_ray_starts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cluster.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(cluster.ray, "init", lambda **_: pytest.fail("Ray started"))
    runtime = _runtime("runtime.placement.learner.gpus=1", "runtime.placement.generator.gpus=1")
    with pytest.raises(RayRuntimeError, match=r"runtime.placement reserves 2 GPUs and this machine has 1; set "
                                              r"the roles' gpus \(runtime.placement.\*.gpus\) to fit"):
        connect(runtime)


def test_a_placement_that_fits_starts_ray(monkeypatch):
    started = {}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cluster.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(cluster.ray, "init", lambda **kw: started.update(kw))
    assert connect(_runtime("runtime.placement.learner.gpus=1")) is True
    assert started["num_gpus"] == 1
