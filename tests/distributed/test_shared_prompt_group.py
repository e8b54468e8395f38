"""A DDP learner group of two real processes (gloo, CPU) runs each distinct prompt once
(rltune.models.shared_prompt) inside DDP's forward, and trains as one process does on the
whole batch: the same weights after two steps, with gradient accumulation over several
micro-batches (``no_sync`` on all but the last).

Tolerances as in test_learner_group.py: the group's gradient is one process's sum taken
in another order (fp32 rounding, ~1e-7 relative); Adam's eps is 1e-3, so its slope is at
most lr/eps = 1 and parameters agree within PARAM_ATOL = 1e-6, while a step moves them
by ~1e-3.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from learner_group_workers import make_learner, train_two_steps

from rltune.data.collate import join
from rltune.data.records import TrainBatch
from rltune.learner.distributed import shard_batch
from rltune.learner.launch import spawn_learner_group
from rltune.learner.microbatch import split_by_tokens
from rltune.learner.parallel import make_parallelism
from rltune.models.load import load_model
from rltune.models.logprobs import completion_logprobs

PARAM_ATOL = 1e-6
GROUPS, GROUP_SIZE = 4, 3


def grouped_batch(model: torch.nn.Module) -> TrainBatch:
    """``GROUPS`` prompts of 3..8 tokens, each with ``GROUP_SIZE`` completions in adjacent
    rows (a GRPO batch's layout), per-sequence advantages, old log-probs near the model's
    own. A group's completions are equally long and the groups' total lengths differ, so
    the micro-batch split (longest rows first, ties in order) keeps each group together."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 260, (int(n),), generator=g) for n in torch.randint(3, 9, (GROUPS,), generator=g)]
    rows = [p for p in prompts for _ in range(GROUP_SIZE)]
    comp_lens = [12 - len(p) + 2 * k for k, p in enumerate(prompts) for _ in range(GROUP_SIZE)]
    comps = [torch.randint(4, 260, (n,), generator=g) for n in comp_lens]
    input_ids, attention_mask, prompt_len = join(rows, comps, 0)
    loss_mask = attention_mask[:, prompt_len:].float()
    with torch.no_grad():
        current = completion_logprobs(model, input_ids, attention_mask, prompt_len).logprobs
    return TrainBatch(
        input_ids=input_ids, attention_mask=attention_mask, prompt_len=prompt_len, loss_mask=loss_mask,
        advantages=torch.randn(len(rows), generator=g)[:, None].expand_as(loss_mask),
        old_logprobs=(current + 0.3 * torch.randn(current.shape, generator=g)) * loss_mask,
        ref_logprobs=(current + 0.1 * torch.randn(current.shape, generator=g)) * loss_mask,
    )


def body_rows(model: torch.nn.Module) -> list[int]:
    """Counts, into the returned list, the rows of every call of the transformer body."""
    rows: list[int] = []
    model.model.register_forward_pre_hook(lambda _m, args, kwargs: rows.append(int(kwargs["input_ids"].shape[0])),
                                          with_kwargs=True)
    return rows


def budget(batch: TrainBatch) -> int:
    """A micro-batch token budget that holds one group's rows at the batch's width."""
    return GROUP_SIZE * batch.input_ids.shape[1]


def ddp_run(model_dir: str, batch: TrainBatch) -> dict:
    torch.set_num_threads(1)
    shard = shard_batch(batch, dist.get_rank(), dist.get_world_size())
    model = load_model(model_dir)
    rows = body_rows(model)
    out = train_two_steps(make_learner(model, make_parallelism("ddp"), budget=budget(batch)), shard)
    out.update(rows=rows, micro_batches=len(split_by_tokens(shard, budget(batch))))
    return out


@pytest.fixture(scope="module")
def setup(model_dir: str) -> tuple[torch.nn.Module, TrainBatch]:
    initial = load_model(model_dir)
    return initial, grouped_batch(initial)


def test_ddp_group_runs_each_prompt_once_and_matches_one_process(
        model_dir: str, setup: tuple[torch.nn.Module, TrainBatch]) -> None:
    initial, batch = setup
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = train_two_steps(make_learner(copy.deepcopy(initial), budget=budget(batch)), batch)
    finally:
        torch.set_num_threads(threads)
    group = spawn_learner_group(2, ddp_run, model_dir, batch, backend="gloo", timeout_s=180)
    # each rank accumulates over its two groups, one a micro-batch: DDP's no_sync path
    # runs for the first; every forward (2 steps, then the log-probs) is a prompt pass of
    # one row and a completion pass of the group's rows
    assert [g["micro_batches"] for g in group] == [2, 2]
    for g in group:
        assert g["rows"] == [1, GROUP_SIZE] * 2 * 3, g["rows"]
    start = {k: v.detach() for k, v in initial.state_dict().items()}
    for step in range(2):
        ranks = [g["weights"][step] for g in group]
        moved = max(float((single["weights"][step][k] - start[k]).abs().max()) for k in start)
        assert moved > 100 * PARAM_ATOL
        for k in start:
            assert float((ranks[0][k] - single["weights"][step][k]).abs().max()) <= PARAM_ATOL, (step, k)
            assert torch.equal(ranks[0][k], ranks[1][k])
