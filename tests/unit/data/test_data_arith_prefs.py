"""The built-in preference task: true sums against the mistakes of the table, re-derived
here from the problem; disjoint, deterministic splits."""

from __future__ import annotations

import collections

import pytest

from rltune.data.tasks import TASKS
from rltune.data.tasks.arith_prefs import applicable_mistakes, with_mistakes


def _operands(prompt: str) -> tuple[int, int]:
    a, b = prompt.rstrip("=").split("+")
    return int(a), int(b)


def _fact(prompt: str) -> tuple[int, int]:
    a, b = _operands(prompt)
    return min(a, b), max(a, b)


def _is_the_mistake(kind: str, a: int, b: int, wrong: int) -> bool:
    """Each kind's definition, written out independently of the task's code."""
    s = a + b
    if kind == "subtracted":
        return a > 0 and b > 0 and wrong == max(a, b) - min(a, b)
    if kind == "echoed":
        return a > 0 and wrong == b
    if kind == "swapped_digits":
        tens, units = divmod(s, 10)
        return 1 <= tens <= 9 and units >= 1 and units != tens and wrong == 10 * units + tens
    if kind == "dropped_carry":
        return (a % 10) + (b % 10) >= 10 and wrong == s - 10
    if kind == "off_by_one":
        return wrong in (s - 1, s + 1) and wrong >= 0
    raise AssertionError(kind)


@pytest.mark.parametrize("split,n", [("train", 4000), ("eval", 300)])
def test_rows_are_true_sums_against_their_mistake(split, n):
    rows = TASKS["arith_prefs"](split)
    assert len(rows) == n
    for row in rows:
        a, b = _operands(row["prompt"])
        assert row["chosen"] == row["answer"] == str(a + b)
        assert row["rejected"] != row["chosen"]
        assert _is_the_mistake(row["mistake"], a, b, int(row["rejected"])), row
        assert str(int(row["rejected"])) == row["rejected"]  # a plain number, no leading 0
    kinds = collections.Counter(r["mistake"] for r in rows)
    assert set(kinds) == {"subtracted", "echoed", "swapped_digits", "dropped_carry", "off_by_one"}
    assert min(kinds.values()) > 0.05 * n


def test_splits_are_disjoint_and_deterministic():
    train, evals = TASKS["arith_prefs"]("train"), TASKS["arith_prefs"]("eval")
    assert not {_fact(r["prompt"]) for r in train} & {_fact(r["prompt"]) for r in evals}
    assert train == TASKS["arith_prefs"]("train") and evals == TASKS["arith_prefs"]("eval")
    assert len({r["id"] for r in train + evals}) == 4300
    with pytest.raises(ValueError, match="'train' and 'eval'"):
        TASKS["arith_prefs"]("test")


@pytest.mark.parametrize("a,b,kinds", [
    (37, 45, ["subtracted", "echoed", "swapped_digits", "dropped_carry", "off_by_one"]),
    (0, 0, ["off_by_one"]),
    (5, 0, ["echoed", "off_by_one"]),         # b = 0: no subtraction that differs from the sum
    (0, 7, ["off_by_one"]),                   # echoing 7 would be the sum itself
    (40, 50, ["subtracted", "echoed", "off_by_one"]),  # 90 reversed is 9, not two digits
    (11, 0, ["echoed", "off_by_one"]),        # 11 reversed is 11
    (60, 50, ["subtracted", "echoed", "off_by_one"]),  # a three-digit sum
])
def test_applicable_mistakes_by_hand(a, b, kinds):
    assert applicable_mistakes(a, b) == kinds


def test_seed_changes_the_draws():
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 40) for b in range(10, 40)]
    one, same, other = (with_mistakes(rows, seed=s, prefix="x") for s in (1, 1, 2))
    assert one == same and one != other
    assert [r["id"] for r in one[:2]] == ["x-0", "x-1"]
