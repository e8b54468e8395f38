"""Errors about a reward file name the user's file, never the module name rltune gives it
when loading it by path (``rltune_user_reward_<stem>_<hash>``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rltune.rewards.loading import RewardLoadError, load_reward_fn


@pytest.mark.parametrize(("source", "asked", "expected"), [
    ("def brevity(prompt, completion, **meta):\n    return 1.0\n", "brevty",
     "did you mean 'brevity'? (its functions: brevity)"),
    # a class is no reward (it is refused by name), so it is neither suggested nor listed
    ("class Scorer:\n    pass\ndef scorer_v2(prompt, completion, **meta):\n    return 1.0\n", "Scorerr",
     "did you mean 'scorer_v2'? (its functions: scorer_v2)"),
])
def test_a_missing_function_names_the_file_and_suggests_a_function(tmp_path: Path, source, asked, expected) -> None:
    path = tmp_path / "my_rewards.py"
    path.write_text(source)
    with pytest.raises(RewardLoadError) as info:
        load_reward_fn(f"{path}:{asked}")
    assert str(info.value) == f"reward spec '{path}:{asked}': file {path} has no attribute '{asked}'; {expected}"
    assert "rltune_user_reward" not in str(info.value)


def test_a_missing_function_of_a_module_names_the_module() -> None:
    with pytest.raises(RewardLoadError, match="^reward spec 'builtin:nope': module 'rltune.rewards.builtin' has no"):
        load_reward_fn("builtin:nope")


def test_file_and_import_errors_say_reward_spec(tmp_path: Path) -> None:
    with pytest.raises(RewardLoadError, match="^reward spec 'nope.py:f': file not found"):
        load_reward_fn("nope.py:f", base_dir=str(tmp_path))
    with pytest.raises(RewardLoadError, match="^reward spec 'no_such_reward_module:f': cannot import module"):
        load_reward_fn("no_such_reward_module:f")
