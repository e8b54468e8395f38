"""Preference pairs over the arithmetic task: the true sum against a careless mistake.

A row is ``{"id": "arith_prefs-train-17", "prompt": "37+45=", "answer": "82",
"chosen": "82", "rejected": "72", "mistake": "dropped_carry"}``. The problems, and so the
train/eval separation up to commutation, are those of ``builtin:arith``
(:func:`~rltune.data.tasks.arith.arith_rows`). The rejected answer is one of the mistakes
of a careless adder, its kind drawn uniformly from the kinds that apply to the problem
(in the train split: off by one, echoed and subtracted 25-28 % each, swapped digits
and dropped carry about 10 % each):

==================  ========================================  ========================
mistake             wrong answer                              applies when
==================  ========================================  ========================
``subtracted``      ``|a - b|`` (the wrong operation)         neither operand is 0
``echoed``          ``b``, the second operand copied          ``a`` is not 0
``swapped_digits``  the digits of ``a + b`` reversed          a two-digit sum whose
                                                              reversal is another
                                                              two-digit number
``dropped_carry``   ``a + b - 10`` (the units carry lost)     the units digits carry
``off_by_one``      ``a + b + 1`` or ``a + b - 1`` (a second  always (``- 1`` only when
                    draw picks the direction)                 ``a + b >= 1``)
==================  ========================================  ========================

Only the answer separates chosen from rejected, and the kinds differ in how much
arithmetic it takes to catch them on held-out problems. A subtracted or echoed answer is
never larger than the sum, so "prefer the larger number" already catches it; a swapped
sum is often given away by its size; an answer off by one needs the units digit, and a
dropped carry needs the carry. On the 1 M-parameter ``builtin:tiny`` model, 50 steps of
32 pairs (seconds of CPU) take held-out preference accuracy from chance to about 0.7
with DPO, SimPO or a reward model, mostly on the subtracted and echoed answers; answers
off by one stay near chance for hundreds of steps, so the task keeps measuring
arithmetic after the easy part is learnt. Draws come from ``random.Random(seed)``, so
every split is deterministic.
"""

from __future__ import annotations

import random
from typing import Callable

from rltune.data.tasks.arith import arith_rows

_Mistake = Callable[[int, int, random.Random], "int | None"]


def _subtracted(a: int, b: int, rng: random.Random) -> int | None:
    return abs(a - b) if a and b else None


def _echoed(a: int, b: int, rng: random.Random) -> int | None:
    return b if a else None


def _swapped_digits(a: int, b: int, rng: random.Random) -> int | None:
    total = a + b
    swapped = int(str(total)[::-1])
    return swapped if 10 <= total <= 99 and 10 <= swapped != total else None


def _dropped_carry(a: int, b: int, rng: random.Random) -> int | None:
    return a + b - 10 if a % 10 + b % 10 >= 10 else None


def _off_by_one(a: int, b: int, rng: random.Random) -> int | None:
    total = a + b
    return total + 1 if total == 0 or rng.random() < 0.5 else total - 1


MISTAKES: dict[str, _Mistake] = {
    "subtracted": _subtracted,
    "echoed": _echoed,
    "swapped_digits": _swapped_digits,
    "dropped_carry": _dropped_carry,
    "off_by_one": _off_by_one,
}
"""Kind -> ``(a, b, rng) -> wrong answer``, or None when the kind does not apply (the
table above). Only ``off_by_one`` draws from ``rng``."""


def applicable_mistakes(a: int, b: int) -> list[str]:
    """The kinds of mistake that apply to ``a + b`` (non-negative operands), in table order."""
    probe = random.Random(0)  # applicability does not depend on the draw
    return [kind for kind, wrong in MISTAKES.items() if wrong(a, b, probe) is not None]


def with_mistakes(rows: list[dict[str, str]], *, seed: int, prefix: str) -> list[dict[str, str]]:
    """Preference rows from addition rows (``"a+b="``): chosen is the answer, rejected a
    mistake whose kind is drawn uniformly with ``random.Random(seed)``; ids become
    ``PREFIX-N``."""
    rng = random.Random(seed)
    out = []
    for i, row in enumerate(rows):
        a, b = (int(x) for x in row["prompt"].rstrip("=").split("+"))
        kind = rng.choice(applicable_mistakes(a, b))
        wrong = MISTAKES[kind](a, b, rng)
        out.append({
            "id": f"{prefix}-{i}",
            "prompt": row["prompt"],
            "answer": row["answer"],
            "chosen": row["answer"],
            "rejected": str(wrong),
            "mistake": kind,
        })
    return out


def arith_prefs(split: str) -> list[dict[str, str]]:
    """Two-digit addition pairs over the problems of ``builtin:arith``: operands 0..99,
    4000 train and 300 eval rows."""
    seeds = {"train": 11, "eval": 12}
    if split not in seeds:
        raise ValueError(f"unknown split {split!r}; this task has 'train' and 'eval'")
    return with_mistakes(arith_rows(split), seed=seeds[split], prefix=f"arith_prefs-{split}")
