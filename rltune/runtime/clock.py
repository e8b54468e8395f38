"""Wall time of the phases of one step (``time/<phase>``, ``time/step``)."""

from __future__ import annotations

import time

from rltune.metrics import keys


class StepClock:
    """Marks the end of each phase; a phase marked twice keeps its last duration."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = now - self.last
        self.last = now

    def metrics(self) -> dict[str, float]:
        out = {keys.time_key(k): v for k, v in self.phases.items()}
        out[keys.TIME_STEP] = self.last - self.start
        return out
