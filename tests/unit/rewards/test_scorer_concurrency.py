"""LocalScorer's runtime: timeouts, the cache, async and batched forms, worker processes,
dropped samples and per-reward timing."""

from __future__ import annotations

import asyncio
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rltune.config.schema import RewardFnConfig
from rltune.data.records import Prompt, Rollout
from rltune.metrics.types import scalars
from rltune.rewards import calls as calls_module
from rltune.rewards.contract import SampleDropped, batched
from rltune.rewards.scorer import LocalScorer, RewardFn, ScoreStats, build_reward_fns


def by_fn(stats: ScoreStats, field: str) -> dict[str, float]:
    """One statistic of each reward function, as plain numbers."""
    return {name: getattr(fn, field).value for name, fn in stats.per_fn.items()}


def _rollout(prompt_id: str, text: str) -> Rollout:
    return Rollout(
        prompt_id=prompt_id, group=0, prompt_ids=torch.tensor([1]), completion_ids=torch.tensor([2]),
        completion_logprobs=None, loss_mask=torch.ones(1), text=text, finish_reason="stop",
        policy_version=0,
    )


PROMPTS = {"a": Prompt(id="a", text="a?", meta={"answer": 1}), "b": Prompt(id="b", text="b?")}


def _length(prompt, completion, **meta):
    return float(len(completion))


def test_a_hung_call_times_out_as_an_error_and_the_rest_still_score() -> None:
    release, hung_returned = threading.Event(), threading.Event()

    def sometimes_hangs(prompt, completion, **meta):
        if completion == "hang":
            release.wait(30)
            hung_returned.set()
        return 1.0

    scorer = LocalScorer([RewardFn("r", sometimes_hangs, timeout_s=0.3)], max_workers=2)
    rollouts = [_rollout("a", "ok"), _rollout("a", "hang"), _rollout("b", "fine")]
    stats = scorer.score(PROMPTS, rollouts)
    # the hung call is still hanging: score() did not wait for it (it would have had 1.0)
    assert not hung_returned.is_set()
    release.set()
    assert [r.reward for r in rollouts] == [1.0, None, 1.0]
    assert rollouts[1].reward_error == "r: timed out (call took over 0.3 s)"
    assert stats.timeouts.value == 1 and stats.errors.value == 1 and by_fn(stats, "errors") == {"r": 1}
    # the pool that holds the hung thread is replaced: the next round runs at full width
    later = [_rollout("a", "x"), _rollout("b", "y")]
    scorer.score(PROMPTS, later)
    assert [r.reward for r in later] == [1.0, 1.0]
    scorer.close()


def test_a_timeout_counts_from_when_the_call_starts_not_when_it_was_queued() -> None:
    def slow(prompt, completion, **meta):
        time.sleep(0.1)
        return 1.0

    # one worker, twelve calls of at least 0.1 s (a sleep is never shorter): the last waits
    # at least 1.1 s in the queue, beyond its 1 s limit, while each call takes a tenth of
    # it (the margin a slow machine has, 0.9 s, is nine times the call)
    scorer = LocalScorer([RewardFn("r", slow, timeout_s=1.0, cache=False)], max_workers=1)
    rollouts = [_rollout("a", "x") for _ in range(12)]
    stats = scorer.score(PROMPTS, rollouts)
    assert [r.reward for r in rollouts] == [1.0] * 12 and stats.timeouts.value == 0
    scorer.close()


def test_identical_calls_run_once_per_round_and_are_cached_across_rounds() -> None:
    calls: list[str] = []

    def counted(prompt, completion, **meta):
        calls.append(completion)
        return float(len(completion))

    scorer = LocalScorer([RewardFn("n", counted)], max_workers=3)
    first = [_rollout("a", "xx"), _rollout("a", "xx"), _rollout("b", "xx"), _rollout("a", "yyy")]
    stats = scorer.score(PROMPTS, first)
    assert sorted(calls) == ["xx", "xx", "yyy"]  # ("a","xx") once; ("b","xx") is another prompt
    assert [r.reward for r in first] == [2.0, 2.0, 2.0, 3.0]
    assert by_fn(stats, "calls") == {"n": 3} and stats.cache_hits.value == 0
    second = [_rollout("a", "xx"), _rollout("b", "zz")]
    stats = scorer.score(PROMPTS, second)
    assert sorted(calls) == ["xx", "xx", "yyy", "zz"]
    assert stats.cache_hits.value == 1 and by_fn(stats, "calls") == {"n": 1}
    assert [r.reward for r in second] == [2.0, 2.0]
    scorer.close()


