"""metrics.jsonl and the optional sinks behind one object: what each sink receives, and a
sink that fails mid-run is closed without ending the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rltune.config.schema import Config
from rltune.metrics.sinks import JsonlWriter, truncate_after_step
from rltune.metrics.types import Histogram, Max, Sum
from rltune.runtime.sinks import MetricSinks, SinkError, open_sinks


class Recorder:
    def __init__(self, fail_at: int | None = None) -> None:
        self.logged: list[tuple[int, dict, dict]] = []
        self.configs: list[dict] = []
        self.closed = 0
        self.fail_at = fail_at

    def log(self, step, scalars, histograms=None) -> None:
        if step == self.fail_at:
            raise OSError("disk full")
        self.logged.append((step, dict(scalars), dict(histograms or {})))

    def log_config(self, config) -> None:
        self.configs.append(dict(config))

    def close(self) -> None:
        self.closed += 1


def test_scalars_go_to_the_file_and_histograms_only_to_the_sinks(tmp_path: Path) -> None:
    rec = Recorder()
    with MetricSinks(JsonlWriter(tmp_path / "metrics.jsonl"), [("rec", rec)]) as sinks:
        out = sinks.log(3, {"loss": 0.5, "tokens": Sum(12), "ratio_max": Max(1.5),
                            "hist/length": Histogram([2, 4])})
    assert out == {"loss": 0.5, "tokens": 12.0, "ratio_max": 1.5}
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [{"step": 3, "loss": 0.5, "tokens": 12.0, "ratio_max": 1.5}]
    assert rec.logged == [(3, out, {"hist/length": [2.0, 4.0]})]
    assert rec.closed == 1


def test_a_sink_that_fails_is_closed_and_the_run_goes_on(tmp_path: Path, capsys) -> None:
    bad, good = Recorder(fail_at=2), Recorder()
    sinks = MetricSinks(JsonlWriter(tmp_path / "metrics.jsonl"), [("flaky", bad), ("good", good)])
    for step in (1, 2, 3):
        sinks.log(step, {"loss": float(step)})
    sinks.close()
    assert [s for s, *_ in bad.logged] == [1] and bad.closed == 1
    assert [s for s, *_ in good.logged] == [1, 2, 3]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    assert sinks.failed == {"flaky": "OSError: disk full"}
    assert "the flaky metric sink failed (OSError: disk full)" in capsys.readouterr().err


REWARD = [{"fn": "a:b"}]


def test_only_metrics_jsonl_by_default(tmp_path: Path) -> None:
    sinks = open_sinks(Config(name="plain", reward=REWARD), tmp_path, resume_after_step=None)
    assert sinks.others == []
    sinks.close()
    assert (tmp_path / "metrics.jsonl").exists()


def test_a_sink_that_cannot_start_is_an_error_naming_it(tmp_path: Path) -> None:
    cfg = Config(name="x", reward=REWARD, log={"mlflow": {"tracking_uri": "nosuchscheme://x"}})
    with pytest.raises(SinkError, match=r"log\.mlflow: could not start the mlflow sink"):
        open_sinks(cfg, tmp_path, resume_after_step=None)


def test_a_resume_keeps_records_whose_text_holds_line_separators(tmp_path: Path) -> None:
    # a completion may decode to U+2028, U+0085 or U+001C-1E; written unescaped (or, for
    # U+001C-1E, as \u escapes), they must not split the record when a resume rereads
    # the file: only records after the resumed step go
    path = tmp_path / "samples.jsonl"
    writer = JsonlWriter(path)
    rows = [{"step": step, "completion": f"a\u2028b\x85c\x1cd\u2029{step}"} for step in (1, 2, 3)]
    for row in rows:
        writer.write(row)
    writer.close()
    truncate_after_step(path, 2)
    assert [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n")[:-1]] == rows[:2]
