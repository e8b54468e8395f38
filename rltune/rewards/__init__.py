"""Reward functions and scorers.

A reward function is a plain callable ``fn(prompt, completion, **meta) -> float | None``;
None or an exception means "no score" (the sample is masked out and counted as an error).
"""

from rltune.rewards.builtin import exact_numeric, format_regex
from rltune.rewards.contract import SampleDropped, batched, verifier
from rltune.rewards.loading import RewardLoadError, check_reward_signature, load_reward_fn
from rltune.rewards.scorer import LocalScorer, RewardFn, ScoreStats, build_reward_fns

__all__ = [
    "LocalScorer",
    "RewardFn",
    "RewardLoadError",
    "SampleDropped",
    "ScoreStats",
    "batched",
    "build_reward_fns",
    "check_reward_signature",
    "exact_numeric",
    "format_regex",
    "load_reward_fn",
    "verifier",
]
