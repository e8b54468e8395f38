"""The one `\\boxed{}` scanner, against hand-worked cases, and its users."""

from __future__ import annotations

import pytest

from rltune.data.records import Prompt
from rltune.rewards import boxed
from rltune.rewards.builtin import exact_numeric
from rltune.rewards.math_verify import extract_answer


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{2}", "2"),  # the last box
        ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),  # nested braces kept whole
        ("\\boxed{\\boxed{5}}", "5"),  # the box that opens last
        ("\\boxed{3} and an unclosed \\boxed{4", "3"),  # an unclosed box is skipped
        ("unclosed \\boxed{4 and 5", None),
        ("\\boxed {7}", "7"),
        ("\\boxed\n{7}", "7"),
        ("\\boxedx{7}", None),  # another command
        ("\\boxed7", None),  # no brace, no box
        ("} stray \\boxed{a}} closes", "a"),  # braces outside the box do not count
        ("{ \\boxed{b} ", "b"),
        ("\\boxed{}", ""),
        ("no box", None),
        ("", None),
    ],
)
def test_last_boxed(text: str, expected: str | None) -> None:
    assert boxed.last_boxed(text) == expected


def test_a_closed_box_before_many_unclosed_ones() -> None:
    # One pass over the text: scanning on from each of the 20,000 unclosed boxes to the end
    # (as math_answer's own scanner did) would take minutes here.
    text = "\\boxed{1}" + "\\boxed{" * 20_000
    assert boxed.last_boxed(text) == "1"


@pytest.mark.parametrize(
    "completion", ["\\boxed{3} and an unclosed \\boxed{4", "\\boxed {3} 4", "\\boxed{\\boxed{3}} 4"]
)
def test_exact_numeric_and_math_answer_read_the_same_box(completion: str) -> None:
    assert extract_answer(completion) == "3"
    assert exact_numeric(Prompt(id="p", text="?"), completion, answer=3) == 1.0
