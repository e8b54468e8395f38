"""``runtime.max_staleness`` is checked against the loss (and against the algorithm by the
registry: ``tests/unit/algos/test_algos_registry.py``)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rltune.config.schema import Config

REWARD = [{"fn": "a:b"}]


def test_staleness_needs_importance_correction() -> None:
    with pytest.raises(ValidationError, match="set algo.importance_correction to token-truncate or seq-mask"):
        Config(reward=REWARD, runtime={"max_staleness": 1})
    ok = Config(reward=REWARD, runtime={"max_staleness": 2}, algo={"importance_correction": "token-truncate"})
    assert ok.runtime.max_staleness == 2


def test_staleness_is_not_negative() -> None:
    with pytest.raises(ValidationError, match="max_staleness"):
        Config(reward=REWARD, runtime={"max_staleness": -1})
