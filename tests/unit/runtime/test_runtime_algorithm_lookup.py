"""The registry is the one list of algorithms: the run checks ``algo.name`` against it
before loading anything, and a registered algorithm needs nothing else to be accepted."""

from __future__ import annotations

import pytest

from rltune.algos import ALGORITHMS, group_baseline
from rltune.algos.registry import online_algorithm
from rltune.config import ConfigError, load_config
from rltune.runtime.local import build_run
from rltune.runtime.roles import lookup_algorithm


def test_a_typo_names_the_closest_algorithm() -> None:
    with pytest.raises(ConfigError, match=r"unknown algorithm 'pppo' \(did you mean 'ppo'\?\); known: grpo"):
        lookup_algorithm("pppo")


def test_build_run_refuses_the_name_before_loading_a_model(monkeypatch) -> None:
    monkeypatch.setattr("rltune.runtime.build.resolve_model", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(ConfigError, match="unknown algorithm 'grpoo'"):
        build_run(load_config(None, ["algo.name=grpoo", "reward=[{fn: builtin:exact_numeric}]"]))


def test_an_online_algorithm_without_a_reward_is_refused(monkeypatch) -> None:
    monkeypatch.setitem(ALGORITHMS, "mean_baseline", online_algorithm("mean_baseline", group_baseline))
    monkeypatch.setattr("rltune.runtime.build.resolve_model", lambda *a, **k: pytest.fail("loaded a model"))
    cfg = load_config(None, ["algo.name=mean_baseline"])  # a registered name is a valid name
    with pytest.raises(ConfigError, match="algo.name=mean_baseline needs at least one entry in `reward`"):
        build_run(cfg)


def test_build_run_refuses_what_the_registry_says_the_algorithm_cannot_run_with(monkeypatch) -> None:
    monkeypatch.setattr("rltune.runtime.build.resolve_model", lambda *a, **k: pytest.fail("loaded a model"))
    cfg = load_config(None, ["algo.name=grpo", "algo.group_size=1", "reward=[{fn: builtin:exact_numeric}]"])
    with pytest.raises(ConfigError, match=r"^algo.group_size must be >= 2 for grpo \(the group is the baseline\)$"):
        build_run(cfg)
