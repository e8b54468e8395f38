"""A report folder that cannot be made or written is a ``ReportError`` naming the path
and the system's reason (the CLI's one line), not an ``OSError`` traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

import rltune.metrics.report as report
from rltune.metrics.report import ReportError, write_report


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    return run


def test_an_out_dir_under_a_file_is_named(run_dir, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    out = blocker / "report"
    with pytest.raises(ReportError, match=rf"^cannot write the report to {out}: Not a directory; give --out a "
                                          r"directory this user can create and write$"):
        write_report(run_dir, out)
    assert blocker.read_text() == "x"


def test_a_file_that_cannot_be_written_is_named_with_the_reason(run_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"

    def refuse(data, folder):
        raise PermissionError(13, "Permission denied", str(folder / "reward.png"))

    monkeypatch.setattr(report, "write_charts", refuse)
    with pytest.raises(ReportError, match=rf"^cannot write the report to {out}: Permission denied "
                                          rf"\({out / 'reward.png'}\); give --out"):
        write_report(run_dir, out)


def test_proc_is_refused_in_one_line(run_dir):
    if not Path("/proc/self").exists():
        pytest.skip("no /proc here")
    with pytest.raises(ReportError, match=r"^cannot write the report to /proc/nope: No such file or directory;"):
        write_report(run_dir, Path("/proc/nope"))
