"""Which prompts each step sees, reproducibly and resumably.

Prompts are visited epoch by epoch; every epoch is a permutation of ``range(n_prompts)``
(the identity when ``shuffle`` is off). The permutation of epoch ``e`` is
``random.Random(seed * 1_000_003 + e).shuffle(list(range(n_prompts)))``: a function of
``(seed, epoch)`` only, and Python's seeded ``random`` is stable across platforms and
versions of torch, so a run resumed elsewhere sees the same order. A batch that reaches
the end of an epoch continues into the next one.

The whole state is ``(epoch, position)``: after ``load_state_dict(state_dict())`` the
sampler yields exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import random
from typing import Any


def epoch_permutation(n_prompts: int, *, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The visiting order of epoch ``epoch`` (see the module docstring)."""
    order = list(range(n_prompts))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


class PromptSampler:
    """Yields batches of prompt indices in ``[0, n_prompts)``."""

    def __init__(self, n_prompts: int, *, seed: int, shuffle: bool = True) -> None:
        if n_prompts < 1:
            raise ValueError(f"PromptSampler needs at least one prompt, got n_prompts={n_prompts}")
        self.n_prompts = n_prompts
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        return epoch_permutation(self.n_prompts, seed=self.seed, epoch=epoch, shuffle=self.shuffle)

    def next_batch(self, k: int) -> list[int]:
        """The next ``k`` indices; may span epochs (several when ``k > n_prompts``)."""
        if k < 1:
            raise ValueError(f"batch size must be >= 1, got {k}")
        batch: list[int] = []
        while len(batch) < k:
            take = min(k - len(batch), self.n_prompts - self.position)
            batch.extend(self._order[self.position : self.position + take])
            self.position += take
            if self.position == self.n_prompts:
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
        return batch

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state. ``n_prompts``, ``seed`` and ``shuffle`` are stored so a
        resume against different data or settings is caught, not silently reordered."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "n_prompts": self.n_prompts,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`)."""
        for name, key in (("n_prompts", "data.train's rows"), ("seed", "train.seed"), ("shuffle", "data.shuffle")):
            if state[name] != getattr(self, name):
                raise ValueError(
                    f"sampler state was saved with {name}={state[name]!r} but this run has "
                    f"{name}={getattr(self, name)!r} ({key}); resume with the same data and "
                    "train.seed / data.shuffle, or start a new run"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.n_prompts:
            raise ValueError(f"sampler state has epoch={epoch}, position={position}, "
                             f"out of range for {self.n_prompts} prompts")
        self.epoch, self.position = epoch, position
        self._order = self._permutation(epoch)
