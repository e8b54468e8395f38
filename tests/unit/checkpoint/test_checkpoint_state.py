"""Round trips of optimizer, LR schedule and RNG state through the checkpoint store."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, MultiStepLR

from rltune.checkpoint import (
    CheckpointError,
    load_checkpoint,
    optimizer_from_state,
    optimizer_to_state,
    rng_from_state,
    rng_to_state,
    save_checkpoint,
    scheduler_from_state,
    scheduler_to_state,
)


def _through_disk(tmp_path, tensors, meta):
    """Save and load back, so every value has gone through safetensors and JSON."""
    path = save_checkpoint(tmp_path, 1, tensors={"x": tensors}, meta={"m": meta}, keep=1)
    loaded, loaded_meta = load_checkpoint(path)
    return loaded["x"], loaded_meta["m"]


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def _train_step(model, opt, x, y):
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()


def _warmup(epoch: int) -> float:
    return min(1.0, (epoch + 1) / 4)


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1),
        lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True),
    ],
    ids=["adamw", "sgd"],
)
def test_optimizer_round_trip_gives_bitwise_identical_next_step(tmp_path, make_opt):
    x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), torch.randn(8, 2)
    model = _model(0)
    opt = make_opt(model.parameters())
    for _ in range(3):
        _train_step(model, opt, x, y)

    tensors, meta = _through_disk(tmp_path, *optimizer_to_state(opt))
    fresh = _model(5)
    fresh.load_state_dict(model.state_dict())
    fresh_opt = make_opt(fresh.parameters())
    optimizer_from_state(fresh_opt, tensors, meta)
    assert fresh_opt.param_groups[0].get("betas", (0.8, 0.95)) == (0.8, 0.95)

    _train_step(model, opt, x, y)
    _train_step(fresh, fresh_opt, x, y)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_optimizer_state_without_restore_differs(tmp_path):
    """Control for the test above: a fresh optimizer state does not give the same step."""
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        _train_step(model, opt, x, y)
    fresh = _model(5)
    fresh.load_state_dict(model.state_dict())
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    _train_step(model, opt, x, y)
    _train_step(fresh, fresh_opt, x, y)
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


def test_optimizer_state_layout():
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train_step(model, opt, torch.ones(2, 4), torch.zeros(2, 2))
    tensors, meta = optimizer_to_state(opt)
    assert sorted(tensors) == sorted(f"state.{i}.{n}" for i in range(4) for n in ("exp_avg", "exp_avg_sq", "step"))
    assert torch.equal(tensors["state.0.step"], torch.tensor(1.0))
    assert meta["param_groups"][0]["params"] == [0, 1, 2, 3]
    assert meta["state"] == {}


def test_optimizer_from_state_rejects_other_group_count():
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tensors, meta = optimizer_to_state(opt)
    two_groups = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=0.1)
    with pytest.raises(CheckpointError, match="1 param groups but the optimizer has 2"):
        optimizer_from_state(two_groups, tensors, meta)


def _lrs(sched_factory, steps: int, restore_at: int, tmp_path) -> tuple[list[float], list[float]]:
    """LRs of an uninterrupted schedule vs one saved at ``restore_at`` and restored."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)
    sched = sched_factory(opt)
    straight = []
    for i in range(steps):
        if i == restore_at:
            opt_tensors, opt_meta = optimizer_to_state(opt)
            meta = {"optimizer": opt_meta, "scheduler": scheduler_to_state(sched)}
            path = save_checkpoint(tmp_path, i, tensors={"optimizer": opt_tensors}, meta=meta, keep=1)
        straight.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()

    tensors, meta = load_checkpoint(path)
    new_opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)
    new_sched = sched_factory(new_opt)  # built before restoring: its constructor sets the lr
    optimizer_from_state(new_opt, tensors["optimizer"], meta["optimizer"])
    scheduler_from_state(new_sched, meta["scheduler"])
    resumed = []
    for _ in range(restore_at, steps):
        resumed.append(new_opt.param_groups[0]["lr"])
        new_opt.step()
        new_sched.step()
    return straight[restore_at:], resumed


def test_lambda_lr_with_plain_function_round_trips(tmp_path):
    straight, resumed = _lrs(lambda o: LambdaLR(o, _warmup), steps=7, restore_at=2, tmp_path=tmp_path)
    assert straight == [0.5 * 3 / 4, 0.5, 0.5, 0.5, 0.5]
    assert resumed == straight


def test_multistep_lr_counter_milestones_survive_json(tmp_path):
    factory = lambda o: MultiStepLR(o, milestones=[3, 5], gamma=0.5)  # noqa: E731
    straight, resumed = _lrs(factory, steps=7, restore_at=2, tmp_path=tmp_path)
    assert straight == [0.5, 0.25, 0.25, 0.125, 0.125]
    assert resumed == straight

    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)
    sched = factory(opt)
    _, meta = _through_disk(tmp_path, {}, scheduler_to_state(sched))
    assert meta["milestones"] == {"3": 1, "5": 1}  # what JSON gives back
    scheduler_from_state(sched, meta)
    assert type(sched.milestones) is Counter and sched.milestones == Counter({3: 1, 5: 1})


def _draw(generator: torch.Generator) -> tuple:
    return (
        random.random(),
        random.gauss(0.0, 1.0),
        np.random.rand(3).tolist(),
        np.random.normal(),
        torch.rand(3).tolist(),
        torch.randint(0, 1000, (4,), generator=generator).tolist(),
    )


def test_rng_round_trip_for_every_source(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    data_gen = torch.Generator().manual_seed(4)
    _draw(data_gen)
    random.gauss(0.0, 1.0)  # leaves a cached Gaussian in Python's state
    np.random.normal()  # and in numpy's

    tensors, meta = _through_disk(tmp_path, *rng_to_state({"data": data_gen}))
    first = _draw(data_gen)
    assert _draw(data_gen) != first

    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    data_gen.manual_seed(99)
    rng_from_state(tensors, meta, {"data": data_gen})
    assert _draw(data_gen) == first


def test_rng_from_state_rejects_other_generator_names():
    tensors, meta = rng_to_state({"data": torch.Generator()})
    with pytest.raises(CheckpointError, match=r"generators \['data'\] but \['noise'\] were passed"):
        rng_from_state(tensors, meta, {"noise": torch.Generator()})
    with pytest.raises(CheckpointError, match=r"generators \['data'\] but \[\] were passed"):
        rng_from_state(tensors, meta)


def test_rng_from_state_rejects_other_cuda_device_count():
    tensors, meta = rng_to_state()
    meta = meta | {"cuda_devices": meta["cuda_devices"] + 1}
    with pytest.raises(CheckpointError, match="CUDA RNG states for"):
        rng_from_state(tensors, meta)
