"""Helpers for end-to-end runs on the built-in tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from rltune.config import load_config

DIGIT_REWARD = '''
def digit_share(prompt, completion, **meta):
    """Share of the completion's characters that are digits."""
    if not completion:
        return 0.0
    return sum(ch.isdigit() for ch in completion) / len(completion)
'''


@pytest.fixture
def digit_reward_file(tmp_path: Path) -> Path:
    """A reward file written the way a user would write one."""
    path = tmp_path / "my_rewards.py"
    path.write_text(DIGIT_REWARD)
    return path


@pytest.fixture
def tiny_grpo_config(tmp_path: Path, digit_reward_file: Path):
    """``make(*overrides)``: GRPO on ``builtin:tiny`` with the digit-share reward, quiet,
    no final export."""
    return lambda *overrides: _tiny_grpo_config(tmp_path, digit_reward_file, *overrides)


def _tiny_grpo_config(tmp_path: Path, reward_file: Path, *overrides: str):
    return load_config(None, [
        "name=tiny-grpo",
        "model.path=builtin:tiny",
        "algo.name=grpo",
        "algo.group_size=8",
        "data.train=builtin:arith_small/train",
        f"reward.0.fn={reward_file}:digit_share",
        "rollout.max_new_tokens=8",
        "train.steps=30",
        "train.prompts_per_step=8",
        "train.lr=1e-3",
        f"log.dir={tmp_path / 'runs'}",
        "log.console=false",
        "checkpoint.final=false",
        *overrides,
    ])


@pytest.fixture(scope="module")
def tiny_grpo_config_at():
    """``make(root, *overrides)``: the same config as ``tiny_grpo_config`` with its reward
    file and run directories under ``root``; usable from module-scoped fixtures, so several
    tests can share one run."""

    def make(root: Path, *overrides: str):
        root.mkdir(parents=True, exist_ok=True)
        reward_file = root / "my_rewards.py"
        reward_file.write_text(DIGIT_REWARD)
        return _tiny_grpo_config(root, reward_file, *overrides)

    return make


@pytest.fixture(scope="module")
def keep_torch_threads():
    """Put torch's intra-op thread count back after a module whose runs set
    ``train.threads`` (``build_run`` sets it for the whole process)."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
