"""A reward function's name is a segment of metric keys: one the keys reserve is refused
when the functions load, also when it is the function's own name, which the config could
not see."""

from __future__ import annotations

from pathlib import Path

import pytest

from rltune.config.schema import RewardFnConfig
from rltune.rewards.loading import RewardLoadError
from rltune.rewards.scorer import build_reward_fns


def test_a_function_whose_own_name_is_reserved_is_refused(tmp_path: Path) -> None:
    (tmp_path / "mine.py").write_text("def mean(prompt, completion, **meta):\n    return 1.0\n\nscore = mean\n")
    with pytest.raises(RewardLoadError, match=r"reward spec 'mine.py:score': the name 'mean' is reserved: reward/mean"):
        build_reward_fns([RewardFnConfig(fn="mine.py:score")], base_dir=str(tmp_path))
    [fn] = build_reward_fns([RewardFnConfig(fn="mine.py:score", name="average")], base_dir=str(tmp_path))
    assert fn.name == "average"


def test_an_empty_name_is_refused(tmp_path: Path) -> None:
    (tmp_path / "mine.py").write_text("def score(prompt, completion, **meta):\n    return 1.0\n")
    with pytest.raises(RewardLoadError, match="a reward function's name must not be empty"):
        build_reward_fns([RewardFnConfig(fn="mine.py:score", name="")], base_dir=str(tmp_path))
