"""The built-in arithmetic task: correct answers, fixed sizes, disjoint splits."""

from __future__ import annotations

import re

import pytest

from rltune.data.tasks import TASKS
from rltune.data.tasks.arith import arith_rows

PROBLEM = re.compile(r"^(\d+)([+-])(\d+)=$")


def _parse(prompt: str) -> tuple[int, str, int]:
    m = PROBLEM.match(prompt)
    assert m, prompt
    return int(m[1]), m[2], int(m[3])


def _fact(prompt: str) -> tuple[str, int, int]:
    a, op, b = _parse(prompt)
    return (op, min(a, b), max(a, b)) if op == "+" else (op, a, b)


@pytest.mark.parametrize("task,n_train,n_eval,top", [("arith", 4000, 300, 99),
                                                      ("arith_small", 80, 10, 9)])
def test_sizes_answers_and_disjoint_splits(task, n_train, n_eval, top):
    train, evals = TASKS[task]("train"), TASKS[task]("eval")
    assert (len(train), len(evals)) == (n_train, n_eval)
    for row in train + evals:
        a, op, b = _parse(row["prompt"])
        assert op == "+" and 0 <= a <= top and 0 <= b <= top
        assert row["answer"] == str(a + b) and row["completion"] == row["answer"]
    assert len({r["prompt"] for r in train}) == n_train  # distinct problems
    assert len({_fact(r["prompt"]) for r in evals}) == n_eval  # distinct facts
    # No eval fact appears in train, in either operand order.
    assert not {_fact(r["prompt"]) for r in evals} & {_fact(r["prompt"]) for r in train}
    assert len({r["id"] for r in train + evals}) == n_train + n_eval


def test_arith_small_train_is_everything_outside_eval():
    train, evals = TASKS["arith_small"]("train"), TASKS["arith_small"]("eval")
    held = {_fact(r["prompt"]) for r in evals}
    everything = {f"{a}+{b}=" for a in range(10) for b in range(10)}
    assert {r["prompt"] for r in train} == {p for p in everything if _fact(p) not in held}


def test_deterministic_and_seeded():
    assert arith_rows("train") == arith_rows("train")
    assert arith_rows("eval") == arith_rows("eval")
    assert arith_rows("eval", seed=5) != arith_rows("eval")


def test_subtraction_is_non_negative_and_correct():
    rows = arith_rows("train", max_operand=20, ops=("+", "-"), n_train=None, n_eval=20)
    ops = {_parse(r["prompt"])[1] for r in rows}
    assert ops == {"+", "-"}
    for r in rows:
        a, op, b = _parse(r["prompt"])
        assert int(r["answer"]) == (a + b if op == "+" else a - b) >= 0


def test_errors():
    with pytest.raises(ValueError, match="'train' and 'eval'"):
        arith_rows("test")
    with pytest.raises(ValueError, match="unknown arithmetic ops"):
        arith_rows("train", ops=("*",))
    with pytest.raises(ValueError, match="n_train=20000 exceeds"):
        arith_rows("train", n_train=20000)


def test_sloppy_teacher_drops_the_carry_in_some_carry_problems_only() -> None:
    from rltune.data.tasks.arith import arith, with_sloppy_teacher

    clean, sloppy = arith("train"), arith("train-sloppy")
    assert [r["prompt"] for r in clean] == [r["prompt"] for r in sloppy]
    assert [r["answer"] for r in clean] == [r["answer"] for r in sloppy]  # the verifier's truth
    carry = [r for r in clean if sum(int(x) % 10 for x in r["prompt"].rstrip("=").split("+")) >= 10]
    wrong = [s for r, s in zip(clean, sloppy) if s["completion"] != r["completion"]]
    for row in wrong:  # 37+45 -> 72: the sum less the carried ten
        a, b = (int(x) for x in row["prompt"].rstrip("=").split("+"))
        assert (a % 10 + b % 10) >= 10 and int(row["completion"]) == a + b - 10
    # slip 0.8 over ~1,800 carry problems: the binomial's sd is sqrt(0.8 * 0.2 / 1800) ~ 0.01,
    # so 0.75-0.85 is five sd either side (the draws are seeded; this bounds the rate, not luck)
    assert 0.75 < len(wrong) / len(carry) < 0.85
    assert with_sloppy_teacher(clean[:5], slip=0.0) == clean[:5]
    with pytest.raises(ValueError, match="train-sloppy"):
        arith("test")
