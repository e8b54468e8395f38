"""builtin:exact_text against hand-worked cases."""

from __future__ import annotations

import pytest

from rltune.data.records import Prompt
from rltune.rewards.builtin import exact_text
from rltune.rewards.contract import is_verifier
from rltune.rewards.loading import load_reward_fn

PROMPT = Prompt(id="row-3", text="What colour is the largest shape?")


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("blue", "blue", 1.0),
        (" Blue.\n", "blue", 1.0),  # ends, case and one final period do not count
        ("blue .", "blue", 1.0),
        ("BLUE", "Blue", 1.0),
        ("blue..", "blue", 0.0),  # only one period is dropped
        ("blue, I think", "blue", 0.0),  # the whole completion must be the answer
        ("dark blue", "blue", 0.0),
        ("bluegreen", "blue", 0.0),
        ("", "blue", 0.0),
        ("3", 3, 1.0),  # an integer answer compares as its digits
        ("3", "3", 1.0),
        ("3.0", 3, 0.0),  # text, not numbers: exact_numeric reads 3.0 as 3
        ("two  words", "Two words", 1.0),  # runs of whitespace are one space
        ("yes", "no", 0.0),
    ],
)
def test_exact_text(completion, answer, expected):
    assert exact_text(PROMPT, completion, answer=answer) == expected


@pytest.mark.parametrize("answer", [None, True, 2.5, ["blue"]])
def test_a_missing_or_odd_answer_is_a_data_error(answer):
    with pytest.raises(ValueError, match="row-3"):
        exact_text(PROMPT, "blue", answer=answer)


def test_it_is_a_builtin_verifier():
    assert load_reward_fn("builtin:exact_text") is exact_text
    assert is_verifier(exact_text)
