"""split_by_tokens on batches whose adjacent rows share prompts: the group split against
the length split, with costs worked by hand, and the same gradients as one micro-batch."""

from __future__ import annotations

import copy

import pytest
import torch

import fp32_bounds as fp32
from rltune.algos import ALGORITHMS
from rltune.config.schema import AlgoConfig, TrainConfig
from rltune.data.collate import join
from rltune.data.records import TrainBatch
from rltune.learner.learner import LocalLearner
from rltune.learner.microbatch import split_by_tokens, split_cost
from rltune.learner.objectives import build_objective
from rltune.models.logprobs import completion_logprobs

PAD = 0


def make_batch(prompts: list[list[int]], comps: list[list[int]]) -> TrainBatch:
    """Rows of ``prompts[i] + comps[i]``, left-padded prompts; ``versions`` is the row index."""
    ids, mask, prompt_len = join([torch.tensor(p) for p in prompts], [torch.tensor(c) for c in comps], PAD)
    comp_mask = mask[:, prompt_len:].float()
    return TrainBatch(input_ids=ids, attention_mask=mask, prompt_len=prompt_len, loss_mask=comp_mask,
                      advantages=comp_mask.clone(), versions=torch.arange(len(prompts)))


def rows_of(mbs: list[TrainBatch]) -> list[list[int]]:
    return [mb.versions.tolist() for mb in mbs]


def old_split(batch: TrainBatch, budget: int, unit: int) -> list[list[int]]:
    """The length split as split_by_tokens made it before prompt groups were weighed."""
    p = batch.attention_mask[:, : batch.prompt_len].sum(1).view(-1, unit).amax(1).tolist()
    c = batch.attention_mask[:, batch.prompt_len:].sum(1).view(-1, unit).amax(1).tolist()
    if len(batch) * (max(p) + max(c)) <= budget:
        return [list(range(len(batch)))]
    chunks, current, mp, mc = [], [], 0, 0
    for k in sorted(range(len(p)), key=lambda k: -(p[k] + c[k])):
        np_, nc = max(mp, p[k]), max(mc, c[k])
        if current and (len(current) + unit) * (np_ + nc) > budget:
            chunks.append(current)
            current, np_, nc = [], p[k], c[k]
        current.extend(range(k * unit, k * unit + unit))
        mp, mc = np_, nc
    return chunks + [current]


# Two prompts A (rows 0, 1) and B (rows 2, 3) of 6 tokens; completions 4, 1, 3, 2.
# Lengths 10, 7, 9, 8; budget 20.
#   length split: 0 (10), 2 (9) -> 2 x 10 = 20; 3 joins -> 30 > 20: [3], then 1 -> 2 x 8 = 16.
#     [[0, 2], [3, 1]]: no two adjacent rows share a prompt: cost 20 + 16 = 36.
#   group split: A (longest 10) then B (9): [0, 1] 2 x 10 = 20, B does not fit -> [2, 3]
#     2 x 9 = 18. cost (20 - 6) + (18 - 6) = 26 < 36: taken.
LONG = dict(prompts=[[11, 12, 13, 14, 15, 16]] * 2 + [[21, 22, 23, 24, 25, 26]] * 2,
            comps=[[1, 2, 3, 4], [5], [6, 7, 8], [9, 10]])
# The same shape with 1-token prompts; completions 8, 1, 7, 2: lengths 9, 2, 8, 3, budget 18.
#   length split: [0, 2] 2 x 9 = 18, [3, 1] 2 x 3 = 6: cost 24.
#   group split: [0, 1] 2 x 9 - 1 = 17, [2, 3] 2 x 8 - 1 = 15: cost 32 > 24: not taken.
SHORT = dict(prompts=[[11]] * 2 + [[21]] * 2,
             comps=[[1, 2, 3, 4, 5, 6, 7, 8], [9], [1, 2, 3, 4, 5, 6, 7], [8, 9]])
GROUPS = [0, 0, 1, 1]


def test_long_shared_prompts_take_the_group_split() -> None:
    batch = make_batch(**LONG)
    p, c = [6, 6, 6, 6], [4, 1, 3, 2]
    assert split_cost([[0, 2], [3, 1]], p, c, GROUPS, 1) == 36
    assert split_cost([[0, 1], [2, 3]], p, c, GROUPS, 1) == 26
    assert old_split(batch, 20, 1) == [[0, 2], [3, 1]]
    mbs = split_by_tokens(batch, 20)
    assert rows_of(mbs) == [[0, 1], [2, 3]]
    assert mbs[1].input_ids.tolist() == [[21, 22, 23, 24, 25, 26, 6, 7, 8], [21, 22, 23, 24, 25, 26, 9, 10, PAD]]


