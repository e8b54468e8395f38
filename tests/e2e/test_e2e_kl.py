"""The KL-to-reference term: a frozen copy of the starting model is loaded only when
``algo.kl_coef > 0``; the KL is exactly 0 before the first update and positive after."""

from __future__ import annotations

from rltune.runtime.local import build_run
from rltune.runtime.loop import train


def test_kl_to_reference_starts_at_zero_and_grows(tiny_grpo_config):
    run = build_run(tiny_grpo_config("algo.kl_coef=0.1", "algo.kl_kind=k3", "train.steps=3"))
    assert run.reference_logprobs is not None
    history = train(run)
    assert history[0]["kl"] == 0.0
    assert history[1]["kl"] > 0.0 and history[2]["kl"] > 0.0


def test_no_reference_without_kl(tiny_grpo_config):
    run = build_run(tiny_grpo_config("train.steps=1"))
    assert run.reference_logprobs is None
    assert "kl" not in train(run)[0]
