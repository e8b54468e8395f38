"""A failing reward's message as each sample records it: whole up to a bound, so the part
that says what went wrong reaches samples.jsonl, while the kind an error is grouped by
stays short."""

from __future__ import annotations

import torch

from rltune.data.records import Prompt, Rollout
from rltune.rewards.calls import RewardFn, call_batch
from rltune.rewards.contract import SampleDropped, batched
from rltune.rewards.scorer import LocalScorer
from rltune.runtime.reward_errors import error_kind

FIELDS = [f"field_{i:03d}" for i in range(40)]
PROMPTS = {"a": Prompt(id="a", text="2+2?", meta={name: i for i, name in enumerate(FIELDS)})}


def _rollout(text: str) -> Rollout:
    return Rollout(
        prompt_id="a", group=0, prompt_ids=torch.tensor([1, 2]), completion_ids=torch.tensor([3]),
        completion_logprobs=None, loss_mask=torch.ones(1), text=text, finish_reason="stop",
        policy_version=0,
    )


def _score(fn, text: str = "x") -> Rollout:
    rollout = _rollout(text)
    LocalScorer([RewardFn("picky", fn)]).score(PROMPTS, [rollout])
    return rollout


def test_a_long_message_reaches_the_sample_whole() -> None:
    # the row's fields come first, what went wrong at the end: the end must survive
    def picky(prompt: Prompt, completion: str, **meta: object) -> float:
        raise KeyError(f"fields {sorted(meta)} have no 'answer'; set `answer` in each row")

    rollout = _score(picky)
    message = rollout.reward_error
    assert rollout.reward is None and not rollout.dropped
    assert len(message) > 500
    assert message.startswith("picky: KeyError: \"fields ['field_000', ")
    assert message.endswith("have no 'answer'; set `answer` in each row\"")
    # grouped (and printed once) by its kind, which the message's length does not reach
    assert error_kind(message) == "picky: KeyError"


def test_an_assertions_message_is_kept() -> None:
    def checks(prompt: Prompt, completion: str, **meta: object) -> float:
        assert completion.startswith("<answer>"), (
            f"completion must start with <answer>, got {completion!r} ({len(completion)} characters)"
        )
        return 1.0

    text = "The answer is " + "very " * 30 + "likely 4."
    message = _score(checks, text).reward_error
    # (under pytest the assertion's message is followed by its explanation)
    assert message.startswith(
        f"picky: AssertionError: completion must start with <answer>, got {text!r} ({len(text)} characters)"
    )


def test_a_huge_message_is_cut_with_the_count_of_what_was_left_out() -> None:
    def flood(prompt: Prompt, completion: str, **meta: object) -> float:
        raise RuntimeError("z" * 1_000_000)

    message = _score(flood).reward_error
    assert message == "picky: RuntimeError: " + "z" * 2000 + "... (998000 more characters)"


def test_a_drops_reason_and_a_batched_rewards_error_are_kept_whole() -> None:
    reason = "the reference solution for this prompt is missing: " + ", ".join(FIELDS)

    def dropping(prompt: Prompt, completion: str, **meta: object) -> float:
        raise SampleDropped(reason)

    rollout = _score(dropping)
    assert rollout.dropped and rollout.reward_error == f"picky: dropped: {reason}"

    @batched
    def per_sample(prompts, completions):
        return [ValueError(reason) for _ in prompts]

    outcomes = call_batch(RewardFn("batch", per_sample), [PROMPTS["a"]] * 2, ["x", "y"])
    assert [o.error for o in outcomes] == [f"batch: ValueError: {reason}"] * 2


def test_a_bad_return_values_repr_stays_short() -> None:
    message = _score(lambda p, c, **m: "w" * 500).reward_error
    assert message == "picky: returned str '" + "w" * 76 + "... (expected a finite number)"
    assert error_kind(message) == "picky: returned str"
