"""Where the local runtime lets the decode keep its products for the learner's forward
(``train.reuse_rollout_mb``): only where the learner's lean forward can read them, so no
memory is held for records nobody reads."""

from __future__ import annotations

import pytest

from rltune.config import load_config
from rltune.models.load import load_model
from rltune.runtime.local import reuse_applies


def _applies(model_dir: str, *overrides: str, dtype: str = "float32") -> bool:
    cfg = load_config(None, ["reward.0.fn=m:f", f"model.dtype={dtype}", *overrides])
    return reuse_applies(cfg, load_model(model_dir, dtype=dtype))


def test_fp32_weights_in_fp32_keep_records(tiny_path: str) -> None:
    assert _applies(tiny_path)


@pytest.mark.parametrize(("overrides", "dtype"), [
    ((), "bfloat16"),  # bf16 weights: the lean forward replays float32 weights only
    (("train.precision=bf16",), "float32"),
    (("train.activation_checkpointing=full",), "float32"),
    (("train.compile=true",), "float32"),
    (("train.reuse_rollout_mb=0",), "float32"),
])
def test_what_the_learner_would_not_read_is_not_kept(tiny_path: str, overrides: tuple[str, ...], dtype: str) -> None:
    assert not _applies(tiny_path, *overrides, dtype=dtype)
