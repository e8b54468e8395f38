"""A run that trains bf16 weights (``model.dtype: bfloat16``, no fp32 copy) says so when it
starts: small updates round away, which train.precision: bf16 on fp32 weights avoids."""

from __future__ import annotations

from rltune.config import load_config
from rltune.runtime.build import _bf16_weights_note


def _note(*overrides: str) -> str | None:
    return _bf16_weights_note(load_config(None, ["reward.0.fn=m:f", *overrides]))


def test_bf16_weights_are_noted() -> None:
    assert _note("model.dtype=bfloat16") == (
        "note: model.dtype=bfloat16 trains bf16 weights with no fp32 copy, so updates smaller than about 1/256 of "
        "a weight round away; for bf16 arithmetic on fp32 weights set model.dtype: float32 and train.precision: bf16"
    )


def test_fp32_weights_lora_adapters_and_no_steps_are_not() -> None:
    assert _note() is None
    assert _note("train.precision=bf16") is None
    assert _note("model.dtype=bfloat16", "model.lora.r=4") is None  # the adapters are fp32
    assert _note("model.dtype=bfloat16", "train.steps=0") is None
