"""split_by_tokens: a hand-worked split, and invariants on random batches."""

from __future__ import annotations

import pytest
import torch

from rltune.data.collate import join
from rltune.data.records import TrainBatch
from rltune.learner.microbatch import split_by_tokens

PAD = 0


def hand_batch() -> TrainBatch:
    """Four rows, prompt_len 4, completion 3 columns (token ids are unique per position):

    row  prompt      completion   prompt+completion
    0    11 12 13 14  15 16 17    4 + 3 = 7
    1    21           22          1 + 1 = 2
    2    31 32        33 34 35    2 + 3 = 5
    3    41           42 43       1 + 2 = 3
    """
    prompts = [[11, 12, 13, 14], [21], [31, 32], [41]]
    comps = [[15, 16, 17], [22], [33, 34, 35], [42, 43]]
    ids, mask, prompt_len = join(
        [torch.tensor(p) for p in prompts], [torch.tensor(c) for c in comps], PAD
    )
    comp_mask = mask[:, prompt_len:].float()
    return TrainBatch(
        input_ids=ids, attention_mask=mask, prompt_len=prompt_len, loss_mask=comp_mask,
        advantages=torch.tensor([1.0, 2.0, 3.0, 4.0])[:, None] * comp_mask,
        versions=torch.arange(4),
    )


def test_hand_worked_split_and_trim() -> None:
    # budget 10: rows by length 0 (7), 2 (5), 3 (3), 1 (2). [0] + row 2 would be 2 x (4 + 3)
    # = 14 > 10; [2, 3] is 2 x (2 + 3) = 10; adding row 1 gives 3 x 5 = 15 > 10.
    mbs = split_by_tokens(hand_batch(), 10)
    assert [mb.versions.tolist() for mb in mbs] == [[0], [2, 3], [1]]
    first, middle, last = mbs
    assert first.prompt_len == 4 and first.input_ids.tolist() == [[11, 12, 13, 14, 15, 16, 17]]
    # rows 2 and 3: the two all-pad prompt columns are gone, the completion keeps 3 columns
    assert middle.prompt_len == 2
    assert middle.input_ids.tolist() == [[31, 32, 33, 34, 35], [PAD, 41, 42, 43, PAD]]
    assert middle.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 1, 0]]
    assert middle.loss_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert middle.advantages.tolist() == [[3, 3, 3], [4, 4, 0]]
    # row 1 alone: 1 prompt column, 1 completion column
    assert last.prompt_len == 1
    assert last.input_ids.tolist() == [[21, 22]]
    assert last.loss_mask.tolist() == [[1]] and last.advantages.tolist() == [[2]]


def test_whole_batch_within_budget_is_one_trimmed_micro_batch() -> None:
    batch = hand_batch()
    assert len(batch) * batch.input_ids.shape[1] == 28
    (only,) = split_by_tokens(batch, 28)
    assert only.versions.tolist() == [0, 1, 2, 3]
    assert torch.equal(only.input_ids, batch.input_ids)  # nothing to trim here
    (trimmed,) = split_by_tokens(batch.select(torch.tensor([1, 3])), 100)
    assert trimmed.prompt_len == 1
    assert trimmed.input_ids.tolist() == [[21, 22, PAD], [41, 42, 43]]


def test_row_longer_than_budget_is_its_own_micro_batch() -> None:
    mbs = split_by_tokens(hand_batch(), 3)
    assert sorted(v for mb in mbs for v in mb.versions.tolist()) == [0, 1, 2, 3]
    assert [len(mb) for mb in mbs] == [1, 1, 1, 1]
    assert mbs[0].input_ids.shape == (1, 7)


def random_batch(seed: int, rows: int = 12) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 200, (int(n),), generator=g) for n in torch.randint(1, 20, (rows,), generator=g)]
    comps = [torch.randint(4, 200, (int(n),), generator=g) for n in torch.randint(1, 30, (rows,), generator=g)]
    ids, mask, prompt_len = join(prompts, comps, PAD)
    loss_mask = (torch.rand(ids.shape[0], ids.shape[1] - prompt_len, generator=g) < 0.7).float()
    loss_mask *= mask[:, prompt_len:]
    return TrainBatch(ids, mask, prompt_len, loss_mask, versions=torch.arange(rows))


@pytest.mark.parametrize("budget", [1, 40, 90, 200, 450, 10_000])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_split_invariants(seed: int, budget: int) -> None:
    batch = random_batch(seed)
    mbs = split_by_tokens(batch, budget)
    seen = sorted(v for mb in mbs for v in mb.versions.tolist())
    assert seen == list(range(len(batch)))  # every row exactly once
    for mb in mbs:
        assert len(mb) == 1 or mb.input_ids.numel() <= budget
        # trimmed: the first prompt column and the last completion column hold a token
        assert bool(mb.attention_mask[:, 0].any())
        assert bool(mb.attention_mask[:, -1].any())
        assert bool(mb.attention_mask[:, mb.prompt_len - 1].all())  # left padding
        for i, row in enumerate(mb.versions.tolist()):
            # the row's tokens and its loss mask survive the split unchanged
            original = batch.input_ids[row][batch.attention_mask[row].bool()]
            assert torch.equal(mb.input_ids[i][mb.attention_mask[i].bool()], original)
            comp = batch.attention_mask[row, batch.prompt_len :].bool()
            mb_comp = mb.attention_mask[i, mb.prompt_len :].bool()
            assert torch.equal(mb.loss_mask[i][mb_comp], batch.loss_mask[row][comp])
            assert float(mb.loss_mask[i][~mb_comp].abs().sum()) == 0.0


def test_units_of_two_rows_stay_together_in_order() -> None:
    # units (rows 0,1) max length 7 and (rows 2,3) max length 5. Budget 14 fits one unit
    # of 2 x 7 but not both (4 x 7 = 28): two micro-batches, the longer unit first.
    mbs = split_by_tokens(hand_batch(), 14, unit=2)
    assert [mb.versions.tolist() for mb in mbs] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="units of 3"):
        split_by_tokens(hand_batch(), 14, unit=3)
