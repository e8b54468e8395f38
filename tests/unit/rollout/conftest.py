"""The built-in tiny model and its byte-level tokenizer, built once per session."""

from __future__ import annotations

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
