"""Shared by the layout e2e tests (``test_e2e_tp.py``, ``test_e2e_moe_ep.py``): GRPO on
``builtin:arith_small`` rewarded by the share of digits in the completion, a reward an
untrained tiny model improves on within 30 steps, and a runner that trains a named run
with overrides and reads its metrics back."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

import yaml

from rltune.cli import main

REWARD = '''
def digit_share(prompt, completion, **meta):
    """Share of the completion's characters that are digits."""
    if not completion:
        return 0.0
    return sum(ch.isdigit() for ch in completion) / len(completion)
'''


def digit_runner(root: Path, model: str) -> Callable[..., list[dict]]:
    """``run(name, *overrides) -> metrics``: ``rltune train`` of the digit-share config on
    ``model`` in ``root``; each step's metrics, read back from the run's metrics.jsonl."""
    (root / "rewards.py").write_text(REWARD)
    config = {
        "name": "digits",
        "model": {"path": model},
        "algo": {"name": "grpo", "group_size": 8},
        "data": {"train": "builtin:arith_small/train"},
        "reward": [{"fn": "rewards.py:digit_share"}],
        "rollout": {"max_new_tokens": 8},
        "train": {"steps": 30, "prompts_per_step": 8, "lr": 1e-3, "threads": 1},
        "log": {"dir": str(root / "runs"), "console": False},
        "checkpoint": {"final": False},
    }
    path = root / "digits.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))

    def run(name: str, *overrides: str) -> list[dict]:
        assert main(["train", str(path), f"name={name}", *overrides]) == 0
        lines = (root / "runs" / name / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    return run


def ends(metrics: list[dict]) -> tuple[float, float]:
    """The mean reward over the first five steps and over the last five."""
    curve = [m["reward/mean"] for m in metrics]
    return statistics.mean(curve[:5]), statistics.mean(curve[-5:])
