"""Fixtures shared by the unit tests that run the built-in tiny model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from rltune.models.load import resolve_model


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """``builtin:tiny`` built once per session into a temporary cache (no download)."""
    return resolve_model("builtin:tiny", cache_dir=str(tmp_path_factory.mktemp("builtin")))


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and on a busy machine idle-spinning
    worker threads make each small op milliseconds slower; restored after the test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
