"""The calibration's fit and file: the least-squares fit recovers the constants that
generated synthetic timings through the timing model itself, the linearisation reads the
model's coefficients exactly, bounds hold, and the JSON file round-trips and refuses
corrupt, foreign and old files with one clear line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from rltune.plan import calibrate as cal
from rltune.plan import calibration_file as cal_file
from rltune.plan.catalogue import spec_from_config, tiny_config
from rltune.plan.errors import PlanError
from rltune.plan.spec import Candidate, Cluster, Efficiency, LearnerLayout, Workload

CPU = Cluster(gpus=2, gpus_per_node=2, memory_gb=12.0, tflops=0.03, hbm_gbps=8.0, intra_gbps=8.0,
              inter_gbps=8.0, host_gbps=8.0, fp32_ratio=1.0, kind="cpu", name="test CPU")
TRUTH = Efficiency(train_mfu=0.62, prefill_mfu=0.27, decode_bandwidth=0.35, decode_mfu=0.48,
                   layer_overhead_s=4.0e-4, step_overhead_s=2.5e-3, comm_bandwidth=0.19,
                   comm_latency_s=1.2e-3, score_s=0.0, token_overhead_s=3e-6)
START = Efficiency(train_mfu=0.5, prefill_mfu=0.5, decode_bandwidth=0.5, decode_mfu=0.5,
                   layer_overhead_s=1e-4, step_overhead_s=1e-3, comm_bandwidth=0.5, comm_latency_s=1e-4)
TINY = spec_from_config(tiny_config("qwen2", 128, 4, 4, 2), source="test", name="tiny")
THREE_M = spec_from_config(tiny_config("qwen2", 256, 3, 4, 2), source="test", name="3m")


def synthetic_probes(eff: Efficiency) -> list[cal.Probe]:
    """The calibration's kinds of probe, timed by the timing model at ``eff``: learner
    steps, forwards and optimizer steps of two models, generations from one sequence
    (bandwidth-bound decode) to 256 (compute-bound), two all-reduces."""
    cand = Candidate(LearnerLayout(), micro_batch_tokens=cal.BUDGET)
    probes = []
    for spec in (TINY, THREE_M):
        for rows, prompt, completion in cal.LEARN_SHAPES:
            probes.append(cal.Probe("step", spec, cal.learner_only(rows, prompt, completion), cand, "step", 1.0))
            probes.append(cal.Probe("fwd", spec, cal.scored_online(rows, prompt, completion), cand, "reference", 1.0))
        probes.append(cal.Probe("opt", spec, cal.learner_only(1, 1, 1), cand, "optimizer", 1.0))
        for prompts, n, prompt, new in ((1, 1, 23, 8), (2, 4, 23, 16), (8, 32, 23, 24), (4, 8, 64, 4)):
            work = Workload(algo="grpo", generates=True, critic=False, reference=False, prompts_per_step=prompts,
                            group_size=n, prompt_tokens=prompt, completion_tokens=new, precision="fp32",
                            rollout_precision="fp32")
            probes.append(cal.Probe("gen", spec, work, Candidate(LearnerLayout(), colocate=True), "generate", 1.0))
    group = Candidate(LearnerLayout(dp_replicate=2))
    probes += [cal.Probe("ar", TINY, cal.learner_only(1, 1, 1), group, f"all_reduce:{n}", 1.0) for n in (4096, 16e6)]
    return [dataclasses.replace(p, seconds=cal.predict_probe(p, CPU, eff)) for p in probes]


def test_the_fit_recovers_the_constants_that_generated_the_timings() -> None:
    eff, fitted = cal.fit_efficiency(synthetic_probes(TRUTH), CPU, start=START)
    # score_s: no probe scores, so nothing determines it and it keeps its start value;
    # token_overhead_s is fitted once the timing model uses it
    assert set(cal.FITTED) - {"score_s", "token_overhead_s"} <= set(fitted) <= set(cal.FITTED) - {"score_s"}
    for name in fitted:
        assert getattr(eff, name) == pytest.approx(getattr(TRUTH, name), rel=1e-6), name
    for name in set(cal.FITTED) - set(fitted):
        assert getattr(eff, name) == getattr(START, name), name


def test_the_recovered_constants_do_not_depend_on_the_start() -> None:
    far = dataclasses.replace(START, train_mfu=0.05, decode_bandwidth=0.9, layer_overhead_s=0.0)
    eff, _ = cal.fit_efficiency(synthetic_probes(TRUTH), CPU, start=far)
    assert eff.decode_bandwidth == pytest.approx(TRUTH.decode_bandwidth, rel=1e-6)
    assert eff.train_mfu == pytest.approx(TRUTH.train_mfu, rel=1e-6)


def test_a_wrong_model_is_not_recovered() -> None:
    """Control: timings with a 10 % slower learner step than the model says are fitted,
    but not to the truth (the fit does not just echo its start or the truth)."""
    probes = [dataclasses.replace(p, seconds=p.seconds * (1.1 if p.phase == "step" else 1.0))
              for p in synthetic_probes(TRUTH)]
    eff, _ = cal.fit_efficiency(probes, CPU, start=START)
    assert eff.train_mfu != pytest.approx(TRUTH.train_mfu, rel=1e-3)


def test_linearise_reads_the_all_reduce_coefficients() -> None:
    """A ring all-reduce of B bytes over 2 ranks: B / (intra x comm_bandwidth) + 2 x latency,
    so with theta = (1/comm_bandwidth, comm_latency_s) the row is (B / intra, 2), b = 0.
    B = 16e6 bytes, intra 8 GB/s: 16e6 / 8e9 = 2e-3."""
    probe = cal.Probe("ar", TINY, cal.learner_only(1, 1, 1), Candidate(LearnerLayout(dp_replicate=2)),
                      "all_reduce:16000000", 1.0)
    a, b = cal.linearise([probe], CPU, TRUTH, names=("comm_bandwidth", "comm_latency_s"))
    np.testing.assert_allclose(a, [[2e-3, 2.0]], rtol=1e-7)
    assert abs(b[0]) < 1e-12


def test_bounded_least_squares_pins_a_coordinate_at_its_bound() -> None:
    """min (x1 - 1)^2 + (x2 + 2)^2 with x >= 0: unconstrained x2 = -2, pinned at 0."""
    x = cal._bounded_lstsq(np.eye(2), np.array([1.0, -2.0]), np.zeros(2))
    np.testing.assert_allclose(x, [1.0, 0.0])


def test_a_fit_without_measurements_or_with_a_non_positive_time_is_refused() -> None:
    with pytest.raises(PlanError, match="no measurements"):
        cal.fit_efficiency([], CPU)
    probe = dataclasses.replace(synthetic_probes(TRUTH)[0], seconds=0.0)
    with pytest.raises(PlanError, match="not positive"):
        cal.fit_efficiency([probe], CPU)


def test_the_cpu_cluster_has_a_device_per_threads_cores() -> None:
    """4 cores, 2 threads a device: 2 devices of 16 / 2 = 8 GB; 3e10 FLOP/s = 0.03 TFLOP/s;
    8e9 B/s = 8 GB/s on every link; fp32 at the full rate."""
    machine = {"cpu": "x", "cores": 4, "memory_gb": 16.0, "threads_per_device": 2}
    cluster = cal.cpu_cluster(machine, flops=3e10, stream_bytes_s=8e9)
    assert (cluster.gpus, cluster.gpus_per_node, cluster.memory_gb) == (2, 2, 8.0)
    assert (cluster.tflops, cluster.hbm_gbps, cluster.intra_gbps, cluster.fp32_ratio) == (0.03, 8.0, 8.0, 1.0)
    assert cluster.kind == "cpu"


def test_the_file_round_trips(tmp_path: Path) -> None:
    path = cal_file.save_calibration(tmp_path / "c.json", CPU, TRUTH, fitted=("train_mfu",),
                                machine={"cpu": "x", "cores": 2}, probes=[{"what": "p", "measured_s": 1.0}])
    assert cal_file.load_calibration(path) == (CPU, TRUTH)
    doc = json.loads(path.read_text())
    assert (doc["format"], doc["version"], doc["fitted"]) == (cal_file.CALIBRATION_FORMAT, cal_file.CALIBRATION_VERSION,
                                                            ["train_mfu"])


def _saved(tmp_path: Path, **changes: object) -> Path:
    path = cal_file.save_calibration(tmp_path / "c.json", CPU, TRUTH, fitted=(), machine={})
    doc = json.loads(path.read_text()) | changes
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize(("changes", "message"), [
    ({"version": 0}, r"version 0, this rltune reads version 1; run `rltune plan --calibrate` again"),
    ({"format": "something-else"}, "not an rltune plan calibration"),
    ({"efficiency": {"train_mfu": 0.5, "warp_factor": 9}}, r"`efficiency` is not a Efficiency \(\['warp_factor'\]\)"),
    ({"cluster": {"tflops": 1.0}}, r"`cluster`: .*missing 1 required positional argument: 'gpus'"),
    ({"cluster": None}, r"`cluster` is not a Cluster"),
    # hand-edited values the timing model would divide by, or compute with, as given
    ({"efficiency": {"train_mfu": 0}}, r"`efficiency.train_mfu` is 0: expected a number > 0 \(the planner divides by it\)"),
    ({"efficiency": {"train_mfu": "0.4"}}, r"`efficiency.train_mfu` is '0.4': expected a finite number"),
    ({"efficiency": {"score_s": -1.0}}, r"`efficiency.score_s` is -1.0: expected seconds >= 0"),
    ({"efficiency": {"decode_mfu": True}}, r"`efficiency.decode_mfu` is True: expected a finite number"),
    ({"cluster": {"gpus": 1.5}}, r"`cluster.gpus` is 1.5: expected an integer >= 1"),
    ({"cluster": {"gpus": 1, "tflops": -3}}, r"`cluster.tflops` is -3: expected a number > 0"),
    ({"cluster": {"gpus": 1, "kind": "tpu"}}, r"`cluster.kind` is 'tpu': expected one of \['gpu', 'cpu'\]"),
    ({"cluster": {"gpus": 1, "name": 7}}, r"`cluster.name` is 7: expected a string"),
])
def test_a_bad_file_is_refused_with_one_line(tmp_path: Path, changes: dict, message: str) -> None:
    path = _saved(tmp_path, **changes)
    with pytest.raises(PlanError, match=message) as err:
        cal_file.load_calibration(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_corrupt_or_missing_file_is_refused(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    path.write_text(path.read_text()[:40])
    with pytest.raises(PlanError, match=f"calibration file {path}: not JSON"):
        cal_file.load_calibration(path)
    with pytest.raises(PlanError, match="cannot read it"):
        cal_file.load_calibration(tmp_path / "absent.json")
    path.write_text(json.dumps({"format": cal_file.CALIBRATION_FORMAT, "version": cal_file.CALIBRATION_VERSION}))
    with pytest.raises(PlanError, match="no `cluster`"):
        cal_file.load_calibration(path)
