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


@pytest.fixture(scope="session")
def tiny_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from rltune.models.tiny_vl import TINY_VL_SPECS, build_tiny_vl

    return str(build_tiny_vl(tmp_path_factory.mktemp("tiny-vl"), seed=0, **TINY_VL_SPECS["tiny-vl"]))


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from rltune.models.tiny_vl import TINY_VL_SPECS, build_tiny_vl

    return str(build_tiny_vl(tmp_path_factory.mktemp("tiny-llava"), seed=0, **TINY_VL_SPECS["tiny-llava"]))
