"""Edges of loading and scoring a reward: a ``check_kwargs`` hook with a bug, numpy
return values, a batched function's signature, and specs naming a directory, a missing
file or written with spaces."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from rltune.config.schema import RewardFnConfig
from rltune.data.records import Prompt, Rollout
from rltune.rewards.contract import batched
from rltune.rewards.loading import RewardLoadError, load_reward_fn
from rltune.rewards.scorer import LocalScorer, RewardFn, build_reward_fns

PROMPTS = {"a": Prompt(id="a", text="a?", meta={"answer": 1})}


def _rollout(text: str) -> Rollout:
    return Rollout(
        prompt_id="a", group=0, prompt_ids=torch.tensor([1]), completion_ids=torch.tensor([2]),
        completion_logprobs=None, loss_mask=torch.ones(1), text=text, finish_reason="stop",
        policy_version=0,
    )


HOOKS = """
def reward(prompt, completion, *, level=1, **meta):
    return 1.0
def _key(kwargs):
    return kwargs["missing"]
def _type(kwargs):
    raise TypeError("level must be int")
def _value(kwargs):
    raise ValueError("level must be at most 3")
"""


@pytest.mark.parametrize(("hook", "raised"), [
    ("_key", "KeyError: 'missing'"),
    ("_type", "TypeError: level must be int"),
])
def test_a_check_kwargs_hook_that_raises_is_a_load_error_naming_the_spec(tmp_path: Path, hook, raised) -> None:
    (tmp_path / "hooks.py").write_text(HOOKS + f"reward.check_kwargs = {hook}\n")
    with pytest.raises(RewardLoadError) as info:
        build_reward_fns([RewardFnConfig(fn="hooks.py:reward")], base_dir=str(tmp_path))
    assert str(info.value) == (
        f"reward 'reward' (spec 'hooks.py:reward'): its check_kwargs hook raised {raised} "
        "(a check_kwargs hook refuses a value by raising ValueError)"
    )


def test_a_check_kwargs_hook_refusing_a_value_keeps_its_message(tmp_path: Path) -> None:
    (tmp_path / "hooks.py").write_text(HOOKS + "reward.check_kwargs = _value\n")
    with pytest.raises(RewardLoadError, match=r"^reward 'reward': level must be at most 3$"):
        build_reward_fns([RewardFnConfig(fn="hooks.py:reward")], base_dir=str(tmp_path))


def test_numpy_bools_count_like_pythons() -> None:
    @batched
    def flags(prompts, completions):
        return np.array([c == "yes" for c in completions])

    fns = [RewardFn("flag", lambda p, c, **m: np.bool_(c == "yes")), RewardFn("flags", flags, 2.0)]
    rollouts = [_rollout("yes"), _rollout("no")]
    LocalScorer(fns).score(PROMPTS, rollouts)
    assert [r.rewards for r in rollouts] == [{"flag": 1.0, "flags": 1.0}, {"flag": 0.0, "flags": 0.0}]
    assert [r.reward for r in rollouts] == [3.0, 0.0]
    assert all(type(v) is float for v in rollouts[0].rewards.values())


@pytest.mark.parametrize(("value", "named"), [
    (np.float64("nan"), "numpy.float64"),
    (np.str_("1.0"), "numpy.str_"),
    (np.array([1.0]), "numpy.ndarray"),
])
def test_numpy_values_that_are_no_reward_are_named_as_numpys(value, named) -> None:
    rollout = _rollout("x")
    LocalScorer([RewardFn("odd", lambda p, c, **m: value)]).score(PROMPTS, [rollout])
    assert rollout.reward_error == f"odd: returned {named} {value!r} (expected a finite number)"


def test_a_batched_function_with_a_bad_signature_gets_the_batched_hint(tmp_path: Path) -> None:
    (tmp_path / "b.py").write_text(
        "from rltune.rewards.contract import batched\n"
        "@batched\ndef judge(prompts):\n    return [1.0] * len(prompts)\n"
    )
    with pytest.raises(RewardLoadError) as info:
        load_reward_fn("b.py:judge", base_dir=str(tmp_path))
    assert str(info.value) == (
        "reward spec 'b.py:judge': judge(prompts) cannot be called as fn(prompts, completions, **kwargs); "
        "it needs two positional parameters, e.g. `@batched` over `def judge(prompts, completions, **kwargs):`"
    )


def test_a_missing_file_in_the_working_directory_is_listed_once(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardLoadError) as info:
        load_reward_fn("nope.py:f", base_dir=str(tmp_path))
    assert str(info.value) == f"reward spec 'nope.py:f': file not found (looked for {tmp_path / 'nope.py'})"
    with pytest.raises(RewardLoadError) as info:  # base_dir written another way, same directory
        load_reward_fn("nope.py:f", base_dir=os.curdir)
    assert str(info.value).count(str(tmp_path / "nope.py")) == 1


def test_a_directory_is_said_to_be_one(tmp_path: Path) -> None:
    (tmp_path / "adir.py").mkdir()
    with pytest.raises(RewardLoadError) as info:
        load_reward_fn("adir.py:f", base_dir=str(tmp_path))
    assert str(info.value) == f"reward spec 'adir.py:f': {tmp_path / 'adir.py'} is a directory, not a Python file"


def test_a_directory_in_base_dir_does_not_hide_the_file_in_the_working_directory(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "base" / "r.py").mkdir(parents=True)
    (tmp_path / "r.py").write_text("def f(prompt, completion, **meta):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    assert load_reward_fn("r.py:f", base_dir=str(tmp_path / "base"))(None, "") == 1.0


@pytest.mark.parametrize("spec", [" r.py : f ", "r.py :f", "r.py: f", "builtin : exact_numeric"])
def test_spaces_around_the_colon_are_ignored(tmp_path: Path, spec: str) -> None:
    (tmp_path / "r.py").write_text("def f(prompt, completion, **meta):\n    return 1.0\n")
    fn = load_reward_fn(spec, base_dir=str(tmp_path))
    assert fn.__name__ == spec.split(":")[1].strip()
    [rf] = build_reward_fns([RewardFnConfig(fn=spec)], base_dir=str(tmp_path))
    assert rf.name == fn.__name__