def test_short_shared_prompts_keep_the_length_split() -> None:
    batch = make_batch(**SHORT)
    p, c = [1, 1, 1, 1], [8, 1, 7, 2]
    assert split_cost([[0, 2], [3, 1]], p, c, GROUPS, 1) == 24
    assert split_cost([[0, 1], [2, 3]], p, c, GROUPS, 1) == 32
    assert rows_of(split_by_tokens(batch, 18)) == [[0, 2], [3, 1]]


def test_a_group_larger_than_the_budget_is_cut_in_order() -> None:
    # A: rows 0..3 of 6 + (4, 3, 2, 1) tokens, B: rows 4, 5 of 6 + (1, 2); budget 20.
    # length split: 0 (10), 1 (9) | 2 (8), 5 (8) | 3 (7), 4 (7) (equal lengths keep their order):
    #   (20 - 6) + 16 + 14 = 44 (only 0, 1 are adjacent rows of one prompt).
    # group split: A cut into [0, 1] (2 x 10) and [2, 3] (2 x 8), then B [4, 5] (2 x 8):
    #   (20 - 6) + (16 - 6) + (16 - 6) = 34 < 44: taken.
    a, b = [11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26]
    p, groups = [6] * 6, [0, 0, 0, 0, 1, 1]
    c = [4, 3, 2, 1, 1, 2]
    batch = make_batch([a] * 4 + [b] * 2, [list(range(1, n + 1)) for n in c])
    assert old_split(batch, 20, 1) == [[0, 1], [2, 5], [3, 4]]
    assert split_cost([[0, 1], [2, 5], [3, 4]], p, c, groups, 1) == 44
    assert split_cost([[0, 1], [2, 3], [4, 5]], p, c, groups, 1) == 34
    assert rows_of(split_by_tokens(batch, 20)) == [[0, 1], [2, 3], [4, 5]]
    # B first (rows 0, 1: 6 + 1, 6 + 2), then A shortest first (rows 2..5: 6 + 1 .. 6 + 4).
    # length split: 5 (10), 4 (9) | 1 (8), 3 (8) | 0 (7), 2 (7): (20 - 6) + 16 + 14 = 44.
    # group split: A (longest 10) in order: [2, 3] 2 x 8; 4 would make 3 x 9 = 27 > 20:
    #   [4, 5] 2 x 10; then B [0, 1] 2 x 8: (16 - 6) + (20 - 6) + (16 - 6) = 34: taken.
    c, groups = [1, 2, 1, 2, 3, 4], [0, 0, 1, 1, 1, 1]
    batch = make_batch([b] * 2 + [a] * 4, [list(range(1, n + 1)) for n in c])
    assert old_split(batch, 20, 1) == [[5, 4], [1, 3], [0, 2]]
    assert split_cost([[5, 4], [1, 3], [0, 2]], p, c, groups, 1) == 44
    assert split_cost([[2, 3], [4, 5], [0, 1]], p, c, groups, 1) == 34
    assert rows_of(split_by_tokens(batch, 20)) == [[2, 3], [4, 5], [0, 1]]


def test_a_tie_keeps_the_length_split() -> None:
    # A: 6 + (2, 1), B: 6 + (2, 1); budget 16 holds 2 rows of 8. Length split: 0, 2 | 1, 3
    # (16 + 14 = 30, no adjacent shared rows); group split: [0, 1], [2, 3]: (16 - 6) x 2 = 20.
    # With 1-token prompts: length split 0, 2 | 1, 3 = 6 + 4 = 10; group 6 - 1 + 6 - 1 = 10: tie.
    batch = make_batch([[11]] * 2 + [[21]] * 2, [[1, 2], [1], [1, 2], [1]])
    assert split_cost([[0, 2], [1, 3]], [1] * 4, [2, 1, 2, 1], [0, 0, 1, 1], 1) == 10
    assert split_cost([[0, 1], [2, 3]], [1] * 4, [2, 1, 2, 1], [0, 0, 1, 1], 1) == 10
    assert rows_of(split_by_tokens(batch, 6)) == [[0, 2], [1, 3]]


def random_batch(g: torch.Generator, prompts: int, samples: int, share: bool) -> TrainBatch:
    plens = torch.randint(1, 12, (prompts,), generator=g).tolist()
    rows_p, rows_c = [], []
    for k, n in enumerate(plens):
        base = torch.randint(4, 200, (n,), generator=g).tolist()
        for s in range(samples):
            rows_p.append(base if share else base + [200 + k * samples + s])
            rows_c.append(torch.randint(4, 200, (int(torch.randint(1, 15, (1,), generator=g)),), generator=g).tolist())
    return make_batch(rows_p, rows_c)


