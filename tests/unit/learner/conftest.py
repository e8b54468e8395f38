"""Built-in tiny models for the learner tests, built once per session (no download)."""

from __future__ import annotations

import pytest
import torch

from rltune.models.load import load_model, resolve_model


@pytest.fixture(scope="session")
def tiny_model(tiny_path: str) -> torch.nn.Module:
    """``builtin:tiny`` in fp32. Tests deep-copy it before training a copy."""
    return load_model(tiny_path)


@pytest.fixture(scope="session")
def tiny_moe_model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    """``builtin:tiny-moe`` (4 experts, top-2) in fp32."""
    return load_model(
        resolve_model("builtin:tiny-moe", cache_dir=str(tmp_path_factory.mktemp("builtin-moe")))
    )


@pytest.fixture(autouse=True)
def _single_thread(one_thread: None) -> None:
    """Every learner test runs with one intra-op thread."""
