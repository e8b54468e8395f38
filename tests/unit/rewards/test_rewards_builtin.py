"""Built-in reward functions against hand-worked cases."""

from __future__ import annotations

import pytest

from rltune.data.records import Prompt
from rltune.rewards.builtin import exact_numeric, format_regex

PROMPT = Prompt(id="row-7", text="What is 41 * 2?")


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("The answer is 82", "82", 1.0),
        ("The answer is 82.", 82, 1.0),
        ("81", "82", 0.0),
        ("First 82, then I changed my mind: 81", 82, 0.0),  # the LAST number counts
        ("1,234", 1234, 1.0),
        ("Total: $1,234.50", "1234.5", 1.0),
        ("1,234", "1,234", 1.0),
        ("\\boxed{7} ... 9", 7, 1.0),  # the boxed answer wins over a later number
        ("\\boxed{7} ... 9", 9, 0.0),
        ("so \\boxed{x = 12} and 3", 12, 1.0),
        ("\\boxed{1} wait, \\boxed{2}", 2, 1.0),  # the last box
        ("\\boxed{no number} 5", 5, 0.0),  # a box without a number is a wrong answer
        ("unclosed \\boxed{4 and then 5", 5, 1.0),  # an unclosed box is ignored
        # an unclosed box is skipped, so the closed one before it is the last box (the same
        # scanner as math_answer's; exact_numeric's own used to give up and read the 4)
        ("\\boxed{3} and an unclosed \\boxed{4", 3, 1.0),
        ("\\boxed {7} ... 9", 7, 1.0),  # a space before the brace is still a box
        ("-3", "-3", 1.0),
        ("x = -3", -3, 1.0),
        ("10-3", 3, 1.0),  # binary minus, not a sign
        ("3.0", "3", 1.0),
        ("3", 3.0, 1.0),
        ("0.1", 0.1, 1.0),
        (".5", "0.5", 1.0),
        ("3.0001", 3, 0.0),
        ("12345", "1,234", 0.0),
        ("I don't know", "82", 0.0),  # no number: wrong, not an error
        ("", 0, 0.0),
    ],
)
def test_exact_numeric_hand_cases(completion: str, answer: object, expected: float) -> None:
    assert exact_numeric(PROMPT, completion, answer=answer) == expected


def test_exact_numeric_ignores_other_meta() -> None:
    assert exact_numeric(PROMPT, "82", answer="82", source="gsm8k", difficulty=3) == 1.0


def test_exact_numeric_missing_answer_is_an_error_naming_the_prompt() -> None:
    with pytest.raises(ValueError, match="prompt 'row-7': exact_numeric needs an `answer`"):
        exact_numeric(PROMPT, "82")


@pytest.mark.parametrize(
    ("answer", "problem"),
    [
        ("eighty-two", "is not a number"),
        ("#### 82", "is not a number"),
        ([82], "is not a number"),
        (True, "is a bool"),
        (float("nan"), "is not finite"),
        (float("inf"), "is not finite"),
    ],
)
def test_exact_numeric_unparsable_answer(answer: object, problem: str) -> None:
    with pytest.raises(ValueError, match=f"prompt 'row-7': answer .* {problem}"):
        exact_numeric(PROMPT, "82", answer=answer)


THINK = r"<think>.*</think>\s*<answer>.*</answer>"


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>a\nb</think>\n<answer>4</answer>", 1.0),  # DOTALL: . crosses newlines
        ("  <think>x</think><answer>4</answer>\n", 1.0),  # surrounding whitespace stripped
        ("<think>x</think><answer>4</answer> extra", 0.0),  # fullmatch: no trailing text
        ("preamble <think>x</think><answer>4</answer>", 0.0),  # nor leading text
        ("<answer>4</answer>", 0.0),
    ],
)
def test_format_regex_fullmatch(completion: str, expected: float) -> None:
    assert format_regex(PROMPT, completion, pattern=THINK) == expected


# -- length rewards -------------------------------------------------------------------------

from rltune.rewards.builtin import length_penalty, overlong  # noqa: E402


@pytest.mark.parametrize(
    ("length", "expected"),
    [(0, 0.0), (100, 0.0), (101, -0.01), (150, -0.5), (200, -1.0), (500, -1.0)],
)
def test_length_penalty_by_hand(length: int, expected: float) -> None:
    got = length_penalty(None, "x" * length, max_chars=100, per_char=0.01, cap=1.0)
    assert got == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("length", "expected"),
    # max 100, buffer 20: free up to 80, then -(L - 80) / 20 * 2, -2 past 100
    [(0, 0.0), (80, 0.0), (81, -0.1), (90, -1.0), (100, -2.0), (101, -2.0), (400, -2.0)],
)
def test_overlong_by_hand(length: int, expected: float) -> None:
    got = overlong(None, "y" * length, max_chars=100, buffer_chars=20, penalty=2.0)
    assert got == pytest.approx(expected, abs=1e-12)


def test_length_rewards_reject_negative_settings() -> None:
    with pytest.raises(ValueError, match="max_chars, per_char and cap must be >= 0"):
        length_penalty(None, "x", max_chars=-1)
    with pytest.raises(ValueError, match="buffer"):
        overlong(None, "x", max_chars=10, buffer_chars=11)


def test_model_based_builtins_load_by_short_name() -> None:
    from rltune.rewards.loading import load_reward_fn
    from rltune.rewards.contract import is_batched

    for name in ("reward_model", "llm_judge", "safety"):
        assert is_batched(load_reward_fn(f"builtin:{name}")), name
