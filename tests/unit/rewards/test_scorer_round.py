"""A scoring round against the executor protocol alone: which calls it makes, where each
outcome goes, what it caches. The executor here answers in this thread, so nothing
depends on timing."""

from __future__ import annotations

from rltune.data.records import Prompt
from rltune.rewards.calls import Call, Outcome, RewardFn, Sample
from rltune.rewards.contract import batched
from rltune.rewards.executors.base import Finished
from rltune.rewards.round import RewardCache, Round

PROMPTS = {"a": Prompt(id="a", text="a?"), "b": Prompt(id="b", text="b?")}


class InlineExecutor:
    """Runs each call when collected; a call on a "hang" completion comes back as cut at
    its timeout, as a real executor hands it back."""

    def __init__(self) -> None:
        self.submitted: list[Call] = []
        self.pending: list[Call] = []

    def submit(self, call: Call) -> None:
        self.submitted.append(call)
        self.pending.append(call)

    def collect(self, wait_s: float) -> list[Finished]:
        done, self.pending = self.pending, []
        return [(c, c.timed_out() if any(s.completion == "hang" for s in c.samples) else c.run()) for c in done]

    def close(self) -> None:
        pass


def _length(prompt, completion, **meta):
    return float(len(completion))


def _samples(*pairs: str) -> list[Sample]:
    return [Sample(PROMPTS[p[0]], p[2:]) for p in pairs]


def test_a_round_calls_each_distinct_sample_once_and_caches_only_values() -> None:
    rf = RewardFn("len", _length, timeout_s=1.0)
    cache, executor = RewardCache(100), InlineExecutor()
    round_ = Round([rf], _samples("a:xy", "a:xy", "b:xy", "a:hang"), cache)
    [outcomes] = round_.run(lambda fn: executor)
    # ("a", "xy") once; ("b", "xy") is another prompt
    assert [[s.completion for s in c.samples] for c in executor.submitted] == [["xy"], ["xy"], ["hang"]]
    assert [o.value for o in outcomes] == [2.0, 2.0, 2.0, None]
    assert outcomes[1].seconds == 0.0  # the duplicate has no time of its own
    assert outcomes[3] == Outcome(None, "len: timed out (call took over 1 s)", 1.0, timed_out=True)
    assert round_.calls == {"len": 3} and round_.cache_hits == 0
    # the values are cached, the timeout is not: the next round calls only "hang" again
    again, executor.submitted = Round([rf], _samples("b:xy", "a:hang"), cache), []
    assert [o.value for o in again.run(lambda fn: executor)[0]] == [2.0, None]
    assert [[s.completion for s in c.samples] for c in executor.submitted] == [["hang"]]
    assert again.cache_hits == 1 and again.calls == {"len": 1}


def test_a_batched_function_gets_one_call_of_its_distinct_samples() -> None:
    @batched
    def lengths(prompts, completions):
        return [float(len(c)) for c in completions]

    executors = {"b": InlineExecutor(), "p": InlineExecutor()}
    fns = [RewardFn("b", lengths, cache=False), RewardFn("p", _length, cache=False)]
    round_ = Round(fns, _samples("a:x", "a:x", "b:yyy"), RewardCache(0))
    by_batch, per_sample = round_.run(lambda fn: executors[fn.name])
    # without the cache, every sample is its own call; the batched one is still one call
    assert [len(c.samples) for c in executors["b"].submitted] == [3]
    assert [len(c.samples) for c in executors["p"].submitted] == [1, 1, 1]
    assert [o.value for o in by_batch] == [o.value for o in per_sample] == [1.0, 1.0, 3.0]
    assert round_.calls == {"b": 1, "p": 3}
