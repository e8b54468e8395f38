"""Pipeline parallelism (``rltune/parallel/pipeline.py``): ``pp=2`` learner groups on
gloo equal one process after two optimizer steps (loss, whole-model gradient norm,
every weight), with GPipe and 1F1B; no-grad prediction through the stages; the pieces
(layer split, equal micro-batches, tied embeddings) on their own.

Tolerance. Every rank computes in float32 the same operations as one process on the same
rows; what differs is the shape of the tensors (micro-batches padded to one shape: more
masked keys in attention's softmax, more zero rows in reductions) and the order of a few
sums (the norm's squares summed per stage, then over stages). Each is a reordering of
float32 sums of O(10..10^3) terms, relative error ~ n * 2^-24 ~ 1e-5 at worst on values
of order 1, so losses and norms compare at rtol 1e-5 and weights (moved by Adam with
``eps=1e-3``, slope <= lr/eps = 1, see learner_group_workers.ADAM_EPS) at atol 1e-6.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from learner_group_workers import BUDGET, make_batch, make_learner  # noqa: E402

from rltune.learner.launch import spawn_learner_group  # noqa: E402
from rltune.learner.parallel import NoParallelism, StepPlan  # noqa: E402
from rltune.metrics.types import scalars  # noqa: E402
from rltune.models.load import load_model, resolve_model  # noqa: E402
from rltune.parallel.pipeline import equalise, split_model, stage_layer_ranges  # noqa: E402

RTOL = 1e-5
ATOL_WEIGHTS = 1e-6


class PipelineOnly:
    """The strategy of a group whose only dim is ``pp`` (every rank the same rows): the
    pipeline pieces without a data-parallel layer, so this file tests the pipeline alone."""

    device = torch.device("cpu")

    def __init__(self, schedule: str, break_tied: bool = False) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.mesh = init_device_mesh("cpu", (self.world,), mesh_dim_names=("pp",))
        self.schedule, self.break_tied = schedule, break_tied
        self.pipeline = None

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from rltune.parallel.pipeline import build_pipeline

        self.pipeline = build_pipeline(model, self.mesh, schedule=self.schedule, device=self.device)
        if self.break_tied:  # the deliberate mistake: the tied copies learn apart
            self.pipeline.tied_group = None
        return self.pipeline.stage

    def place(self, batch):
        return batch

    def agree(self, rows: int, forwards: int, denominator) -> StepPlan:
        return StepPlan(denominator, forwards)

    def gradient_sync(self, module, sync: bool):
        return contextlib.nullcontext()

    def clip_grad_norm(self, params, max_norm: float) -> torch.Tensor:
        return self.pipeline.clip_grad_norm(params, max_norm)

    def all_reduce_metrics(self, metrics):
        return metrics

    def sum(self, tensor):
        return tensor

    def full_state_dict(self, model):
        return self.pipeline.full_state_dict({k: v.detach() for k, v in model.state_dict().items()})


def run_steps(learner, batch, steps: int = 2) -> dict:
    """``steps`` steps on ``batch``: loss and grad norm of each, then the full weights
    and the log-probs of ``batch`` (a no-grad prediction)."""
    loss, norm = [], []
    for _ in range(steps):
        metrics = scalars(learner.step(batch))
        loss.append(metrics["loss"])
        norm.append(metrics["grad_norm"])
    params = {k: v.clone() for k, v in learner.export_weights().items()}
    return {"loss": loss, "grad_norm": norm, "params": params, "logprobs": learner.logprobs(batch)}


def pp_worker(model_dir: str, schedule: str, break_tied: bool = False) -> dict:
    """One rank of a pp group: two steps of the tests' GRPO learner on the whole batch."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = load_model(model_dir)
    batch = make_batch(copy.deepcopy(model))
    return run_steps(make_learner(model, PipelineOnly(schedule, break_tied)), batch)


def reference(model_dir: str) -> dict:
    torch.manual_seed(0)
    model = load_model(model_dir)
    batch = make_batch(copy.deepcopy(model))
    return run_steps(make_learner(model, NoParallelism()), batch)


@pytest.fixture(scope="module")
def tiny_dir() -> str:
    return resolve_model("builtin:tiny")


def assert_equal_to_reference(got: dict, ref: dict) -> None:
    torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(ref["loss"]), rtol=RTOL, atol=1e-7)
    torch.testing.assert_close(torch.tensor(got["grad_norm"]), torch.tensor(ref["grad_norm"]), rtol=RTOL, atol=1e-7)
    assert got["params"].keys() == ref["params"].keys()
    for name, value in ref["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=0, atol=ATOL_WEIGHTS, msg=name)
    torch.testing.assert_close(got["logprobs"], ref["logprobs"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pp2_equals_one_process(tiny_dir: str, schedule: str) -> None:
    ranks = spawn_learner_group(2, pp_worker, tiny_dir, schedule, backend="gloo", timeout_s=240)
    ref = reference(tiny_dir)
    for got in ranks:  # every rank: the group's loss, norm, weights and predictions
        assert_equal_to_reference(got, ref)


def test_stage_layer_ranges_balanced_and_refused() -> None:
    assert stage_layer_ranges(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layer_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layer_ranges(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    with pytest.raises(ValueError, match="pp=5 stages for a model of 4"):
        stage_layer_ranges(4, 5)


def test_split_keeps_names_and_unties_last_stage(tiny_dir: str) -> None:
    full = load_model(tiny_dir)
    names = set(full.state_dict())
    first = split_model(load_model(tiny_dir), 0, 2)
    last = split_model(load_model(tiny_dir), 1, 2)
    got_first, got_last = set(first.model.state_dict()), set(last.model.state_dict())
    assert got_first | got_last == names
    assert "model.embed_tokens.weight" in got_first and "lm_head.weight" not in got_first
    assert "lm_head.weight" in got_last and "model.norm.weight" in got_last
    assert {n for n in got_first if ".layers." in n} == {n for n in names if ".layers.0." in n or ".layers.1." in n}
    # the last stage's head is a copy of the embedding matrix, no longer the same tensor
    torch.testing.assert_close(last.model.lm_head.weight, full.model.embed_tokens.weight, rtol=0, atol=0)


def test_equalise_pads_to_one_shape(tiny_dir: str) -> None:
    from rltune.learner.microbatch import split_by_tokens

    batch = make_batch(load_model(tiny_dir))
    micro = split_by_tokens(batch, BUDGET)
    assert len({(len(m), m.input_ids.shape[1]) for m in micro}) > 1  # the test needs unequal ones
    equal = equalise(micro, len(micro) + 1)
    assert equal.input_ids.shape[0] == equal.rows * (len(micro) + 1)
    for k, m in enumerate(micro):
        left = equal.prompt_len - m.prompt_len
        rows = slice(k * equal.rows, k * equal.rows + len(m))
        cols = slice(left, left + m.input_ids.shape[1])
        assert torch.equal(equal.input_ids[rows, cols], m.input_ids)
        assert torch.equal(equal.attention_mask[rows, cols], m.attention_mask)
        assert int(equal.attention_mask[rows].sum()) == int(m.attention_mask.sum())
