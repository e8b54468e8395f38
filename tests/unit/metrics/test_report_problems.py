"""write_report on run directories with odd or broken files: each is a one-line
:class:`ReportError` naming the file (and line), or is shown in the page as what it is;
never a traceback, never a value dropped without a note. The dashboard's server and the
report read the same file the same way (which lines are rows, which steps)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib")

from rltune.metrics.dashboard.readers import JsonlLog
from rltune.metrics.report import MAX_ERROR, ReportError, fmt, write_report

BASE = [{"step": 0, "eval/reward/mean": 0.25},
        {"step": 1, "reward/mean": 0.5, "loss": 0.25, "grad_norm": 1.0},
        {"step": 2, "reward/mean": 0.75, "loss": 0.125, "grad_norm": 2.0}]


def jsonl(rows: list[Any]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def run(tmp_path: Path, metrics: list[Any] | str = BASE, samples: list[Any] | None = None,
        config: bytes | None = b"name: demo\n") -> Path:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text(metrics if isinstance(metrics, str) else jsonl(metrics))
    if samples is not None:
        (folder / "samples.jsonl").write_text(jsonl(samples))
    if config is not None:
        (folder / "config.yaml").write_bytes(config)
    return folder


def sample(reward: Any, completion: str = "answer", **extra: Any) -> dict[str, Any]:
    return {"step": 2, "prompt_id": "p", "prompt": "1+1=", "completion": completion, "reward": reward,
            "rewards": {"acc": reward if isinstance(reward, float) else None}, "reward_error": None,
            "finish_reason": "stop", "length": 2, **extra}


def test_a_config_that_is_not_utf8_is_named_with_line_and_byte(tmp_path: Path) -> None:
    folder = run(tmp_path, config=b"algo: grpo\nname: \xff\xfe\n")
    with pytest.raises(ReportError) as info:
        write_report(folder)
    assert str(info.value) == f"{folder / 'config.yaml'}:2: not UTF-8 (byte 0xff at offset 17)"


@pytest.mark.parametrize("name", ["metrics.jsonl", "samples.jsonl", "config.yaml"])
def test_a_run_file_that_is_a_directory_is_named_as_such(tmp_path: Path, name: str) -> None:
    folder = run(tmp_path, samples=[sample(1.0)])
    (folder / name).unlink()
    (folder / name).mkdir()
    with pytest.raises(ReportError) as info:
        write_report(folder)
    assert str(info.value) == f"{folder / name}: is a directory, not a regular file"


def test_a_fifo_is_refused_without_waiting(tmp_path: Path) -> None:
    folder = run(tmp_path)
    (folder / "metrics.jsonl").unlink()
    os.mkfifo(folder / "metrics.jsonl")
    with pytest.raises(ReportError, match=r"metrics.jsonl: is a FIFO \(named pipe\), not a regular file$"):
        write_report(folder)


@pytest.mark.parametrize("name", ["metrics.jsonl", "config.yaml"])
def test_a_file_without_read_permission_is_named(tmp_path: Path, monkeypatch, name: str) -> None:
    folder = run(tmp_path)
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, flags, *rest: (
        (_ for _ in ()).throw(PermissionError(13, "Permission denied")) if os.fspath(path).endswith(name)
        else real_open(path, flags, *rest)))
    with pytest.raises(ReportError) as info:
        write_report(folder)
    assert str(info.value) == f"{folder / name}: cannot be read (Permission denied)"


def test_a_complete_last_line_that_is_corrupt_is_an_error_not_a_cut_short_line(tmp_path: Path) -> None:
    folder = run(tmp_path, jsonl(BASE) + '{"step": 3, "loss": 0.\n')
    with pytest.raises(ReportError, match=r"metrics.jsonl:4: not a JSON line"):
        write_report(folder)
    (folder / "metrics.jsonl").write_text(jsonl(BASE) + '{"step": 3, "loss": 0.')  # still being written
    page = write_report(folder).read_text()
    assert "The last line of metrics.jsonl was incomplete (no newline yet: the run is still writing it)" in page


def test_values_that_are_not_finite_numbers_are_shown_and_noted(tmp_path: Path) -> None:
    rows = [*BASE[:2], {"step": 2, "reward/mean": float("nan"), "loss": float("-inf"), "grad_norm": float("inf"),
                        "tokens": 10**400, "entropy": None, "kl": "0.5"}]
    folder = run(tmp_path, jsonl(rows))
    page = write_report(folder).read_text()

    def last(metric: str) -> str:
        return re.search(rf"<tr><th>{re.escape(metric)}</th><td>.*?</td><td>(.*?) <span", page).group(1)

    assert (last("reward/mean"), last("loss"), last("grad_norm")) == ("nan", "-inf", "inf")
    assert last("entropy") == "null (not finite)" and last("kl") == "&#x27;0.5&#x27; (text)"
    for note in ("reward/mean is not a finite number at step 2 (nan)", "loss is not a finite number at step 2 (-inf)",
                 "grad_norm is not a finite number at step 2 (inf)",
                 "tokens is not a finite number at step 2 (too large for a float)"):
        assert f"<li>{note}; the charts leave those points out.</li>" in page, note
    assert "0.5 <span class=\"step\">(step 1)</span></td></tr>" in page  # best: the finite values only


def test_rewards_that_are_not_finite_numbers_say_so(tmp_path: Path) -> None:
    samples = [sample(1.0, "good"), sample(0.0, "bad"), sample(float("inf")), sample(True), sample("0.9"),
               sample(10**400), sample(None, reward_error="ValueError: x")]
    folder = run(tmp_path, samples=samples)
    page = write_report(folder).read_text()
    for reason in ("had a reward that is not finite (inf)", "had a reward that is not a number (true)",
                   "had a reward that is not a number (&#x27;0.9&#x27; (text))",
                   "had a reward that is not finite (too large for a float)",
                   "had no reward (a reward function failed)"):
        assert f"<p>1 rollout of this step {reason} and is not ranked.</p>" in page, reason


def test_multi_turn_rollouts_show_their_turns_as_blocks(tmp_path: Path) -> None:
    turns = [{"role": "assistant", "content": "call calc(2+2)", "tokens": 5, "trained": True},
             {"role": "tool", "content": "4", "tokens": 1, "trained": False}, None]
    folder = run(tmp_path, samples=[sample(1.0, "4", turns=turns)])
    page = write_report(folder).read_text()
    facts = re.search(r'class="facts">([^<]*)', page).group(1)
    assert facts.endswith("· turns 3") and "{" not in facts
    assert '<div class="label">turn 1 · assistant · 5 tokens</div><pre>call calc(2+2)</pre>' in page
    assert '<div class="label">turn 2 · tool · masked (not trained on) · 1 tokens</div><pre>4</pre>' in page
    assert '<div class="label">turn 3: not a turn (None)</div>' in page


def test_long_errors_and_facts_are_cut_and_hidden_characters_shown(tmp_path: Path) -> None:
    error = "E" * (MAX_ERROR + 500)
    rows = [sample(1.0, "ab\u202edc\x07", reward_error=error, finish_reason="st\x07op\u202e", prompt_id="p" * 500)]
    folder = run(tmp_path, samples=rows)
    before = (folder / "samples.jsonl").read_bytes()
    page = write_report(folder).read_text()
    assert f"reward error: {'E' * MAX_ERROR}\n… (500 more characters)</p>" in page
    assert "finish reason st\\x07op\\u202e" in page and "ab\\u202edc\\x07" in page
    assert "\u202e" not in page and "\x07" not in page
    assert f"prompt id {'p' * 200}… (300 more characters)" in page
    assert (folder / "samples.jsonl").read_bytes() == before


def test_fmt_bounds_huge_and_names_non_finite_values() -> None:
    assert [fmt(1e308), fmt(-2.5e20), fmt(123456789012.5), fmt(float("nan")), fmt(float("inf")),
            fmt(float("-inf"))] == ["1e+308", "-2.5e+20", "123,456,789,012.5", "nan", "inf", "-inf"]


@pytest.mark.parametrize(("extra", "bad"), [
    (b'{"step": 5.0, "loss": 2}\n', False),  # a whole float is a step
    (b'\xef\xbb\xbf', False),  # a byte-order mark before the first line
    (b'{"step": "4", "loss": 1}\n', True),
    (b'{"step": true, "loss": 1}\n', True),
    (b'{"loss": 1}\n', True),
    (b'[1, 2]\n', True),
])
def test_the_dashboard_and_the_report_read_a_file_alike(tmp_path: Path, extra: bytes, bad: bool) -> None:
    """The rows the dashboard serves are the rows the report reads, at the same steps; a
    line the dashboard skips is one the report refuses, naming the same line."""
    folder = run(tmp_path)
    path = folder / "metrics.jsonl"
    path.write_bytes(extra + path.read_bytes() if extra.startswith(b"\xef") else path.read_bytes() + extra)
    served = JsonlLog(path, steps=True).read(None, limit=100)
    try:
        page = write_report(folder).read_text()
    except ReportError as err:
        assert bad and served.bad_lines == 1
        assert str(err).startswith(f"{path}:{served.first_bad.split(':')[0].removeprefix('line ')}: ")
        assert str(err).endswith(served.first_bad.split(": ", 1)[1])
        return
    assert not bad and served.bad_lines == 0
    steps = sorted({row["step"] for row in served.rows if "loss" in row})
    assert f"Training steps {steps[0]}–{steps[-1]} ({len(steps)} logged)" in page
    assert "evaluated at step 0" in page
