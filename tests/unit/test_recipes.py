"""Every shipped recipe loads, validates against the schema and passes its algorithm's
checks in the registry."""

from __future__ import annotations

from pathlib import Path

import pytest

from rltune.algos import ALGORITHMS, config_problems
from rltune.config import load_config

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))


def test_there_are_recipes():
    assert RECIPES


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_loads(path: Path):
    cfg = load_config(path)
    assert cfg.name == path.stem
    assert config_problems(ALGORITHMS[cfg.algo.name], cfg) == []
