"""A verifiable arithmetic task small enough for a tiny character-level model.

A row is ``{"id": "arith-train-17", "prompt": "37+45=", "answer": "82",
"completion": "82"}``: plain text, short, with the exact answer as a string (for reward
functions) and as the SFT target.

Splits are deterministic functions of their parameters, and train and eval never share a
problem *up to commutation*: the problems are grouped by a key (``a+b`` and ``b+a`` share
one), the keys are shuffled with ``random.Random(seed)``, eval takes the first ``n_eval``
keys (one orientation each) and train samples distinct problems only from the other keys.
So held-out accuracy measures arithmetic, not recall of a swapped pair.

Subtraction uses only ``a >= b`` so every answer is a non-negative integer.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

_APPLY: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
}
_COMMUTATIVE = frozenset("+")


@dataclass(frozen=True)
class _Problem:
    a: int
    op: str
    b: int

    @property
    def key(self) -> tuple[str, int, int]:
        """Problems with equal keys are the same fact (``a+b`` and ``b+a``)."""
        if self.op in _COMMUTATIVE:
            return (self.op, min(self.a, self.b), max(self.a, self.b))
        return (self.op, self.a, self.b)

    def row(self, row_id: str) -> dict[str, str]:
        answer = str(_APPLY[self.op](self.a, self.b))
        return {"id": row_id, "prompt": f"{self.a}{self.op}{self.b}=", "answer": answer,
                "completion": answer}


def _all_problems(max_operand: int, ops: Sequence[str]) -> list[_Problem]:
    unknown = sorted(set(ops) - set(_APPLY))
    if unknown:
        raise ValueError(f"unknown arithmetic ops {unknown}; known: {sorted(_APPLY)}")
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1, got {max_operand}")
    span = range(max_operand + 1)
    return [
        _Problem(a, op, b)
        for op in ops
        for a in span
        for b in span
        if op != "-" or a >= b
    ]


def arith_rows(
    split: str,
    *,
    max_operand: int = 99,
    ops: Sequence[str] = ("+",),
    n_train: int | None = 4000,
    n_eval: int = 300,
    seed: int = 1234,
) -> list[dict[str, str]]:
    """Rows of ``split`` (``"train"`` or ``"eval"``) over operands ``0..max_operand``.

    ``n_train`` None takes every problem outside the eval keys. Raises ValueError for an
    unknown split or sizes the problem space cannot supply.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"unknown split {split!r}; this task has 'train' and 'eval'")
    problems = _all_problems(max_operand, ops)
    keys = sorted({p.key for p in problems})
    if n_eval >= len(keys):
        raise ValueError(f"n_eval={n_eval} leaves no training problems ({len(keys)} keys)")
    rng = random.Random(seed)
    rng.shuffle(keys)
    eval_keys = keys[:n_eval]
    if split == "eval":
        by_key: dict[tuple[str, int, int], list[_Problem]] = {}
        for p in problems:
            by_key.setdefault(p.key, []).append(p)
        chosen = [rng.choice(by_key[k]) for k in eval_keys]
        return [p.row(f"arith-eval-{i}") for i, p in enumerate(chosen)]
    held_out = set(eval_keys)
    pool = [p for p in problems if p.key not in held_out]
    if n_train is not None and n_train > len(pool):
        raise ValueError(f"n_train={n_train} exceeds the {len(pool)} problems left for train")
    # A stream of its own, so the train rows do not depend on how eval drew orientations.
    random.Random(seed + 1).shuffle(pool)
    chosen = pool if n_train is None else pool[:n_train]
    return [p.row(f"arith-train-{i}") for i, p in enumerate(chosen)]


def with_sloppy_teacher(
    rows: list[dict[str, str]], *, slip: float, seed: int = 7
) -> list[dict[str, str]]:
    """The same rows demonstrated by a teacher that forgets the units carry.

    In a problem whose units digits carry (``37+45``), the ``completion`` (the SFT target)
    drops the carry with probability ``slip`` (``"72"`` instead of ``"82"``); ``answer``
    stays the true sum, so a verifier still knows. Problems without a carry are always
    demonstrated correctly. Draws come from ``random.Random(seed)``, one per row.
    """
    if not 0.0 <= slip <= 1.0:
        raise ValueError(f"slip must be in [0, 1], got {slip}")
    rng = random.Random(seed)
    out = []
    for row in rows:
        a, b = (int(x) for x in row["prompt"].rstrip("=").split("+"))
        forgets = rng.random() < slip
        if forgets and a % 10 + b % 10 >= 10:
            row = {**row, "completion": str(a + b - 10)}
        out.append(row)
    return out


def arith(split: str) -> list[dict[str, str]]:
    """Two-digit addition: operands 0..99, 300 eval rows, 4000 distinct train rows.

    ``train-sloppy`` is the train split demonstrated by a sloppy teacher that forgets the
    carry in 80 % of the problems that have one (:func:`with_sloppy_teacher`): imitation
    learns the teacher's habit, a reward that checks the answer does not."""
    if split == "train-sloppy":
        return with_sloppy_teacher(arith_rows("train"), slip=0.8)
    if split not in ("train", "eval"):
        raise ValueError(f"unknown split {split!r}; this task has 'train', 'eval' and 'train-sloppy'")
    return arith_rows(split)


def arith_small(split: str) -> list[dict[str, str]]:
    """One-digit addition: operands 0..9 (55 facts), 10 eval rows, the other 80 problems
    as train. For runs that must show learning in seconds."""
    return arith_rows(split, max_operand=9, n_train=None, n_eval=10)
