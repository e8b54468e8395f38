"""A machine whose sandbox can only limit resources is said when a run's code rewards and
python tool are built, before the first generation, not at the first sample."""

from __future__ import annotations

import pytest

from rltune.config.schema import RewardFnConfig
from rltune.envs.tools import python_tool
from rltune.rewards.scorer import build_reward_fns
from rltune.sandbox import runner


@pytest.fixture
def only_rlimits(monkeypatch):
    """A machine where neither bwrap nor unshare runs (chosen afresh, warned afresh)."""
    reasons = {"bwrap": "bubblewrap (`bwrap`) is not installed", "unshare": "needs root", "rlimits-only": None}
    runner.isolation.cache_clear()
    monkeypatch.setattr(runner, "_unavailable", lambda m: reasons[m])
    monkeypatch.setattr(runner, "_warned", False)
    yield
    runner.isolation.cache_clear()


@pytest.mark.usefixtures("only_rlimits")
def test_building_code_tests_says_the_sandbox_is_resource_limits_only() -> None:
    with pytest.warns(RuntimeWarning, match=r"code sandbox: running with resource limits only .* bwrap: "
                                            r"bubblewrap \(`bwrap`\) is not installed; unshare: needs root"):
        build_reward_fns([RewardFnConfig(fn="builtin:code_tests")])


@pytest.mark.usefixtures("only_rlimits")
def test_building_the_python_tool_says_it_too() -> None:
    with pytest.warns(RuntimeWarning, match=r"code sandbox: running with resource limits only"):
        python_tool()
