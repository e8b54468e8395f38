"""A real training run with every sink on: TensorBoard's event reader, MLflow's client and
the W&B offline file all hold what metrics.jsonl holds, step for step; the report of the
run; the dashboard's refusals from the command line."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
from cli_check import fails

from rltune.cli import main
from rltune.metrics.report import fmt
from rltune.runtime.local import run_local

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")
pytest.importorskip("wandb")

STEPS = 3
CHECKED = ("reward/mean", "loss", "grad_norm", "entropy", "length/mean", "tokens_per_s", "time/step")


def _wandb_file_reader():
    path = Path(__file__).resolve().parents[1] / "unit" / "metrics" / "wandb_file.py"
    spec = importlib.util.spec_from_file_location("wandb_file", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run_dir(tiny_grpo_config_at, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sinks")
    cfg = tiny_grpo_config_at(root, f"train.steps={STEPS}", "log.tensorboard=true",
                              "log.wandb.project=rltune-e2e", "log.mlflow={}")
    return run_local(cfg).run_dir


def _jsonl(run_dir: Path) -> dict[int, dict[str, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


def test_tensorboard_holds_the_steps_and_histograms(run_dir: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    want = _jsonl(run_dir)
    for name in CHECKED:
        got = {e.step: e.value for e in acc.Scalars(name)}
        assert got == pytest.approx({s: want[s][name] for s in want}, rel=1e-6), name
    lengths = {e.step: e.histogram_value.num for e in acc.Histograms("hist/length")}
    assert lengths == {s: 64 for s in range(1, STEPS + 1)}  # 8 prompts x 8 samples


def test_mlflow_holds_the_steps_and_the_config(run_dir: Path) -> None:
    from mlflow.tracking import MlflowClient

    run_id = json.loads((run_dir / "mlflow-run.json").read_text())["run_id"]
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    want = _jsonl(run_dir)
    for name in CHECKED:
        got = {m.step: m.value for m in client.get_metric_history(run_id, name)}
        assert got == pytest.approx({s: want[s][name] for s in want}, rel=1e-6), name
    params = client.get_run(run_id).data.params
    assert params["algo.name"] == "grpo" and params["train.steps"] == str(STEPS)


def test_wandb_offline_file_holds_the_steps(run_dir: Path) -> None:
    reader = _wandb_file_reader()
    run_id = (run_dir / "wandb-run-id").read_text().strip()
    (path,) = reader.run_files(run_dir, run_id)
    rows = reader.history(reader.read_records(path))
    want = _jsonl(run_dir)
    by_step = {r["_step"]: r for r in rows if "loss" in r}
    assert sorted(by_step) == list(range(1, STEPS + 1))
    for step, row in by_step.items():
        for name in CHECKED:
            assert math.isclose(row[name], want[step][name], rel_tol=1e-6), (step, name)
    assert reader.config(reader.read_records(path))["algo"]["name"] == "grpo"


def test_report_of_the_finished_run(run_dir: Path, capsys) -> None:
    assert main(["report", str(run_dir)]) == 0
    index = run_dir / "report" / "index.html"
    assert f"report written to {index}" in capsys.readouterr().err.replace("\n", "")
    html = index.read_text()
    last = _jsonl(run_dir)[STEPS]
    assert "<th>reward/mean</th><td>" in html and f"<td>{fmt(last['reward/mean'])} <span" in html
    for chart in ("reward", "grad_norm", "entropy", "length", "throughput", "time"):
        png = index.parent / f"{chart}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", chart
        assert f'src="{chart}.png"' in html


def test_dashboard_refuses_other_addresses_without_a_token(capsys, monkeypatch, run_dir: Path) -> None:
    monkeypatch.delenv("RLTUNE_DASHBOARD_TOKEN", raising=False)
    message = fails(capsys, ["dashboard", str(run_dir), "--host", "0.0.0.0", "--port", "0"])
    assert "needs --token or RLTUNE_DASHBOARD_TOKEN" in message.replace("\n", "")
    assert "does not exist" in fails(capsys, ["dashboard", str(run_dir / "nope")])
