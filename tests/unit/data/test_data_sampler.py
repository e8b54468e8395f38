"""PromptSampler: order, epoch boundaries, determinism and exact resume."""

from __future__ import annotations

import json
import random

import pytest

from rltune.data.sampler import PromptSampler, epoch_permutation


def test_unshuffled_order_wraps_across_epochs():
    s = PromptSampler(5, seed=0, shuffle=False)
    assert [s.next_batch(3) for _ in range(4)] == [[0, 1, 2], [3, 4, 0], [1, 2, 3], [4, 0, 1]]
    assert s.state_dict()["epoch"] == 2 and s.state_dict()["position"] == 2


def test_shuffled_epochs_follow_the_documented_permutation():
    n, seed = 11, 7
    s = PromptSampler(n, seed=seed)
    drawn = s.next_batch(3 * n)
    for epoch in range(3):
        expected = list(range(n))
        random.Random(seed * 1_000_003 + epoch).shuffle(expected)
        assert drawn[epoch * n : (epoch + 1) * n] == expected
        assert sorted(expected) == list(range(n))
    # Epochs are reshuffled, and the seed matters.
    assert drawn[:n] != drawn[n : 2 * n]
    assert epoch_permutation(n, seed=seed + 1, epoch=0, shuffle=True) != drawn[:n]


def test_batch_larger_than_dataset_spans_several_epochs():
    s = PromptSampler(3, seed=0, shuffle=False)
    assert s.next_batch(7) == [0, 1, 2, 0, 1, 2, 0]
    assert (s.epoch, s.position) == (2, 1)


def test_same_seed_same_batches():
    a, b = PromptSampler(13, seed=3), PromptSampler(13, seed=3)
    assert [a.next_batch(5) for _ in range(9)] == [b.next_batch(5) for _ in range(9)]


@pytest.mark.parametrize("stop_after", [1, 2, 3, 5])  # 2 batches of 5 end epoch 0 exactly
def test_resume_equals_uninterrupted(stop_after):
    n, k, total = 10, 5, 9
    reference = PromptSampler(n, seed=42)
    expected = [reference.next_batch(k) for _ in range(total)]

    first = PromptSampler(n, seed=42)
    seen = [first.next_batch(k) for _ in range(stop_after)]
    state = json.loads(json.dumps(first.state_dict()))
    resumed = PromptSampler(n, seed=42)
    resumed.load_state_dict(state)
    seen += [resumed.next_batch(k) for _ in range(total - stop_after)]
    assert seen == expected


def test_resume_with_odd_batch_size_mid_epoch():
    reference = PromptSampler(7, seed=1)
    expected = [reference.next_batch(3) for _ in range(10)]
    first = PromptSampler(7, seed=1)
    head = [first.next_batch(3) for _ in range(4)]  # stops at epoch 1, position 5
    assert (first.epoch, first.position) == (1, 5)
    resumed = PromptSampler(7, seed=1)
    resumed.load_state_dict(first.state_dict())
    assert head + [resumed.next_batch(3) for _ in range(6)] == expected


@pytest.mark.parametrize("key,value", [("n_prompts", 8), ("seed", 2), ("shuffle", False)])
def test_resume_against_different_settings_is_an_error(key, value):
    state = PromptSampler(7, seed=1).state_dict()
    state[key] = value
    with pytest.raises(ValueError, match=key):
        PromptSampler(7, seed=1).load_state_dict(state)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="at least one prompt"):
        PromptSampler(0, seed=0)
    with pytest.raises(ValueError, match="batch size"):
        PromptSampler(3, seed=0).next_batch(0)
    state = PromptSampler(3, seed=0).state_dict()
    state["position"] = 3
    with pytest.raises(ValueError, match="out of range"):
        PromptSampler(3, seed=0).load_state_dict(state)
