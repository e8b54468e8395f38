"""SFT on one-digit addition: the completion NLL of the tiny model falls well below where
it starts within 40 steps, and the lr-0 control stays where it started."""

from __future__ import annotations

import statistics

import pytest

from rltune.config import load_config
from rltune.runtime.local import build_run
from rltune.runtime.loop import train

pytestmark = pytest.mark.usefixtures("keep_torch_threads")


def _nll_curve(tmp_path, *overrides: str) -> list[float]:
    cfg = load_config(None, [
        "name=tiny-sft", "model.path=builtin:tiny", "algo.name=sft",
        "data.train=builtin:arith_small/train", "train.steps=40", "train.prompts_per_step=16",
        "train.lr=3e-3", "train.threads=1", f"log.dir={tmp_path}", "log.console=false",
        "checkpoint.final=false", *overrides,
    ])
    return [m["nll"] for m in train(build_run(cfg))]


def test_sft_lowers_the_completion_nll(tmp_path):
    curve = _nll_curve(tmp_path)
    first, last = statistics.mean(curve[:5]), statistics.mean(curve[-5:])
    # an untrained byte-level model: about log(260) = 5.6 nats per token
    assert first > 4.0, curve
    assert last < 0.5 * first, curve


def test_control_with_zero_lr_does_not_learn(tmp_path):
    curve = _nll_curve(tmp_path, "train.lr=0")
    assert abs(statistics.mean(curve[-5:]) - statistics.mean(curve[:5])) < 0.1, curve
