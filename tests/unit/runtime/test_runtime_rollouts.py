"""The producer that generates ahead of the learner, driven by stand-ins for the sampler
and the generator: the queue bound, one policy version per batch, the weights a batch
loads fixed by the order of events and not by thread timing, stale batches dropped and
counted, the queue a checkpoint saves and restores, pausing, and failures."""

from __future__ import annotations

import threading
import time

import pytest

from rltune.checkpoint.rollouts import QueuedBatch
from rltune.data.records import Prompt, Rollout
from rltune.metrics.types import Sum
from rltune.runtime.rollouts import AsyncRollouts, thread_shares


class Fake:
    """A sampler over prompt ids 0, 1, 2, ... and a generator that tags every rollout
    with the version of the weights it holds."""

    def __init__(self, *, gate: threading.Event | None = None, fail_at: int | None = None,
                 load_s: float = 0.0) -> None:
        self.next_id = 0
        self.version = 0
        self.dropped: list = []  # as a Collector's: no group is dropped here
        self.loads: list[int] = []
        self.copies: list[int] = []
        """The value of ``w`` in each dict of weights loaded, as copied."""
        self.load_s = load_s
        self.batches = 0
        self.gate = gate
        self.fail_at = fail_at

    def draw(self, n: int) -> list[Prompt]:
        ids = range(self.next_id, self.next_id + n)
        self.next_id += n
        return [Prompt(id=str(i), text=str(i)) for i in ids]

    def collect(self, prompts, metrics, clock, *, draw=None):
        self.batches += 1
        if self.fail_at == self.batches:
            raise OSError("generator lost its device")
        if self.gate is not None:
            self.gate.wait(5)
        metrics.add({"perf/calls": Sum(len(prompts))})
        rollouts = [Rollout(prompt_id=p.id, group=0, prompt_ids=[1], completion_ids=[2], text="x",
                            completion_logprobs=None, loss_mask=None,
                            finish_reason="stop", policy_version=self.version) for p in prompts]
        return prompts, rollouts

    def load_weights(self, version: int, tensors) -> None:
        time.sleep(self.load_s)
        if tensors is not None:
            self.copies.append(dict(tensors)["w"])
        self.loads.append(version)
        self.version = version


def make(fake: Fake, k: int) -> AsyncRollouts:
    return AsyncRollouts(max_staleness=k, prompts_per_step=2, collector=fake)


