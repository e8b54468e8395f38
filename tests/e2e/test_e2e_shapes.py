"""builtin:shapes on builtin:tiny-vl, the vision-language demo.

Fast: SFT on a few dozen images lowers the answers' NLL well below where an untrained
model starts, and the lr-0 control stays put.

Slow: the shipped recipes end to end. ``shapes-sft`` (the sloppy teacher's
demonstrations) then ``shapes-grpo`` from its final weights: held-out greedy accuracy
after GRPO beats after SFT by at least 10 points, and the same GRPO at lr 0 leaves the
held-out accuracy exactly where SFT left it (the policy never changes, greedy decoding is
deterministic).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from rltune.config import load_config
from rltune.runtime.local import run_local

pytestmark = pytest.mark.usefixtures("keep_torch_threads")

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
ACCURACY = "eval/reward/mean"  # exact_text scores 1 or 0: the mean is the accuracy


def _train(recipe: Path | None, root: Path, *overrides: str) -> list[dict]:
    """Train ``recipe`` with ``overrides`` under ``root`` as ``rltune train`` does (the final
    weights exported to ``root/NAME/final``); its metrics.jsonl rows."""
    cfg = load_config(recipe, [f"log.dir={root}", "log.console=false", *overrides])
    run_local(cfg)
    lines = (root / cfg.name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _nll_curve(root: Path, *overrides: str) -> list[float]:
    rows = _train(None, root, *[
        "name=shapes-small-sft", "model.path=builtin:tiny-vl", "model.freeze_vision=false",
        "algo.name=sft", "data.train=builtin:shapes_small/train-sloppy", "train.steps=25",
        "train.prompts_per_step=16", "train.lr=3e-3", "train.threads=1",
        "checkpoint.final=false", *overrides,
    ])
    return [m["nll"] for m in rows if "nll" in m]


def test_sft_on_images_lowers_the_answer_nll(tmp_path):
    curve = _nll_curve(tmp_path)
    first, last = statistics.mean(curve[:5]), statistics.mean(curve[-5:])
    # an untrained byte-level model: about log(263) = 5.6 nats per token
    assert first > 4.0, curve
    assert last < 0.5 * first, curve


def test_control_with_zero_lr_does_not_learn(tmp_path):
    curve = _nll_curve(tmp_path, "train.lr=0")
    assert abs(statistics.mean(curve[-5:]) - statistics.mean(curve[:5])) < 0.1, curve


def _held_out(rows: list[dict]) -> list[float]:
    return [m[ACCURACY] for m in rows if ACCURACY in m]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """Held-out accuracies (before, ..., after) of the SFT recipe, the GRPO recipe from its
    final weights, and that GRPO at lr 0 (10 steps: the policy never moves)."""
    root = tmp_path_factory.mktemp("shapes")
    sft = _held_out(_train(RECIPES / "shapes-sft.yaml", root))
    start = f"model.path={root / 'shapes-sft' / 'final'}"
    grpo = _held_out(_train(RECIPES / "shapes-grpo.yaml", root, start))
    control = _held_out(_train(RECIPES / "shapes-grpo.yaml", root, start, "name=shapes-grpo-lr0",
                               "train.lr=0", "train.steps=10", "eval.every=0"))
    return sft, grpo, control


@pytest.mark.slow
def test_grpo_beats_sft_by_ten_points(demo):
    sft, grpo, _ = demo
    assert grpo[0] == sft[-1], (sft, grpo)  # GRPO starts from SFT's final weights
    assert grpo[-1] >= sft[-1] + 0.10, (sft, grpo)


@pytest.mark.slow
def test_grpo_at_lr_zero_does_not_move(demo):
    sft, _, control = demo
    assert control == [sft[-1], sft[-1]], (sft, control)
