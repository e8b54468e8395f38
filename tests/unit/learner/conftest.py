"""Built-in tiny models for the learner tests, built once per session (no download)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from rltune.models.load import load_model, resolve_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    """``builtin:tiny`` in fp32. Tests deep-copy it before training a copy."""
    return load_model(resolve_model("builtin:tiny", cache_dir=str(tmp_path_factory.mktemp("builtin"))))


@pytest.fixture(scope="session")
def tiny_moe_model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    """``builtin:tiny-moe`` (4 experts, top-2) in fp32."""
    return load_model(
        resolve_model("builtin:tiny-moe", cache_dir=str(tmp_path_factory.mktemp("builtin-moe")))
    )


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and on a busy machine idle-spinning
    worker threads make each small op milliseconds slower; restored after each test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
