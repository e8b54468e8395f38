"""One scoring round: which calls to make, making them on the executors, and collecting
every sample's outcome.

Identical (function, sample) calls are made once per round, and their values cached
across rounds in a :class:`RewardCache` (errors are not cached, so a transient failure is
retried next time).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from rltune.rewards.calls import Call, Outcome, RewardFn, Sample
from rltune.rewards.executors import Executor

POLL_S = 0.05
"""How often running calls are checked against their timeout."""


class RewardCache:
    """Values of earlier calls by (function name, sample key); at most ``size`` entries,
    the least recently used dropped first (``size`` 0: nothing kept)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._values: OrderedDict[tuple[str, str], float] = OrderedDict()

    def get(self, key: tuple[str, str]) -> float | None:
        value = self._values.get(key)
        if value is not None:
            self._values.move_to_end(key)
        return value

    def put(self, key: tuple[str, str], value: float) -> None:
        if self.size <= 0:
            return
        self._values[key] = value
        self._values.move_to_end(key)
        while len(self._values) > self.size:
            self._values.popitem(last=False)


class Round:
    """The outcomes of ``reward_fns`` on ``samples``: ``run()[k][i]`` is function ``k``'s
    on sample ``i``. ``calls``: calls made per function; ``cache_hits``: outcomes taken
    from the cache."""

    def __init__(self, reward_fns: Sequence[RewardFn], samples: list[Sample], cache: RewardCache) -> None:
        self.reward_fns = list(reward_fns)
        self.samples = samples
        self.cache = cache
        n = len(samples)
        self.outcomes: list[list[Outcome | None]] = [[None] * n for _ in self.reward_fns]
        self.calls: dict[str, int] = {rf.name: 0 for rf in self.reward_fns}
        self.cache_hits = 0
        self.keys = [sample.key() for sample in samples]
        self.groups = [self._group(k, rf) for k, rf in enumerate(self.reward_fns)]
        """Per function: a call's key -> the samples that share it (those not cached)."""
        self.placed: dict[Call, tuple[int, list[int]]] = {}
        """Per call: its function's index, and the first sample of each group it covers."""

    def _group(self, k: int, rf: RewardFn) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for i, key in enumerate(self.keys):
            if rf.cache and (value := self.cache.get((rf.name, key))) is not None:
                self.outcomes[k][i] = Outcome(value, None, 0.0)
                self.cache_hits += 1
                continue
            groups.setdefault(self._group_key(rf, i), []).append(i)
        return groups

    def _group_key(self, rf: RewardFn, i: int) -> str:
        return self.keys[i] if rf.cache else str(i)

    def run(self, executor_for: Callable[[RewardFn], Executor]) -> list[list[Outcome]]:
        """Submit every call (a batched function: one call of all its samples) to the
        executor of its function, then collect until each is back."""
        waiting: dict[int, Executor] = {}
        for k, rf in enumerate(self.reward_fns):
            if not self.groups[k]:
                continue
            firsts = [members[0] for members in self.groups[k].values()]
            executor = executor_for(rf)
            waiting[id(executor)] = executor
            for rows in [firsts] if rf.batched else [[i] for i in firsts]:
                call = Call(rf, [self.samples[i] for i in rows])
                self.placed[call] = (k, rows)
                executor.submit(call)
                self.calls[rf.name] += 1
        while self.placed:
            for executor in waiting.values():
                for call, outcomes in executor.collect(POLL_S / len(waiting)):
                    self._finish(call, outcomes)
        return self.outcomes  # type: ignore[return-value]

    def _finish(self, call: Call, outcomes: list[Outcome]) -> None:
        """Give each sample of the call's groups its outcome; cache the values."""
        k, rows = self.placed.pop(call)
        rf = call.rf
        for row, outcome in zip(rows, outcomes):
            key = self._group_key(rf, row)
            for i in self.groups[k][key]:
                self.outcomes[k][i] = outcome if i == row else outcome.shared()
            if rf.cache and outcome.value is not None:
                self.cache.put((rf.name, key), outcome.value)
