"""Every reward call gets its own copies of the sample's mutable data: a reward that
changes what it is given (``tests.pop()``, ``prompt.meta[...] = ...``, a config kwarg's
list) changes neither the dataset, nor later samples of the group, nor later steps, and
thread and process pools score alike."""

from __future__ import annotations

import asyncio
import textwrap
import threading
from pathlib import Path

import torch

from rltune.config.schema import RewardFnConfig
from rltune.data.records import Prompt, PromptImage, Rollout
from rltune.rewards.calls import RewardFn, Sample
from rltune.rewards.contract import batched
from rltune.rewards.scorer import LocalScorer, build_reward_fns

TESTS = [f"assert f({i}) == {i}" for i in range(10)]


def _rollout(prompt_id: str, text: str, turns: list | None = None) -> Rollout:
    return Rollout(
        prompt_id=prompt_id, group=0, prompt_ids=torch.tensor([1]), completion_ids=torch.tensor([2]),
        completion_logprobs=None, loss_mask=torch.ones(1), text=text, finish_reason="stop",
        policy_version=0, turns=turns,
    )


MUTATING = textwrap.dedent(
    """
    def count_then_pop(prompt, completion, *, tests, seen, **meta):
        # counts what it was given, then "consumes" it: the tests, the config's list and
        # the prompt's own fields
        n = len(tests) + len(seen) + len(prompt.messages)
        tests.pop()
        seen.append(completion)
        prompt.meta["tests"].clear()
        prompt.meta["answer"] = "changed"
        prompt.messages.append({"role": "user", "content": "more"})
        return float(n)
    """
)


def _prompt() -> Prompt:
    return Prompt("p", messages=[{"role": "user", "content": "q"}], meta={"tests": list(TESTS), "answer": "4"})


def _scores(tmp_path: Path, pool: str) -> tuple[list[list[float | None]], Prompt]:
    (tmp_path / "mut.py").write_text(MUTATING)
    fns = build_reward_fns(
        [RewardFnConfig(fn="mut.py:count_then_pop", kwargs={"seen": []}, cache=False)], base_dir=str(tmp_path)
    )
    prompt = _prompt()
    steps = []
    with LocalScorer(fns, pool=pool, max_workers=2 if pool == "thread" else 1) as scorer:
        for _ in range(3):  # three steps of a group of four
            rollouts = [_rollout("p", f"c{i}") for i in range(4)]
            scorer.score({"p": prompt}, rollouts)
            steps.append([r.reward for r in rollouts])
    return steps, prompt


def test_a_mutating_reward_scores_every_sample_of_every_step_alike_in_either_pool(tmp_path: Path) -> None:
    for pool in ("thread", "process"):
        (tmp_path / pool).mkdir()
        steps, prompt = _scores(tmp_path / pool, pool)
        assert steps == [[11.0] * 4] * 3, pool  # 10 tests + 0 seen + 1 message, for every sample
        assert prompt.meta == {"tests": TESTS, "answer": "4"}, pool  # the dataset row is untouched
        assert prompt.messages == [{"role": "user", "content": "q"}], pool


def test_turns_input_ids_and_nested_kwargs_are_the_calls_own_and_the_cache_stays_true() -> None:
    calls = []

    def nosy(prompt, completion, *, turns, options, **meta):
        calls.append(completion)
        value = float(len(turns) + len(options["levels"]) + len(prompt.input_ids))
        turns.clear()
        options["levels"].append(99)
        prompt.input_ids.append(7)
        meta["answer"] = "x"  # the merged dict is the call's own anyway
        return value

    prompt = Prompt("p", text="q", meta={"answer": "4"}, input_ids=[1, 2, 3])
    turns = [{"role": "assistant", "content": "a"}, {"role": "tool", "content": "b"}]
    scorer = LocalScorer([RewardFn("nosy", nosy, kwargs={"options": {"levels": [1]}})], max_workers=1)
    first = [_rollout("p", "x", turns=turns), _rollout("p", "y", turns=turns)]
    scorer.score({"p": prompt}, first)
    again = [_rollout("p", "x", turns=turns)]
    scorer.score({"p": prompt}, again)  # the same sample: its key was computed before the calls
    scorer.close()
    assert [r.rewards["nosy"] for r in first + again] == [6.0, 6.0, 6.0]
    assert calls == ["x", "y"] and again[0].turns == turns and len(turns) == 2
    assert prompt.input_ids == [1, 2, 3] and prompt.meta == {"answer": "4"}


def test_async_and_batched_rewards_get_copies_too() -> None:
    async def popper(prompt, completion, *, tests, **meta):
        await asyncio.sleep(0)
        n = len(tests)
        tests.pop()
        return float(n)

    shared = []

    @batched
    def judge(prompts, completions, *, seen):
        shared.append(prompts[0] is prompts[1])  # one prompt given twice is one copy, given twice
        out = [float(len(p.meta["tests"]) + len(seen)) for p in prompts]
        for p in prompts:
            p.meta["tests"].pop()
        seen.append("x")
        return out

    fns = [RewardFn("popper", popper, cache=False), RewardFn("judge", judge, kwargs={"seen": []}, cache=False)]
    prompt = _prompt()
    with LocalScorer(fns) as scorer:
        for _ in range(2):
            rollouts = [_rollout("p", "a"), _rollout("p", "b")]
            scorer.score({"p": prompt}, rollouts)
            assert [r.rewards for r in rollouts] == [{"popper": 10.0, "judge": 10.0}] * 2
    assert shared == [True, True] and prompt.meta["tests"] == TESTS


def test_what_cannot_change_is_shared_not_copied() -> None:
    long_text = "x" * 1_000_000
    image = PromptImage("a.png", "0" * 16, b"\x89PNG" * 1000)
    pixels = torch.zeros(4, 3)
    prompt = Prompt("p", text="q", meta={"doc": long_text, "pair": (1, "a"), "blob": b"b" * 100, "n": 3},
                    images=[image], vision={"pixel_values": pixels})
    own, meta = Sample(prompt, "c").arguments(RewardFn("r", lambda p, c, **m: 0.0, kwargs={"k": [long_text]}))
    assert own is not prompt and own.meta is not prompt.meta
    assert meta["doc"] is long_text and meta["pair"] is prompt.meta["pair"] and meta["blob"] is prompt.meta["blob"]
    assert meta["k"][0] is long_text
    assert own.images is not prompt.images and own.images[0] is image  # frozen, bytes: shared
    assert own.vision["pixel_values"] is pixels  # pixel tensors are shared (documented)
    assert own.meta["doc"] is meta["doc"]  # within a call, meta's values are the prompt copy's


def test_data_that_cannot_be_copied_is_an_error_naming_the_reward() -> None:
    prompt = Prompt("p", text="q", meta={"lock": threading.Lock()})
    rollout = _rollout("p", "c")
    stats = LocalScorer([RewardFn("r", lambda p, c, **m: 1.0)], max_workers=1).score({"p": prompt}, [rollout])
    assert rollout.reward is None and stats.errors.value == 1
    assert rollout.reward_error.startswith(
        "r: cannot copy the sample's prompt, meta or kwargs for the call: TypeError: cannot pickle"
    )