@pytest.mark.parametrize("seed", range(20))
def test_distinct_prompts_split_exactly_as_before(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    batch = random_batch(g, 4, 3, share=False)
    for budget in (20, 40, 80, 160):
        assert rows_of(split_by_tokens(batch, budget)) == old_split(batch, budget, 1)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("unit", [1, 2])
def test_every_row_once_and_units_together(seed: int, unit: int) -> None:
    g = torch.Generator().manual_seed(seed)
    batch = random_batch(g, 5, 2 * int(torch.randint(1, 4, (1,), generator=g)), share=True)
    for budget in (10, 30, 60, 120):
        mbs = split_by_tokens(batch, budget, unit=unit)
        rows = rows_of(mbs)
        assert sorted(r for mb in rows for r in mb) == list(range(len(batch)))
        for mb in rows:
            assert len(mb) % unit == 0
            assert all(mb[i] % unit == 0 and mb[i + 1] == mb[i] + 1 for i in range(0, len(mb), unit) if unit == 2)
        for mb in mbs:  # within budget unless one unit alone
            assert len(mb) * mb.input_ids.shape[1] <= budget or len(mb) == unit


def grpo_batch(model: torch.nn.Module) -> TrainBatch:
    """3 prompts of 10 tokens x 4 samples, completions of 2..12 tokens, random advantages
    per row and old log-probs off the current ones by noise (the clip is active)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 260, (10,), generator=g).tolist() for _ in range(3)]
    comps = [torch.randint(4, 260, (int(n),), generator=g).tolist()
             for n in torch.randint(2, 13, (12,), generator=g)]
    batch = make_batch([p for p in prompts for _ in range(4)], comps)
    with torch.no_grad():
        current = completion_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_len).logprobs
    mask = batch.loss_mask
    batch.advantages = torch.randn(12, generator=g)[:, None] * mask
    batch.old_logprobs = (current + 0.3 * torch.randn(current.shape, generator=g)) * mask
    return batch


def step_grads(model: torch.nn.Module, batch: TrainBatch, budget: int) -> dict[str, torch.Tensor]:
    copy_ = copy.deepcopy(model)
    objective = build_objective(ALGORITHMS["grpo"], AlgoConfig(name="grpo", aggregation="token-mean"))
    learner = LocalLearner(copy_, objective, TrainConfig(lr=1e-3, grad_clip=None, micro_batch_tokens=budget))
    grads = fp32.capture_grads(copy_)
    learner.step(batch)
    return grads


def test_group_split_gives_the_whole_batch_gradients(tiny_model: torch.nn.Module) -> None:
    batch = grpo_batch(tiny_model)
    budget = 4 * batch.input_ids.shape[1]  # one prompt's 4 rows at the batch's full width
    mbs = split_by_tokens(batch, budget)
    assert len(mbs) > 1 and rows_of(mbs) != old_split(batch, budget, 1)
    assert all(mb == sorted(mb) and mb[0] % 4 == 0 for mb in rows_of(mbs))  # whole groups, in order
    whole = step_grads(tiny_model, batch, 10_000)
    split = step_grads(tiny_model, batch, budget)
    # 4 N u A per entry (fp32_bounds.py): the two sides differ in the order of the sums and
    # the shapes the kernels see; N = 12 rows x the batch's width, A the sum of |terms|
    objective = build_objective(ALGORITHMS["grpo"], AlgoConfig(name="grpo", aggregation="token-mean"))
    tol = fp32.gradient_tolerance(fp32.gradient_scales(copy.deepcopy(tiny_model), objective, batch), batch)
    fp32.assert_within(split, whole, tol, "gradients")
    assert fp32.worst_excess(split, {n: torch.zeros_like(g) for n, g in whole.items()}, tol)[0] > 100


def test_a_model_that_runs_every_prompt_keeps_the_length_split() -> None:
    """``shared=False`` (FSDP, checkpointed blocks, ...): the saving the group split counts
    does not happen, so LONG keeps the length split (cost 36 with every prompt run)."""
    batch = make_batch(**LONG)
    assert rows_of(split_by_tokens(batch, 20)) == [[0, 1], [2, 3]]
    assert rows_of(split_by_tokens(batch, 20, shared=False)) == old_split(batch, 20, 1) == [[0, 2], [3, 1]]
