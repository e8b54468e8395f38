"""MlflowSink: runs written to a real local store and read back with MLflow's own client.

Creating an MLflow SQLite database (its table migrations) takes seconds, so one test
makes it from scratch and the others start from a copy of an empty one made once."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("mlflow") is None:
    pytest.skip("mlflow is not installed", allow_module_level=True)

from rltune.metrics.mlflow import RUN_FILE, MlflowSink, flatten_config, import_mlflow, mlflow_key
from rltune.metrics.sinks import Sink

NAN, INF = float("nan"), float("inf")
CONFIG = {
    "name": "t",
    "algo": {"name": "grpo", "clip_low": 0.2, "kl_target": None, "dynamic_sampling": False},
    "reward": [{"fn": "r.py:digit_share", "kwargs": {}}],
    "train": {"betas": [0.9, 0.999], "steps": 3},
}
PARAMS = {
    "name": "t",
    "algo.name": "grpo",
    "algo.clip_low": "0.2",
    "algo.kl_target": "null",
    "algo.dynamic_sampling": "false",
    "reward.0.fn": "r.py:digit_share",
    "reward.0.kwargs": "{}",
    "train.betas": "[0.9, 0.999]",
    "train.steps": "3",
}


@pytest.fixture(scope="module")
def empty_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    import_mlflow().tracking.MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def run_dir(tmp_path: Path, empty_db: Path) -> Path:
    """A run directory whose default store already exists (empty)."""
    shutil.copyfile(empty_db, tmp_path / "mlflow.db")
    return tmp_path


def client_for(run_dir: Path) -> Any:
    return import_mlflow().tracking.MlflowClient(f"sqlite:///{run_dir.resolve()}/mlflow.db")


def history(client: Any, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def test_default_store_holds_metrics_params_and_the_run_file(tmp_path):
    sink = MlflowSink(tmp_path, run_name="t-run")  # creates RUN/mlflow.db from scratch
    assert isinstance(sink, Sink)
    sink.log(0, {"eval/reward/mean": 0.25})
    sink.log(1, {"reward/mean": 0.5, "loss": NAN, "kl": INF, "entropy": None, "time:gen": 1.5}, {"length": [1.0]})
    sink.log(2, {"reward/mean": 0.75, "loss": -0.25})
    sink.log_config(CONFIG)
    sink.close()
    sink.close()  # harmless

    stored = json.loads((tmp_path / RUN_FILE).read_text())
    assert stored["run_id"] == sink.run_id
    assert stored["tracking_uri"] == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    client = client_for(tmp_path)
    run = client.get_run(sink.run_id)
    assert (run.info.run_name, run.info.status) == ("t-run", "FINISHED")
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.name == "rltune"
    assert experiment.artifact_location == (tmp_path.resolve() / "mlartifacts").as_uri()
    assert run.data.metrics == {"eval/reward/mean": 0.25, "reward/mean": 0.75, "loss": -0.25, "time_gen": 1.5}
    assert history(client, sink.run_id, "reward/mean") == [(1, 0.5), (2, 0.75)]
    assert history(client, sink.run_id, "loss") == [(2, -0.25)]
    assert history(client, sink.run_id, "eval/reward/mean") == [(0, 0.25)]
    assert history(client, sink.run_id, "kl") == []
    assert run.data.params == PARAMS


def test_resume_continues_the_same_run(run_dir):
    first = MlflowSink(run_dir)
    first.log_config(CONFIG)
    first.log(1, {"loss": 1.0})
    first.log(2, {"loss": 2.0})
    # no close: the process died

    changed = {**CONFIG, "train": {"betas": [0.9, 0.999], "steps": 5}}
    resumed = MlflowSink(run_dir, resume_after_step=1)
    assert resumed.run_id == first.run_id
    client = client_for(run_dir)
    assert client.get_run(first.run_id).info.status == "RUNNING"
    resumed.log_config(changed)
    resumed.log(2, {"loss": 2.5})
    resumed.close()

    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == PARAMS
    assert run.data.tags["resumed.train.steps"] == "5"
    assert history(client, first.run_id, "loss") == [(1, 1.0), (2, 2.0), (2, 2.5)]

    fresh = MlflowSink(run_dir)
    fresh.close()
    assert fresh.run_id != first.run_id
    assert json.loads((run_dir / RUN_FILE).read_text())["run_id"] == fresh.run_id


def test_resume_into_another_store_is_refused(run_dir, tmp_path_factory):
    MlflowSink(run_dir).close()
    other = tmp_path_factory.mktemp("other") / "mlflow.db"
    with pytest.raises(ValueError, match=r"mlflow-run.json: the MLflow run was logged to sqlite:///.*/mlflow.db, "
                                         r"not to sqlite:///.*other.*; resume with that tracking URI"):
        MlflowSink(run_dir, tracking_uri=f"sqlite:///{other}", resume_after_step=0)


def test_file_store_uri_is_allowed(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    uri = (tmp_path / "mlruns").as_uri()
    sink = MlflowSink(tmp_path / "run", tracking_uri=uri, experiment="files")
    sink.log(3, {"reward/mean": 0.5})
    sink.close()
    client = import_mlflow().tracking.MlflowClient(uri)
    assert history(client, sink.run_id, "reward/mean") == [(3, 0.5)]
    assert client.get_experiment_by_name("files").experiment_id == client.get_run(sink.run_id).info.experiment_id


def test_two_metrics_with_one_mlflow_name_are_an_error(run_dir):
    sink = MlflowSink(run_dir)
    sink.log(1, {"time:gen": 1.0})
    with pytest.raises(ValueError, match=r"metrics 'time:gen' and 'time_gen' both become 'time_gen' in MLflow"):
        sink.log(2, {"time_gen": 1.0})
    sink.close()


def test_mlflow_key():
    assert mlflow_key("reward/mean") == "reward/mean"
    assert mlflow_key("eval/reward/my fn-2.v") == "eval/reward/my fn-2.v"
    assert mlflow_key("a:b") == "a_b"
    assert mlflow_key("//a//b/") == "a/b"
    assert mlflow_key("./x/../y") == "_/x/__/y"
    assert mlflow_key("länge[0]") == "l_nge_0_"
    assert mlflow_key("") == "_"
    assert mlflow_key("x" * 300) == "x" * 250


def test_flatten_config_cuts_long_values():
    assert flatten_config(CONFIG) == PARAMS
    assert flatten_config({"a": {"b": "y" * 7000}, "c": [[1, 2], []], "d": Path("/p")}) == {
        "a.b": "y" * 6000, "c": "[[1, 2], []]", "d": "/p",
    }


def test_missing_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ImportError, match=r"pip install 'rltune\[mlflow\]'"):
        MlflowSink(tmp_path)
