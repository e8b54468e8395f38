"""The planner's step-time prediction against real rltune steps on this CPU.

Each test calibrates (``rltune.plan.calibrate.run_calibration``, quick) and runs real
training steps of built-in-model configs in the same process, interleaved round after
round (``benchmarks/plan_validate.py``), so the machine's speed and load reach the
calibration and the runs alike; nothing here depends on this machine's absolute timings.
The statistic is, for each config, the median over the rounds of each round's error of the
predicted step time (``rltune.plan.timing.step_time`` for the candidate that describes
the run, on the calibrated CPU cluster) against the measured median step time, with the
machine's speed drift removed (``validate``).

The planner's accuracy, 25 %, is checked by the slow tests, which take every config and
want a quiet machine (``docs/plan.md``). The default test is the fast representative, and
its bound is what three rounds of about a minute can resolve on a shared 2-core machine:
that machine's speed moved by up to 1.5x within a minute, so one round is a noisy sample.
Thirty-five rounds of each default config, taken over an hour of changing load (before
the timing model counted the shared-prompt path's second forward, ~+2 points), gave
drift-removed errors of mean -11.9 %, sd 17.1 % (tiny) and mean -3.8 %, sd 21.0 % (3m),
from -49 % to +65 %; 23 % of single rounds of either config were past 25 %. Over all
triples of those rounds, the median of three is past 25 % with probability 0.11 (tiny)
and 0.08 (3m), past 40 % with 0.005 and 0.009, past 50 % with 0 and 0.002. So the default
bound is 50 %: a run of the suite fails by noise about once in 400, while a cost model
off by more than a factor of two either way (a unit, a missing phase, a fit gone wrong) is
outside it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import plan_validate as validation  # noqa: E402

from rltune.plan.calibrate import FITTED  # noqa: E402
from rltune.plan.calibration_file import CALIBRATION_VERSION, load_calibration  # noqa: E402

TOLERANCE = 0.25
"""The planner's accuracy on a quiet machine (the slow tests)."""
DEFAULT_TOLERANCE = 0.50
"""What the default test's three rounds resolve on a shared machine (module docstring)."""


def _check(rows: list[dict], tolerance: float = TOLERANCE) -> None:
    shown = validation.table(rows)
    print(shown)
    for row in rows:
        assert abs(row["error"]) <= tolerance, f"{row['config']} off by {row['error']:+.1%}\n{shown}"


@pytest.mark.usefixtures("keep_torch_threads")
def test_two_local_runs_of_two_sizes_are_predicted_within_what_three_rounds_resolve(tmp_path: Path) -> None:
    setups = tuple(s for s in validation.SETUPS if s.name in validation.QUICK)
    _check(validation.validate(setups, tmp_path, rounds=3, steps=6), DEFAULT_TOLERANCE)
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
