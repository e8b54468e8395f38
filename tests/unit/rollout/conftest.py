"""The built-in tiny model and its byte-level tokenizer, built once per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from rltune.models.load import load_model, load_tokenizer, resolve_model


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return resolve_model("builtin:tiny", cache_dir=str(tmp_path_factory.mktemp("builtin")))


@pytest.fixture(scope="session")
def tiny_model(tiny_path: str) -> torch.nn.Module:
    """Shared across tests: tests that alter it use hooks they remove, never weights."""
    return load_model(tiny_path).eval()


@pytest.fixture(scope="session")
def tokenizer(tiny_path: str) -> PreTrainedTokenizerBase:
    return load_tokenizer(tiny_path)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and on a busy machine idle-spinning
    worker threads make each small op milliseconds slower; restored after each test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