def test_errors_are_not_cached_and_cache_off_calls_every_sample() -> None:
    state = {"fail": True}
    calls: list[str] = []

    def flaky(prompt, completion, **meta):
        calls.append(completion)
        if state["fail"]:
            raise RuntimeError("service down")
        return 1.0

    scorer = LocalScorer([RewardFn("f", flaky)])
    r1 = [_rollout("a", "x")]
    scorer.score(PROMPTS, r1)
    assert r1[0].reward is None and r1[0].reward_error == "f: RuntimeError: service down"
    state["fail"] = False
    r2 = [_rollout("a", "x")]
    scorer.score(PROMPTS, r2)
    assert r2[0].reward == 1.0 and calls == ["x", "x"]
    uncached = LocalScorer([RewardFn("g", flaky, cache=False)])
    calls.clear()
    uncached.score(PROMPTS, [_rollout("a", "x"), _rollout("a", "x")])
    assert calls == ["x", "x"]
    scorer.close()
    uncached.close()


def test_the_cache_keeps_the_most_recently_used_entries() -> None:
    calls: list[str] = []

    def counted(prompt, completion, **meta):
        calls.append(completion)
        return 1.0

    scorer = LocalScorer([RewardFn("n", counted)], cache_size=2)
    for text in ["a", "b", "a", "c", "a", "b"]:  # "b" is evicted by "c", "a" stays in use
        scorer.score(PROMPTS, [_rollout("a", text)])
    assert calls == ["a", "b", "c", "b"]
    scorer.close()


def test_async_rewards_run_concurrently_and_time_out_by_cancelling() -> None:
    # Each of the ten calls waits until all ten have started: together they all return;
    # one after another, the first would wait for the others until its 1 s limit cut it.
    # The slow one waits for nothing that comes, so only the limit ends it.
    started, all_in, cancelled = [], asyncio.Event(), threading.Event()

    async def judge(prompt, completion, **meta):
        if completion == "slow":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise
        started.append(completion)
        if len(started) == 10:
            all_in.set()
        await all_in.wait()
        return 0.5

    scorer = LocalScorer([RewardFn("j", judge, timeout_s=1.0, cache=False)], max_workers=1)
    rollouts = [_rollout("a", f"t{i}") for i in range(10)] + [_rollout("b", "slow")]
    stats = scorer.score(PROMPTS, rollouts)
    assert [r.reward for r in rollouts[:10]] == [0.5] * 10
    assert rollouts[10].reward is None and stats.timeouts.value == 1
    assert rollouts[10].reward_error == "j: timed out (call took over 1 s)"
    assert cancelled.wait(10)  # the slow call was cancelled, not left running
    scorer.close()


def test_batched_rewards_get_one_call_and_per_item_errors() -> None:
    seen: list[list[str]] = []

    @batched
    def scores(prompts, completions, *, scale=1.0):
        seen.append(list(completions))
        out = []
        for p, c in zip(prompts, completions):
            if c == "none":
                out.append(None)
            elif c == "bad":
                out.append(ValueError("judge reply had no score"))
            else:
                out.append(scale * len(c) + p.meta.get("answer", 0))
        return out

    scorer = LocalScorer([RewardFn("s", scores, kwargs={"scale": 2.0})])
    rollouts = [_rollout("a", "xy"), _rollout("b", "none"), _rollout("b", "bad"), _rollout("a", "xy")]
    stats = scorer.score(PROMPTS, rollouts)
    assert seen == [["xy", "none", "bad"]]  # one call, duplicates made once
    assert [r.reward for r in rollouts] == [5.0, None, None, 5.0]
    assert rollouts[1].reward_error == "s: returned None"
    assert rollouts[2].reward_error == "s: ValueError: judge reply had no score"
    assert by_fn(stats, "calls") == {"s": 1} and by_fn(stats, "errors") == {"s": 2}
    scorer.close()


def test_a_batched_reward_that_raises_or_miscounts_fails_every_sample_it_covered() -> None:
    @batched
    def raises(prompts, completions):
        raise ConnectionError("no route")

    @batched
    def short(prompts, completions):
        return [1.0]

    @batched
    def by_key(prompts, completions):  # list() of a dict is its keys, not its scores
        return {i: 0.5 for i in range(len(completions))}

    for fn, message in [(raises, "b: ConnectionError: no route"), (short, "b: returned 1 values for 2 completions"),
                        (by_key, "b: returned a dict, not a sequence, for 2 completions")]:
        rollouts = [_rollout("a", "x"), _rollout("b", "y")]
        with LocalScorer([RewardFn("b", fn)]) as scorer:
            stats = scorer.score(PROMPTS, rollouts)
        assert [r.reward_error for r in rollouts] == [message, message]
        assert stats.errors.value == 2


def test_async_batched_rewards_are_awaited() -> None:
    @batched
    async def remote(prompts, completions):
        await asyncio.sleep(0.01)
        return [float(len(c)) for c in completions]

    rollouts = [_rollout("a", "abc"), _rollout("b", "de")]
    with LocalScorer([RewardFn("r", remote)]) as scorer:
        scorer.score(PROMPTS, rollouts)
    assert [r.reward for r in rollouts] == [3.0, 2.0]


