"""Text with a lone surrogate (decoded with ``surrogateescape``, or an error message
holding one) in a run's JSON-lines files: written as its JSON escape, read back as the
same string by every reader (resume, report, dashboard), ordinary non-ASCII text left
readable, and never a partial line."""

from __future__ import annotations

import http.client
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from rltune.metrics.dashboard import make_server
from rltune.metrics.dashboard.readers import JsonlTail
from rltune.metrics.jsonl import JsonlReader
from rltune.metrics.sinks import JsonlWriter, truncate_after_step

SURROGATE_TEXT = [
    "bad \ud800 value",
    "lone low \udfff",
    b"caf\xe9 \xff".decode("utf-8", errors="surrogateescape"),
    "\ud800",
    "mixed \udc80 caf\u00e9 \u2028 \U0001f600 \\ud800",
]


def sample(step: int, **fields: Any) -> dict[str, Any]:
    return {"step": step, "prompt_id": f"p{step}", "prompt": "2+2=", "completion": "4", "reward": None,
            "rewards": {"acc": None}, "reward_error": None, "dropped": False, "finish_reason": "stop",
            "length": 1, "policy_version": 0, **fields}


@pytest.mark.parametrize("text", SURROGATE_TEXT)
def test_a_lone_surrogate_is_written_as_its_escape_and_reads_back_the_same(tmp_path: Path, text: str) -> None:
    writer = JsonlWriter(tmp_path / "samples.jsonl")
    record = sample(1, completion=text, prompt=[{"role": "user", "content": text}],
                    reward_error=f"acc: ValueError: {text}", meta={text: text})
    writer.write(record)
    writer.close()
    raw = (tmp_path / "samples.jsonl").read_bytes()
    raw.decode("utf-8")  # valid UTF-8 throughout
    assert raw.endswith(b"\n") and raw.count(b"\n") == 1
    assert json.loads(raw) == record
    assert [row for _, row in JsonlReader(tmp_path / "samples.jsonl")] == [record]


def test_ordinary_non_ascii_text_stays_readable_utf8(tmp_path: Path) -> None:
    writer = JsonlWriter(tmp_path / "samples.jsonl")
    writer.write(sample(1, completion="caf\u00e9 \u4e2d \U0001f600", reward_error="\ud800"))
    writer.close()
    raw = (tmp_path / "samples.jsonl").read_bytes()
    assert "caf\u00e9 \u4e2d \U0001f600".encode() in raw
    assert b'"reward_error": "\\ud800"' in raw


def test_json_line_escapes_only_what_utf8_cannot_hold() -> None:
    from rltune.metrics.jsonl import json_line

    assert json_line({"a": "\u00e9", "b": "\udc80", "c": "\\"}) == b'{"a": "\xc3\xa9", "b": "\\udc80", "c": "\\\\"}\n'


def test_a_record_that_cannot_be_written_leaves_no_partial_line(tmp_path: Path) -> None:
    writer = JsonlWriter(tmp_path / "metrics.jsonl")
    writer.write({"step": 1, "loss": 0.5})
    with pytest.raises(TypeError):
        writer.write({"step": 2, "loss": 0.25, "bad": object()})
    writer.write({"step": 2, "loss": 0.25, "note": "\ud800"})
    writer.close()
    assert (tmp_path / "metrics.jsonl").read_bytes() == (
        b'{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.25, "note": "\\ud800"}\n')


def test_a_resume_keeps_escaped_lines_and_writes_after_them(tmp_path: Path) -> None:
    path = tmp_path / "samples.jsonl"
    writer = JsonlWriter(path)
    for step in (1, 2, 3):
        writer.write(sample(step, reward_error=f"step {step} \ud800"))
    writer.close()
    assert truncate_after_step(path, 2, check_only=True) is None
    resumed = JsonlWriter(path, resume_after_step=2)
    assert resumed.resume_note is None
    resumed.write(sample(3, completion="again \udcff"))
    resumed.close()
    rows = [row for _, row in JsonlReader(path)]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert rows[1]["reward_error"] == "step 2 \ud800"
    assert rows[2]["completion"] == "again \udcff"


def test_the_dashboard_serves_escaped_rows_as_json(tmp_path: Path) -> None:
    run = tmp_path / "a"
    run.mkdir()
    (run / "config.yaml").write_text("name: a\n")
    writer = JsonlWriter(run / "metrics.jsonl")
    writer.write({"step": 1, "reward/mean": 0.5})
    writer.close()
    writer = JsonlWriter(run / "samples.jsonl")
    writer.write(sample(1, completion="caf\u00e9 \udc80", reward_error="acc: ValueError: bad \ud800"))
    writer.close()
    assert JsonlTail(run / "samples.jsonl", max_rows=5).read(None, limit=10).rows[0]["completion"] == "caf\u00e9 \udc80"
    server = make_server([run], port=0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        connection.request("GET", "/api/samples?run=a")
        response = connection.getresponse()
        body = response.read()
        connection.close()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    assert response.status == 200
    row = json.loads(body.decode("utf-8"))["rows"][0]
    assert row["completion"] == "caf\u00e9 \udc80"
    assert row["reward_error"] == "acc: ValueError: bad \ud800"


def test_the_report_shows_a_lone_surrogate_as_its_escape(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from rltune.metrics.report import write_report

    run = tmp_path / "run"
    writer = JsonlWriter(run / "metrics.jsonl")
    writer.write({"step": 1, "reward/mean": 0.5, "reward/std": 0.0, "loss": 0.1})
    writer.close()
    writer = JsonlWriter(run / "samples.jsonl")
    writer.write(sample(1, reward=1.0, completion="best \udc80 caf\u00e9"))
    writer.write(sample(1, reward=0.0, completion="worst", reward_error="acc: ValueError: bad \ud800"))
    writer.close()
    page = write_report(run).read_text(encoding="utf-8")
    assert "best \\udc80 caf\u00e9" in page
