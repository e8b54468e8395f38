"""The planner's step-time prediction against real rltune steps on this CPU.

Each test calibrates (``rltune.plan.calibrate.run_calibration``, quick) and runs real
training steps of built-in-model configs in the same process, interleaved round after
round (``benchmarks/plan_validate.py``), so the machine's speed and load reach the
calibration and the runs alike; nothing here depends on this machine's absolute timings.
Each config's predicted step time (``rltune.plan.timing.step_time`` for the candidate that
describes the run, on the calibrated CPU cluster) must be within 25 % of its measured
median step time.

The statistic is the median over the rounds of each round's error with the machine's speed
drift removed (``validate``). One round is one sample of a noisy quantity: on a shared
2-core machine whose speed moved by up to 1.5x within a minute, 14 single rounds of the
tiny config gave -27 % to +0 % (mean -12.7 %, sd 7.1 %; one past 25 %) and 13 of the 3m
config -21 % to +11 %. The mean is the model's bias on this CPU: the run's scoring and
bookkeeping (~9 ms of a ~250 ms step) are not in the model, and the rest is what a real run
does that the probes, each measured alone, do not. The default test takes three rounds:
the median of three has about 0.67 of one round's spread (for a normal spread), which puts
25 % about 2.6 of its spreads past the tiny config's bias instead of 1.7.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import plan_validate as validation  # noqa: E402

from rltune.plan.calibrate import CALIBRATION_VERSION, FITTED, load_calibration  # noqa: E402

TOLERANCE = 0.25


def _check(rows: list[dict]) -> None:
    shown = validation.table(rows)
    print(shown)
    for row in rows:
        assert abs(row["error"]) <= TOLERANCE, f"{row['config']} off by {row['error']:+.1%}\n{shown}"


@pytest.mark.usefixtures("keep_torch_threads")
def test_two_local_runs_of_two_sizes_are_predicted_within_25_percent(tmp_path: Path) -> None:
    setups = tuple(s for s in validation.SETUPS if s.name in validation.QUICK)
    _check(validation.validate(setups, tmp_path, rounds=3, steps=6))
    # the calibration file the rounds used: versioned, the machine described, constants fitted
    path = tmp_path / "calibration-0.json"
    doc = json.loads(path.read_text())
    assert doc["version"] == CALIBRATION_VERSION
    assert {"cpu", "cores", "torch", "date", "threads_per_device"} <= set(doc["machine"])
    assert {"train_mfu", "layer_overhead_s", "comm_bandwidth"} <= set(doc["fitted"]) <= set(FITTED)
    cluster, eff = load_calibration(path)
    assert cluster.kind == "cpu" and cluster.fp32_ratio == 1.0 and eff.train_mfu > 0


@pytest.mark.slow
@pytest.mark.usefixtures("keep_torch_threads")
def test_every_local_config_is_predicted_within_25_percent(tmp_path: Path) -> None:
    """Two model sizes, group sizes 4 to 16, completions of 8 to 32 tokens, staleness 0
    and 1 (``benchmarks/plan_validate.py: SETUPS``)."""
    _check(validation.validate(tuple(s for s in validation.SETUPS if s.learners == 1), tmp_path, rounds=2, steps=4))


@pytest.mark.slow
@pytest.mark.usefixtures("keep_torch_threads")
def test_two_learner_processes_are_predicted_within_25_percent(tmp_path: Path) -> None:
    """Set against the machine's speed with two devices busy (``validate``'s docstring):
    on a shared 2-core machine two processes slow each other by 1.04x to 4x from minute
    to minute, which is the machine's load, not the model's error."""
    _check(validation.validate(tuple(s for s in validation.SETUPS if s.learners == 2), tmp_path, rounds=2, steps=4))