def wait_until(cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_the_producer_runs_at_most_k_batches_ahead() -> None:
    fake = Fake()
    ahead = make(fake, 2)
    prompts, rollouts, metrics, _ = ahead.take(0)
    assert [p.id for p in prompts] == ["0", "1"] and rollouts[0].policy_version == 0
    wait_until(lambda: len(ahead._queue) == 2)
    time.sleep(0.05)
    assert len(ahead._queue) == 2 and fake.batches == 3  # full: it waits for room
    assert metrics["perf/calls"] == Sum(2.0)
    ahead.close()


def test_new_weights_are_loaded_between_batches_and_the_version_is_recorded() -> None:
    gate = threading.Event()
    fake = Fake(gate=gate)
    ahead = make(fake, 1)
    ahead._start()
    wait_until(lambda: fake.batches == 1)  # batch 1 is being generated with version 0
    ahead.publish(1, {"w": 1})
    gate.set()
    _, first, *_ = ahead.take(1)
    _, second, *_ = ahead.take(1)
    assert [r.policy_version for r in first] == [0, 0]  # not switched mid-batch
    assert [r.policy_version for r in second] == [1, 1] and fake.loads == [1]
    ahead.close()


def test_batches_older_than_the_bound_are_dropped_and_counted() -> None:
    fake = Fake()
    ahead = make(fake, 1)
    ahead.take(0)
    wait_until(lambda: len(ahead._queue) == 1)
    ahead.publish(3, None)  # the learner made three updates in one step
    prompts, rollouts, metrics, _ = ahead.take(3)
    # the queued batch (version 0, three behind) is dropped; the next one has version 3
    assert metrics["async/dropped_stale"] == Sum(2.0)
    assert [p.id for p in prompts] == ["4", "5"] and {r.policy_version for r in rollouts} == {3}
    ahead.close()


def test_the_learner_keeps_its_weights_until_the_producer_has_loaded_them() -> None:
    """A published dict may alias the learner's live weights. ``take`` returns only once
    the producer has copied the weights published before it, so neither the learner's next
    update (in place) nor its next publish reaches the batch that the take made room for,
    however slowly the producer loads."""
    fake = Fake(load_s=0.2)
    ahead = make(fake, 1)
    weights = {"w": 1}
    ahead.take(0)  # batch 1; batch 2 starts on the initial weights
    ahead.publish(1, weights)  # the end of step 1
    ahead.take(1)  # batch 2; batch 3 starts on version 1
    weights["w"] = 2  # step 2 learns in place ...
    ahead.publish(2, weights)  # ... and publishes
    _, rollouts, *_ = ahead.take(2)  # batch 3; batch 4 starts on version 2
    assert {r.policy_version for r in rollouts} == {1} and fake.copies == [1, 2]
    ahead.close()


def test_the_queue_is_read_between_batches() -> None:
    gate = threading.Event()
    fake = Fake(gate=gate)
    ahead = make(fake, 2)
    ahead._start()
    wait_until(lambda: fake.batches == 1)
    with pytest.raises(RuntimeError, match="while paused"):
        ahead.queued()
    gate.set()
    ahead.take(0)  # prompts 0, 1; returns once batch 3 has started
    with ahead.paused():
        assert [[p.id for p in b.prompts] for b in ahead.queued()] == [["2", "3"], ["4", "5"]]
        assert fake.next_id == 6
    ahead.close()


def test_a_restored_queue_is_taken_before_new_batches() -> None:
    fake = Fake()
    ahead = make(fake, 1)
    saved = QueuedBatch(prompts=[Prompt(id="a", text="a")], metrics={"perf/calls": Sum(1.0)}, version=3,
                        rollouts=[Rollout(prompt_id="a", group=0, prompt_ids=[1], completion_ids=[2], text="x",
                                          completion_logprobs=None, loss_mask=None, finish_reason="stop",
                                          policy_version=3)])
    fake.version = 4  # the caller loads the learner's weights into the generator
    ahead.restore([saved], version=4)
    prompts, rollouts, metrics, _ = ahead.take(4)
    assert prompts == saved.prompts and rollouts == saved.rollouts and metrics["perf/calls"] == Sum(1.0)
    prompts, *_ = ahead.take(4)
    assert [p.id for p in prompts] == ["0", "1"] and fake.loads == []  # restore() left the weights as loaded
    ahead.close()


def test_paused_holds_the_producer_between_batches() -> None:
    gate = threading.Event()
    fake = Fake(gate=gate)
    ahead = make(fake, 3)
    ahead._start()
    wait_until(lambda: fake.batches == 1)  # batch 1 is being made
    threading.Timer(0.05, gate.set).start()
    with ahead.paused():  # waits for batch 1, then holds the producer
        assert len(ahead._queue) == 1 and not ahead._busy
        time.sleep(0.05)
        assert fake.batches == 1 and len(ahead._queue) == 1
    wait_until(lambda: len(ahead._queue) == 3)
    ahead.close()


def test_a_producer_failure_reaches_the_learner_with_its_cause() -> None:
    ahead = make(Fake(fail_at=1), 1)
    with pytest.raises(RuntimeError, match="rollout producer failed: OSError: generator lost its device"):
        ahead.take(0)


def test_zero_staleness_is_not_ahead() -> None:
    with pytest.raises(ValueError, match="max_staleness must be >= 1"):
        make(Fake(), 0)


class CountsThreads(Fake):
    """Records torch's intra-op thread count in the thread that generates."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[int] = []

    def collect(self, prompts, metrics, clock, *, draw=None):
        import torch

        self.threads.append(torch.get_num_threads())
        return super().collect(prompts, metrics, clock, draw=draw)


@pytest.mark.parametrize(("learner", "producer"), [(2, 1), (1, 2)])
def test_the_producer_generates_with_the_threads_it_was_given(learner: int, producer: int) -> None:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(learner)
    try:
        fake = CountsThreads()
        ahead = AsyncRollouts(max_staleness=1, prompts_per_step=2, collector=fake, threads=producer)
        ahead.take(0)
        ahead.take(1)
        ahead.close()
        # left alone, a new thread takes the count last set anywhere (the learner's here)
        assert fake.threads and set(fake.threads) == {producer}, fake.threads
        assert torch.get_num_threads() == learner  # the learner's own count is untouched
    finally:
        torch.set_num_threads(before)


def test_the_producer_refuses_zero_threads() -> None:
    with pytest.raises(ValueError, match="threads=0"):
        AsyncRollouts(max_staleness=1, prompts_per_step=2, collector=Fake(), threads=0)


@pytest.mark.parametrize(("available", "learner", "producer", "expected"), [
    (2, None, None, (1, 1)),   # 2 // 2 = 1 for the producer, 2 - 1 = 1 for the learner
    (1, None, None, (1, 1)),   # one core: both still need a thread (max(1, 0) = 1)
    (3, None, None, (2, 1)),   # 3 // 2 = 1; the learner takes the odd core, 3 - 1 = 2
    (8, None, None, (4, 4)),
    (8, None, 2, (6, 2)),      # rollout.threads given: the learner gets 8 - 2 = 6
    (8, 3, None, (3, 4)),      # train.threads given: kept, the producer still gets 8 // 2
    (8, 5, 5, (5, 5)),         # both given: kept as given, even past the cores
])
def test_thread_shares_split_the_cores(available, learner, producer, expected) -> None:
    assert thread_shares(available, learner, producer) == expected


@pytest.mark.parametrize(("overrides", "expected"), [
    ([], (None, None)),                                             # synchronous: torch's default
    (["train.threads=3"], (3, None)),
    (["runtime.max_staleness=1"], (1, 1)),                          # 2 available: one each
    (["runtime.max_staleness=1", "rollout.threads=2"], (1, 2)),     # max(1, 2 - 2) = 1
    (["runtime.max_staleness=1", "train.threads=2"], (2, 1)),
])
def test_a_local_run_ahead_of_the_learner_splits_the_threads(overrides, expected) -> None:
    import torch

    from rltune.config import load_config
    from rltune.runtime.build import _thread_shares

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cfg = load_config(None, ["algo.importance_correction=token-truncate", *overrides])
        assert _thread_shares(cfg) == expected
    finally:
        torch.set_num_threads(before)