def test_a_dropped_sample_is_masked_but_not_an_error() -> None:
    def safety(prompt, completion, **meta):
        if "bad" in completion:
            raise SampleDropped("rule weapons")
        return 0.0

    rollouts = [_rollout("a", "fine"), _rollout("a", "bad words")]
    with LocalScorer([RewardFn("len", _length), RewardFn("safety", safety)]) as scorer:
        stats = scorer.score(PROMPTS, rollouts)
    assert rollouts[0].reward == 4.0 and not rollouts[0].dropped
    assert rollouts[1].reward is None and rollouts[1].dropped
    assert rollouts[1].reward_error == "safety: dropped: rule weapons"
    assert stats.dropped.value == 1 and stats.errors.value == 0
    m = scalars(stats.metrics())
    assert m["reward/dropped"] == 1.0 and m["reward/errors/safety"] == 0.0


def test_metrics_time_each_reward_function(monkeypatch: pytest.MonkeyPatch) -> None:
    # The scorer's clock moves only while "slow" works (0.05 s a call), and one worker runs
    # the calls one at a time: what each function is charged is then exact, whatever else
    # the machine is doing.
    now = [100.0]
    monkeypatch.setattr(calls_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def slow(prompt, completion, **meta):
        now[0] += 0.05
        return 1.0

    fns = [RewardFn("slow", slow, cache=False), RewardFn("len", _length)]
    with LocalScorer(fns, max_workers=1) as scorer:
        stats = scorer.score(PROMPTS, [_rollout("a", "x"), _rollout("b", "y")])
    m = scalars(stats.metrics())
    assert m["time/reward/slow"] == pytest.approx(0.1, abs=1e-12)  # two calls, summed
    assert m["time/reward/len"] == 0.0
    assert m["perf/reward_calls/slow"] == 2.0 and m["reward/timeouts"] == 0.0


def test_results_do_not_depend_on_the_pool_width() -> None:
    rollouts = lambda: [_rollout("ab"[i % 2], "x" * i) for i in range(20)]  # noqa: E731
    widths = []
    for workers in (1, 8):
        rs = rollouts()
        with LocalScorer([RewardFn("len", _length, cache=False)], max_workers=workers) as scorer:
            scorer.score(PROMPTS, rs)
        widths.append([r.reward for r in rs])
    assert widths[0] == widths[1] == [float(i) for i in range(20)]


REWARD_FILE = textwrap.dedent(
    """
    import os, time

    def cpu(prompt, completion, **meta):
        if completion == "hang":
            while True:
                pass
        if completion == "die":
            os._exit(3)
        return float(len(completion)) + meta.get("bonus", 0)

    def pid(prompt, completion, **meta):
        return float(os.getpid())
    """
)


@pytest.fixture(scope="module")
def process_scorer(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("rewards")
    (directory / "r.py").write_text(REWARD_FILE)
    fns = build_reward_fns(
        [RewardFnConfig(fn="r.py:cpu", kwargs={"bonus": 10}, timeout_s=2.0),
         RewardFnConfig(fn="r.py:pid", cache=False)],
        base_dir=str(directory),
    )
    scorer = LocalScorer(fns, max_workers=2, pool="process")
    yield scorer
    scorer.close()


def test_process_workers_score_kill_hung_calls_and_survive_a_dying_worker(process_scorer: LocalScorer) -> None:
    import os

    rollouts = [_rollout("a", "abc"), _rollout("a", "hang"), _rollout("b", "die"), _rollout("b", "de")]
    stats = process_scorer.score(PROMPTS, rollouts)
    assert rollouts[0].rewards["cpu"] == 13.0 and rollouts[3].rewards["cpu"] == 12.0
    assert rollouts[1].reward_error == "cpu: timed out (call took over 2 s)"
    assert rollouts[2].reward_error == "cpu: the reward worker process died (exit code 3)"
    assert stats.timeouts.value == 1 and stats.errors.value == 2
    assert all(r.rewards["pid"] != float(os.getpid()) for r in rollouts)  # ran elsewhere
    # the killed and the dead worker were replaced: the pool works at full width again
    again = [_rollout("a", "x" * i) for i in range(1, 5)]
    process_scorer.score(PROMPTS, again)
    assert [r.rewards["cpu"] for r in again] == [11.0, 12.0, 13.0, 14.0]


def test_process_pool_refuses_a_function_it_cannot_ship() -> None:
    local = lambda p, c, **m: 1.0  # noqa: E731
    with pytest.raises(ValueError, match="reward 'local' cannot run in a worker process"):
        LocalScorer([RewardFn("local", local)], pool="process", max_workers=1)


def test_config_sets_timeout_and_cache(tmp_path: Path) -> None:
    (tmp_path / "r.py").write_text("def f(prompt, completion, **meta):\n    return 1.0\n")
    [rf] = build_reward_fns([RewardFnConfig(fn="r.py:f", timeout_s=3.5, cache=False)], base_dir=str(tmp_path))
    assert rf.timeout_s == 3.5 and rf.cache is False and rf.spec == "r.py:f"
    with pytest.raises(ValueError):
        RewardFnConfig(fn="r.py:f", timeout_s=0)
