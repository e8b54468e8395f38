"""WandbSink in offline mode: the run's ``.wandb`` file is read back record by record with
W&B's own protobuf ``Record`` (``wandb_file.py``)."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("wandb")

from wandb_file import config, history, read_records, run_files  # noqa: E402

from rltune.metrics.sinks import Sink
from rltune.metrics.wandb import RUN_ID_FILE, WandbSink

NAN, INF = float("nan"), float("inf")


def test_offline_run_holds_history_histograms_and_config(tmp_path, capfd):
    sink = WandbSink(tmp_path, project="rltune-test", name="t-run", tags=("a", "b"))
    assert isinstance(sink, Sink)
    sink.log(0, {"eval/reward/mean": 0.25})
    sink.log(1, {"reward/mean": 0.5, "loss": NAN, "kl": INF, "entropy": None},
             {"length": [1.0, 3.0, NAN], "empty": [INF]})
    sink.log(2, {"reward/mean": 0.75, "loss": -0.25})
    sink.log(2, {"eval/reward/mean": 1.0})
    sink.log_config({"name": "t", "algo": {"name": "grpo"}, "train": {"betas": [0.9, 0.999]}})
    sink.close()
    sink.close()  # harmless

    assert capfd.readouterr().out == ""
    assert (tmp_path / RUN_ID_FILE).read_text() == sink.run_id + "\n"
    [path] = run_files(tmp_path, sink.run_id)
    records = read_records(path)
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name, list(run.tags)) == ("rltune-test", "t-run", ["a", "b"])

    rows = history(records)
    assert [row["_step"] for row in rows] == [0, 1, 2]
    assert rows[0] == {"_step": 0, "eval/reward/mean": 0.25}
    assert rows[2] == {"_step": 2, "reward/mean": 0.75, "loss": -0.25, "eval/reward/mean": 1.0}
    hist = {k: v for k, v in rows[1].items() if k.startswith("length/")}
    assert {k: v for k, v in rows[1].items() if not k.startswith("length/")} == {"_step": 1, "reward/mean": 0.5}
    assert hist["length/_type"] == "histogram"
    assert sum(hist["length/values"]) == 2 and hist["length/bins"][0] == 1.0 and hist["length/bins"][-1] == 3.0

    assert config(records) == {"name": "t", "algo": {"name": "grpo"}, "train": {"betas": [0.9, 0.999]}}


def test_resume_continues_the_same_run_and_a_fresh_run_gets_a_new_one(tmp_path):
    first = WandbSink(tmp_path, project="rltune-test")
    first.log(1, {"loss": 1.0})
    first.log(2, {"loss": 2.0})
    first.close()

    resumed = WandbSink(tmp_path, project="rltune-test", resume_after_step=1)
    assert resumed.run_id == first.run_id
    resumed.log(2, {"loss": 2.5})
    resumed.log(3, {"loss": 3.0})
    resumed.close()

    before, after = run_files(tmp_path, first.run_id)
    assert history(read_records(before)) == [{"_step": 1, "loss": 1.0}, {"_step": 2, "loss": 2.0}]
    assert history(read_records(after)) == [{"_step": 2, "loss": 2.5}, {"_step": 3, "loss": 3.0}]
    assert [r.run.resume for r in read_records(after) if r.WhichOneof("record_type") == "run"] == [True]

    fresh = WandbSink(tmp_path, project="rltune-test")
    fresh.close()
    assert fresh.run_id != first.run_id
    assert (tmp_path / RUN_ID_FILE).read_text() == fresh.run_id + "\n"


def test_bad_arguments_are_named(tmp_path):
    modes = r"\['offline', 'online', 'disabled'\]"
    with pytest.raises(ValueError, match=rf"WandbSink: mode must be one of {modes}, got 'local'"):
        WandbSink(tmp_path, project="p", mode="local")
    (tmp_path / RUN_ID_FILE).write_text("\n")
    with pytest.raises(ValueError, match=r"wandb-run-id: empty; it should hold the W&B run id"):
        WandbSink(tmp_path, project="p", resume_after_step=3)


def test_missing_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"pip install 'rltune\[wandb\]'"):
        WandbSink(tmp_path, project="p")
