"""``train.compile`` in a learner group of two real processes (gloo, CPU): with DDP and
with FSDP2 (the blocks compiled before the wrapper or ``fully_shard`` sees them), two
compiled steps give the weights one eager process gets on the whole batch.

Tolerances, as in tests/distributed/test_learner_group.py: the group's gradient is the
same sum in another order (fp32 rounding, ~1e-7 relative), and with Adam's eps 1e-3 the
update's slope is at most lr / eps = 1, so weights agree within 1e-6 after each step. The
``eager`` backend runs the traced graphs as they are (the same operations), so the bound
is the group's alone; inductor (slow) reorders the blocks' sums as well, which
tests/unit/learner/fp32_bounds.py bounds by the same kind of rounding: the same 1e-6.
"""

from __future__ import annotations

import copy

import pytest
import torch
from compile_workers import compile_learner, compiled_group_run
from learner_group_workers import make_batch

from rltune.data.records import TrainBatch
from rltune.learner.launch import spawn_learner_group
from rltune.models.load import load_model

PARAM_ATOL = 1e-6


@pytest.fixture(scope="module")
def batch(model_dir: str) -> TrainBatch:
    return make_batch(load_model(model_dir))  # its reference log-probs are unused: no KL


@pytest.fixture(scope="module")
def single(model_dir: str, batch: TrainBatch) -> list[dict]:
    """One eager process, two steps on the whole batch: the weights after each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        learner = compile_learner(load_model(model_dir), False)
        return [(learner.step(batch), {k: v.clone() for k, v in learner.export_weights().items()})[1]
                for _ in range(2)]
    finally:
        torch.set_num_threads(threads)


@torch.no_grad()
def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def check(group: list[dict], single: list[dict], initial: dict[str, torch.Tensor]) -> None:
    for strategy in ("ddp", "fsdp2"):
        for step in range(2):
            ranks = [g[strategy][step]["weights"] for g in group]
            assert max_abs_diff(single[step], initial) > 100 * PARAM_ATOL  # the step moved the weights
            assert max_abs_diff(ranks[0], single[step]) <= PARAM_ATOL, (strategy, step)
            assert max_abs_diff(ranks[0], ranks[1]) == 0.0
    assert all(g["graphs"] > 0 for g in group)  # the blocks really ran compiled


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_compiled_group_steps_as_one_eager_process(model_dir: str, batch: TrainBatch, single: list[dict],
                                                      backend: str) -> None:
    group = spawn_learner_group(2, compiled_group_run, model_dir, batch, backend, backend="gloo", timeout_s=600)
    initial = {k: v.detach() for k, v in load_model(model_dir).state_dict().items()}
    check(group, single, initial)
