"""write_report on a small run directory written here: the charts that should exist (and
only those) as real PNG files, and the page's numbers, escaping and errors."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib")

from rltune.metrics.report import GENERATOR, ReportError, fmt, is_report_page, pick_samples, write_report

CONFIG = "name: demo<&>\nalgo:\n  name: grpo\ntrain:\n  steps: 4\n"

METRICS: list[dict[str, Any]] = [
    {"step": 0, "eval/reward/mean": 0.25, "eval/reward/acc": 0.5},
    {"step": 1, "reward/mean": 0.5, "reward/std": 0.125, "reward/acc": 0.25, "reward/fmt": 0.75,
     "reward/errors": 0.0, "reward/errors/acc": 0.0, "accuracy/acc": 0.0, "loss": 0.125, "grad_norm": 2.5,
     "entropy": 1.5, "length/mean": 10.0, "length/max": 16.0, "samples_per_s": 12.5,
     "time/generate": 1.0, "time/score": 0.25, "time/learn": 0.5, "time/step": 2.0},
    {"step": 2, "reward/mean": 0.875, "reward/std": 0.25, "reward/acc": 0.75, "reward/fmt": 1.0, "accuracy/acc": 0.5,
     "loss": None, "grad_norm": None, "entropy": 1.25, "length/mean": 12.0, "length/max": 20.0,
     "samples_per_s": 20.0, "time/generate": 1.5, "time/learn": 0.5, "time/step": 2.25},
    {"step": 3, "reward/mean": 0.625, "reward/std": 0.5, "reward/acc": 0.5, "reward/fmt": 0.75, "accuracy/acc": 0.25,
     "loss": 0.0625, "grad_norm": 1.75, "entropy": 1.0, "length/mean": 11.0, "length/max": 18.0,
     "samples_per_s": 1234.5, "time/generate": 1.25, "time/score": 0.5, "time/learn": 0.75, "time/step": 2.5},
    {"step": 3, "eval/reward/mean": 0.75, "eval/reward/acc": 1.0},
]


def sample(step: int, reward: float | None, completion: str, prompt: Any = "2+2=", **extra: Any) -> dict[str, Any]:
    return {"step": step, "prompt_id": f"p{step}", "prompt": prompt, "completion": completion, "reward": reward,
            "rewards": {"acc": reward}, "reward_error": None, "dropped": False, "finish_reason": "stop",
            "length": 3, "policy_version": step - 1, **extra}


SAMPLES = [
    sample(1, 1.0, "from step one"),
    sample(2, 0.0, "worst answer"),
    sample(2, 1.0, "<b>best</b> & \x1b", prompt=[{"role": "system", "content": "be brief"},
                                                 {"role": "user", "content": "2+2="}]),
    sample(2, 0.5, "middle answer"),
    sample(2, None, "broken", reward_error="ZeroDivisionError: division by zero"),
    sample(2, 0.25, "low answer"),
]

CHARTS = ["reward.png", "grad_norm.png", "entropy.png", "length.png", "throughput.png", "time.png"]


def jsonl(rows: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(CONFIG)
    # the run is still writing: the last line of each file is cut short, mid-character
    (run / "metrics.jsonl").write_bytes(jsonl(METRICS).encode() + b'{"step": 4, "reward/mean": 0.')
    (run / "samples.jsonl").write_bytes(jsonl(SAMPLES).encode() + b'{"step": 4, "completion": "\xc3')
    return run


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def test_report_has_the_charts_of_the_logged_metrics(run_dir):
    out = run_dir / "report"
    out.mkdir()
    (out / "kl.png").write_bytes(b"from an earlier report")
    (out / "notes.txt").write_text("mine")

    index = write_report(run_dir)

    assert index == run_dir / "report" / "index.html"
    assert sorted(p.name for p in out.iterdir()) == sorted(CHARTS + ["index.html", "notes.txt"])
    for name in CHARTS:
        assert png_size(out / name) == (720, 360), name
        assert (out / name).stat().st_size > 5000, name
    page = index.read_text()
    assert [part.split('"')[0] for part in page.split('<img src="')[1:]] == CHARTS
    assert '<img src="reward.png" alt="Reward">' in page


def test_page_shows_summary_evaluation_samples_and_config(run_dir, tmp_path):
    page = write_report(run_dir, tmp_path / "elsewhere").read_text()

    assert "<title>demo&lt;&amp;&gt; – rltune report</title>" in page
    assert "<h1>demo&lt;&amp;&gt;</h1>" in page
    assert "Training steps 1–3 (3 logged) of 4 planned; evaluated at steps 0, 3." in page
    assert "The last line of metrics.jsonl was incomplete" in page
    assert "The last line of samples.jsonl was incomplete" in page

    def row(metric: str, first: str, last: str, best: str) -> str:
        return (f"<tr><th>{metric}</th><td>{first}</td><td>{last}</td><td>{best}</td></tr>"
                .replace("@", ' <span class="step">(step ').replace("#", ")</span>"))

    assert row("reward/mean", "0.5@1#", "0.625@3#", "0.875@2#") in page
    assert row("reward/acc", "0.25@1#", "0.5@3#", "0.75@2#") in page
    assert row("reward/fmt", "0.75@1#", "0.75@3#", "1@2#") in page
    assert row("accuracy/acc", "0@1#", "0.25@3#", "0.5@2#") in page
    assert page.index("<th>reward/fmt</th>") < page.index("<th>accuracy/acc</th>") < page.index("<th>reward/std</th>")
    assert row("loss", "0.125@1#", "0.0625@3#", "–") in page
    assert row("grad_norm", "2.5@1#", "1.75@3#", "–") in page
    assert row("samples_per_s", "12.5@1#", "1,234.5@3#", "1,234.5@3#") in page
    assert row("time/step", "2@1#", "2.5@3#", "2@1#") in page
    assert "<th>reward/errors</th>" not in page and "<th>kl</th>" not in page
    assert "<tr><th>eval/reward/acc</th><td>1</td><td>3</td></tr>" in page
    assert "<tr><th>eval/reward/mean</th><td>0.75</td><td>3</td></tr>" in page

    assert "<h2>Sample rollouts at step 2</h2>" in page
    assert "1 rollout of this step had no reward (a reward function failed) and is not ranked." in page
    best, worst = page.split("<h3>Best</h3>")[1].split("<h3>Worst</h3>")
    assert [c.split("</pre>")[0] for c in best.split('completion</div><pre>')[1:]] == [
        "&lt;b&gt;best&lt;/b&gt; &amp; \\x1b", "middle answer", "low answer"]
    assert worst.split('completion</div><pre>')[1].split("</pre>")[0] == "worst answer"
    assert "<pre>system: be brief\nuser: 2+2=</pre>" in best
    assert "reward 1 · acc 1 · length 3 · finish reason stop · prompt id p2" in best
    assert "from step one" not in page and "broken" not in page

    assert '<pre class="config">name: demo&lt;&amp;&gt;\nalgo:\n  name: grpo\ntrain:\n  steps: 4\n</pre>' in page
    assert "://" not in page and "<script" not in page and "<link" not in page


def test_charts_of_absent_metrics_are_not_drawn(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(jsonl([{"step": 1, "kl": 0.5, "approx_kl": None, "tokens_per_s": 100.0},
                                              {"step": 2, "kl": 0.25, "tokens_per_s": 150.0}]))
    page = write_report(run).read_text()
    assert sorted(p.name for p in (run / "report").iterdir()) == ["index.html", "kl.png", "throughput.png"]
    assert "<h1>run</h1>" in page  # no config: the directory's name
    assert "There is no config.yaml in the run directory." in page
    assert "Sample rollouts" not in page and "Final evaluation" not in page


def test_an_empty_run_still_has_a_page(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    page = write_report(tmp_path).read_text()
    assert "No training step logged yet." in page
    assert "No training metrics have been logged yet." in page
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == ["index.html"]


@pytest.mark.parametrize(
    ("file", "content", "message"),
    [
        ("metrics.jsonl", b'{"step": 1}\n{"step": 2, "loss": 0.\n{"step": 3}\n',
         r"metrics.jsonl:2: not a JSON line"),
        ("metrics.jsonl", b'\n[1, 2]\n{"step": 3}\n', r"metrics.jsonl:2: expected a JSON object, got list"),
        ("metrics.jsonl", b'{"loss": 1.0}\n', r"metrics.jsonl:1: 'step' must be an integer, got None"),
        ("metrics.jsonl", b'{"step": "3"}\n', r"metrics.jsonl:1: 'step' must be an integer, got '3'"),
        ("samples.jsonl", b'{"step": 1}\n\xff\n{"step": 1}\n', r"samples.jsonl:2: not a JSON line"),
        ("config.yaml", b"name: [unclosed\n",
         r"config.yaml:2: not valid YAML \(expected ',' or '\]', but got '<stream end>'\)"),
        ("config.yaml", b"- a\n- b\n", r"config.yaml: expected a mapping of config sections, got list"),
    ],
)
def test_bad_files_are_named_with_the_line(tmp_path, file, content, message):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (tmp_path / file).write_bytes(content)
    with pytest.raises(ReportError, match=message) as info:
        write_report(tmp_path)
    assert str(tmp_path / file) in str(info.value)


def test_missing_run_or_metrics_is_named(tmp_path):
    with pytest.raises(ReportError, match=r"run directory .*nowhere does not exist"):
        write_report(tmp_path / "nowhere")
    with pytest.raises(ReportError, match=r"metrics.jsonl does not exist"):
        write_report(tmp_path)
    assert issubclass(ReportError, ValueError)


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` by relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    ("files", "named"),
    [
        ({"index.html": b"<p>my own page</p>", "notes.txt": b"mine"}, "index.html"),
        ({"reward.png": b"my chart"}, "reward.png"),  # would be overwritten
        ({"kl.png": b"my chart"}, "kl.png"),  # would be removed: the run logged no kl
        ({"index.html": b"<p>mine</p>", "kl.png": b"my chart", "time.png": b"mine too"},
         "index.html, kl.png, time.png"),
    ],
)
def test_an_out_dir_holding_files_the_report_did_not_write_is_refused(run_dir, tmp_path, files, named):
    out = tmp_path / "mine"
    out.mkdir()
    for name, data in files.items():
        (out / name).write_bytes(data)
    with pytest.raises(ReportError) as info:
        write_report(run_dir, out)
    assert str(info.value) == (
        f"report directory {out} already holds {named}, which the report would overwrite or remove and no "
        "earlier rltune report wrote; choose a new or empty directory, or move those files aside")
    assert tree(out) == files  # nothing written, nothing removed


def test_an_out_dir_with_other_files_or_an_earlier_report_is_written(run_dir, tmp_path):
    out = tmp_path / "shared"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    index = write_report(run_dir, out)
    page = index.read_bytes()
    assert is_report_page(index) and GENERATOR in page.decode()
    assert sorted(p.name for p in out.iterdir()) == sorted(CHARTS + ["index.html", "notes.txt"])

    (out / "kl.png").write_bytes(b"as a report of a run that logged kl left it")
    assert write_report(run_dir, out) == index  # the earlier report is replaced
    assert index.read_bytes() == page
    assert not (out / "kl.png").exists()
    assert (out / "notes.txt").read_text() == "mine"
    assert not is_report_page(out / "notes.txt") and not is_report_page(out / "nothing.html")
    # a report written before the tag: known by its title
    index.write_text(page.decode().replace(GENERATOR, ""))
    assert is_report_page(index) and write_report(run_dir, out) == index


def test_the_default_folder_is_the_reports_own(run_dir):
    # a report written before index.html carried GENERATOR, or a page put there by hand:
    # RUN_DIR/report is where `rltune report RUN_DIR` writes, named or not
    out = run_dir / "report"
    out.mkdir()
    (out / "index.html").write_text("<p>an older report</p>")
    assert is_report_page(write_report(run_dir))
    (out / "index.html").write_text("<p>an older report</p>")
    assert is_report_page(write_report(run_dir, run_dir / ".." / run_dir.name / "report"))


@pytest.mark.parametrize(
    ("values", "why"),
    [
        ([1e308], "its values reach 1e+308, more than a chart can show (at most 1e+300 either way)"),
        ([-1e308, 0.5], "its values reach 1e+308, more than a chart can show (at most 1e+300 either way)"),
        ([1.7976931348623157e308, None], "its values reach 1.798e+308, more than a chart can show "
                                         "(at most 1e+300 either way)"),
        ([0.5, 2e300], "its values reach 2e+300, more than a chart can show (at most 1e+300 either way)"),
    ],
)
def test_a_chart_with_values_too_large_to_draw_is_left_out_with_a_note(tmp_path, values, why):
    rows = [{"step": step, "reward/mean": value, "grad_norm": 2.0} for step, value in enumerate(values, start=1)]
    (tmp_path / "metrics.jsonl").write_text(jsonl(rows))
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "reward.png").write_bytes(b"from an earlier report")
    page = write_report(tmp_path).read_text()
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == ["grad_norm.png", "index.html"]
    assert f"<li>The Reward chart is left out: {why}.</li>" in page
    assert '<img src="grad_norm.png"' in page and "reward.png" not in page
    assert "<tr><th>reward/mean</th>" in page  # the summary still has the values


def test_a_chart_matplotlib_cannot_draw_is_left_out_with_a_note(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(jsonl([{"step": 1, "kl": 0.5}, {"step": 10**400, "kl": 0.25}]))
    page = write_report(tmp_path).read_text()
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == ["index.html"]
    assert ("<li>The KL chart is left out: matplotlib could not draw its values (OverflowError: int too large "
            "to convert to float).</li>") in page


def test_values_just_under_the_limit_are_drawn(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(jsonl([{"step": 1, "reward/mean": -1e300},
                                                   {"step": 2, "reward/mean": 1e300}]))
    page = write_report(tmp_path).read_text()
    assert png_size(tmp_path / "report" / "reward.png") == (720, 360)
    assert "left out" not in page


def test_pick_samples_ranks_the_last_step():
    rewards = [0.5, 0.0, 1.0, 0.25, 0.75, None, 0.125, 0.875]
    rows = [{"step": 5, "reward": r, "id": i} for i, r in enumerate(rewards)]
    rows.append({"step": 4, "reward": 2.0, "id": 99})
    step, best, worst, unscored = pick_samples(rows)
    assert (step, unscored) == (5, 1)
    assert [s["id"] for s in best] == [2, 7, 4]  # 1.0, 0.875, 0.75
    assert [s["id"] for s in worst] == [1, 6, 3]  # 0.0, 0.125, 0.25
    assert pick_samples([]) == (None, [], [], 0)


def test_fmt():
    assert [fmt(8.0), fmt(0.0538504421710968), fmt(12345.67), fmt(-9.313225746154785e-09), fmt(-0.25)] == [
        "8", "0.05385", "12,345.7", "-9.313e-09", "-0.25"]


def test_pyplot_is_never_imported(run_dir):
    code = ("import sys; from pathlib import Path; from rltune.metrics.report import write_report; "
            f"write_report(Path({str(run_dir)!r})); print('matplotlib.pyplot' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert (done.returncode, done.stdout) == (0, "False\n"), done.stderr
