"""The built-in tiny model and its byte-level tokenizer, built once per session."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from rltune.models.load import load_model, load_tokenizer


@pytest.fixture(scope="session")
def tiny_model(tiny_path: str) -> torch.nn.Module:
    """Shared across tests: tests that alter it use hooks they remove, never weights."""
    return load_model(tiny_path).eval()


@pytest.fixture(scope="session")
def tokenizer(tiny_path: str) -> PreTrainedTokenizerBase:
    return load_tokenizer(tiny_path)


@pytest.fixture(autouse=True)
def _single_thread(one_thread: None) -> None:
    """Every rollout test runs with one intra-op thread."""


@pytest.fixture
def require_fewrows() -> Callable[[], None]:
    """A check to call where a test runs the fewrows kernel (see :func:`_require_fewrows`)."""
    return _require_fewrows


def _require_fewrows() -> None:
    """Skip where the few-row kernel (``rltune/rollout/fewrows.cpp``) cannot be built here,
    with the reason; under CI (``CI=true``) fail instead, so that a green CI run has tested
    the kernel the CPU decoder runs by default."""
    from rltune.rollout import fewrows

    reason = fewrows.unavailable()
    if reason is None:
        return
    if os.environ.get("CI", "").strip().lower() in ("true", "1"):
        pytest.fail(f"the fewrows kernel cannot be built here, so it is untested: {reason} "
                    "(CI=true fails instead of skipping)", pytrace=False)
    pytest.skip(f"fewrows: {reason}")
