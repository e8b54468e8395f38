"""keep_freed_heap: glibc keeps the memory a step frees, so the next step reuses it."""

from __future__ import annotations

import ctypes
import resource
import sys

import pytest
import torch

from rltune.learner import learner
from rltune.learner.learner import keep_freed_heap


def test_the_two_thresholds_are_set(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    class Libc:
        def mallopt(self, param: int, value: int) -> int:
            calls.append((param, value))
            return 1

    monkeypatch.setattr(learner.sys, "platform", "linux")
    monkeypatch.setattr(learner.ctypes, "CDLL", lambda name: Libc())
    assert keep_freed_heap()
    # M_MMAP_THRESHOLD (-3) 32 MiB = 33,554,432; M_TRIM_THRESHOLD (-1) 1 GiB = 1,073,741,824
    assert calls == [(-3, 33_554_432), (-1, 1_073_741_824)]


def test_other_platforms_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(learner.sys, "platform", "darwin")
    monkeypatch.setattr(learner.ctypes, "CDLL", lambda name: pytest.fail("no C library is opened"))
    assert not keep_freed_heap()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_repeated_step_takes_no_new_pages() -> None:
    """A step's pattern: ten 4 MB activations held, then all freed, ten times over. With
    glibc's defaults the freed 40 MB is trimmed off the heap (more than twice the mmap
    threshold) and faulted back in the next round: about 10 x 10 x 1,024 = 102,400 faults
    (measured 102,080 in a fresh process). After the call: at most a block's worth (1,024
    faults: one block placed afresh, once, after other tests), not one per round."""
    def rounds(n: int) -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(n):
            held = [torch.empty(1 << 20).fill_(1.0) for _ in range(10)]  # 10 x 4 MB
            del held
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    assert keep_freed_heap()
    rounds(2)  # the heap grows to the step's peak once
    assert rounds(10) <= 2 * 1024
