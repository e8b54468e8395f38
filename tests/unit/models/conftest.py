"""Tiny model directories shared by the model tests (built once per session, no download)."""

from __future__ import annotations

import pytest

from rltune.models.tiny import TINY_SPECS, build_tiny


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny(tmp_path_factory.mktemp("tiny"), seed=0, **TINY_SPECS["tiny"]))


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny(tmp_path_factory.mktemp("tiny-moe"), seed=0, **TINY_SPECS["tiny-moe"]))
