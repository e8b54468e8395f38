"""The dashboard's server on run directories with broken files: one run's problem is that
run's own. A file that is a directory, a FIFO or unreadable, a link out of the run
directory, a watched folder replaced by a file, a name that is not UTF-8, bad lines, bad
cursors: each is named in that run's listing or answered with a clear error, the other
runs are served, and nothing hangs or answers 500."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
from test_dashboard_server import ROW1, ROW2, fetch, line, sample, write_run

from rltune.metrics.dashboard.readers import JsonlTail, last_step


def runs_by_id(port: int) -> dict[str, dict]:
    reply = fetch(port, "/api/runs")
    assert reply.status == 200, reply.body
    return {run["id"]: run for run in reply.json()["runs"]}


def deny(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Opening a file called ``name`` fails as it does without read permission (the
    tests may run as root, who is never refused)."""
    real_open = os.open

    def refusing(path, flags, *args, **kwargs):
        if os.fspath(path).endswith(os.sep + name):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)


def make_directory(path: Path) -> None:
    path.mkdir()


def make_fifo(path: Path) -> None:
    os.mkfifo(path)


@pytest.mark.parametrize(("make", "why"), [
    (make_directory, "is a directory, not a regular file"),
    (make_fifo, "is a FIFO (named pipe), not a regular file"),
    ("deny", "cannot be read (Permission denied)"),
])
def test_a_run_whose_metrics_cannot_be_read_is_listed_with_its_error(tmp_path: Path, start, monkeypatch,
                                                                      make, why: str) -> None:
    runs = tmp_path / "runs"
    write_run(runs / "good", [ROW1, ROW2], [sample(1, "ok")])
    bad = write_run(runs / "bad")
    if make == "deny":
        (bad / "metrics.jsonl").write_text(line(ROW1))
        deny(monkeypatch, str(Path("bad") / "metrics.jsonl"))
    else:
        make(bad / "metrics.jsonl")
    server = start([runs])

    listed = runs_by_id(server.port)
    assert listed["bad"]["errors"] == [f"metrics.jsonl: {why}"]
    assert (listed["bad"]["last_step"], listed["bad"]["files"]["metrics"]) == (None, False)
    assert (listed["good"]["errors"], listed["good"]["last_step"]) == ([], 2)
    answer = fetch(server.port, "/api/metrics?run=bad")  # no wait on a FIFO: the fetch times out at 10 s
    assert (answer.status, answer.json()) == (409, {"error": f"metrics.jsonl: {why}"})
    assert fetch(server.port, "/api/metrics?run=good").json()["rows"] == [ROW1, ROW2]


def test_samples_or_config_that_is_a_directory_is_that_runs_error(tmp_path: Path, start) -> None:
    run = write_run(tmp_path / "a", [ROW1], config=None)
    (run / "samples.jsonl").mkdir()
    (run / "config.yaml").mkdir()
    server = start([run])
    listed = runs_by_id(server.port)["a"]
    assert listed["errors"] == ["samples.jsonl: is a directory, not a regular file",
                                "config.yaml: is a directory, not a regular file"]
    assert listed["files"] == {"metrics": True, "samples": False, "config": False}
    for api, name in (("samples", "samples.jsonl"), ("config", "config.yaml")):
        answer = fetch(server.port, f"/api/{api}?run=a")
        assert (answer.status, answer.json()) == (409, {"error": f"{name}: is a directory, not a regular file"})


def test_a_watched_folder_replaced_by_a_file_is_named_and_the_others_are_served(tmp_path: Path, start) -> None:
    moving, other = tmp_path / "moving", tmp_path / "other"
    write_run(moving / "r1", [ROW1])
    write_run(other / "r2", [ROW2])
    server = start([moving, other])
    moving.rename(tmp_path / "moved")
    moving.write_text("x")

    body = fetch(server.port, "/api/runs").json()
    assert body["roots"] == [{"path": str(moving), "runs": 0, "error": f"{moving} is not a directory any more"},
                             {"path": str(other), "runs": 1, "error": None}]
    assert [run["id"] for run in body["runs"]] == ["r2"]  # r1 is gone: no longer listed


def test_a_run_reached_through_a_link_counts_in_both_folders(tmp_path: Path, start) -> None:
    write_run(tmp_path / "runs" / "a", [ROW1])
    write_run(tmp_path / "runs" / "b", [ROW1])
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "a").symlink_to(tmp_path / "runs" / "a")
    server = start([tmp_path / "more", tmp_path / "runs"])
    body = fetch(server.port, "/api/runs").json()
    assert [(root["path"], root["runs"]) for root in body["roots"]] == [(str(tmp_path / "more"), 1),
                                                                       (str(tmp_path / "runs"), 2)]
    assert sorted(run["id"] for run in body["runs"]) == ["a", "b"]


def test_a_run_directory_whose_name_is_not_utf8_is_served(tmp_path: Path, start) -> None:
    runs = tmp_path / "runs"
    write_run(Path(os.fsdecode(os.fsencode(runs) + b"/odd\xffname")), [ROW1], [sample(1, "s1")])
    server = start([runs])
    listed = runs_by_id(server.port)
    assert list(listed) == ["odd\\xffname"]
    assert listed["odd\\xffname"]["name"] == "odd\\xffname"
    assert fetch(server.port, "/api/metrics?run=odd%5Cxffname").json()["rows"] == [ROW1]
    assert fetch(server.port, "/api/samples?run=odd%5Cxffname").json()["rows"][0]["completion"] == "s1"


def test_links_that_lead_out_of_the_run_directory_are_not_followed(tmp_path: Path, start) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0\n")
    run = tmp_path / "runs" / "links"
    run.mkdir(parents=True)
    for name in ("config.yaml", "metrics.jsonl", "samples.jsonl"):
        (run / name).symlink_to(secret)
    inside = write_run(tmp_path / "runs" / "inside", None, config=None)
    (inside / "real.yaml").write_text("name: inside\n")
    (inside / "config.yaml").symlink_to(inside / "real.yaml")  # a link within the run is fine
    server = start([tmp_path / "runs"])

    listed = runs_by_id(server.port)
    why = "is a link to a file outside the run directory; not read"
    assert listed["links"]["errors"] == [f"{name}: {why}" for name in ("metrics.jsonl", "samples.jsonl", "config.yaml")]
    for api, name in (("config", "config.yaml"), ("metrics", "metrics.jsonl"), ("samples", "samples.jsonl")):
        answer = fetch(server.port, f"/api/{api}?run=links")
        assert (answer.status, answer.json()) == (403, {"error": f"{name}: {why}"})
        assert b"root:x" not in answer.body
    assert fetch(server.port, "/api/config?run=inside").json()["text"] == "name: inside\n"


@pytest.mark.parametrize("cursor", ["x:%C2%B2", "x:%D9%A1", "x:" + "1" * 5000, "x:" + "9" * 21])
def test_a_cursor_of_other_digits_or_too_long_is_a_bad_request(tmp_path: Path, start, cursor: str) -> None:
    server = start([write_run(tmp_path / "a", [ROW1], [sample(1, "s")])])
    for api in ("metrics", "samples"):
        answer = fetch(server.port, f"/api/{api}?run=a&cursor={cursor}")
        assert answer.status == 400, answer.body
        assert "is not EPOCH:POSITION (POSITION: at most 20 digits 0-9)" in answer.json()["error"]


def test_lines_that_are_not_rows_are_counted_with_the_first_described(tmp_path: Path, start) -> None:
    run = write_run(tmp_path / "a", None)
    eval0 = {"step": 0, "eval/reward/mean": 0.5}
    (run / "metrics.jsonl").write_bytes(
        b"\xef\xbb\xbf" + line(eval0).encode() + b"not json\n" + line(ROW1).encode()
        + b'{"step": "4", "loss": 1}\n{"step": 5.0, "loss": 2}\n{"step": true}\n')
    (run / "samples.jsonl").write_text(line(sample(1, "a")) + '{"step": "2"}\n' + line(sample(3, "b")))
    server = start([run])

    answer = fetch(server.port, "/api/metrics?run=a").json()
    assert answer["rows"] == [eval0, ROW1, {"step": 5, "loss": 2}]  # the first line despite its byte-order mark
    assert answer["bad_lines"] == 3
    assert answer["first_bad"].startswith("line 2: not a JSON line (Expecting value at column 1")
    later = fetch(server.port, f"/api/metrics?run=a&cursor={answer['cursor'].split(':')[0]}:"
                               f"{len(line(eval0)) + 3 + len('not json') + 1 + len(line(ROW1))}").json()
    assert (later["bad_lines"], later["first_bad"]) == (2, "line 4: 'step' must be an integer, got '4'")
    samples = fetch(server.port, "/api/samples?run=a").json()
    assert [row["completion"] for row in samples["rows"]] == ["a", "b"]
    assert (samples["bad_lines"], samples["first_bad"]) == (1, "line 2: 'step' must be an integer, got '2'")


def test_the_samples_tail_tells_each_reader_of_a_bad_line_once(tmp_path: Path) -> None:
    path = tmp_path / "samples.jsonl"
    path.write_text(line(sample(1, "a")))
    tail = JsonlTail(path, max_rows=10, steps=True)
    first, second = tail.read(None, limit=10), tail.read(None, limit=10)
    with path.open("a") as handle:
        handle.write("garbage\n" + line(sample(2, "b")))
    for earlier in (first, second):  # both readers, each from its own cursor
        news = tail.read(earlier.cursor, limit=10)
        assert ([row["completion"] for row in news.rows], news.bad_lines, news.first_bad) == (
            ["b"], 1, "line 2: not a JSON line (Expecting value at column 1)")
        assert tail.read(news.cursor, limit=10).bad_lines == 0


def test_last_step_finds_a_last_line_longer_than_a_mebibyte(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(line(ROW1) + line({"step": 3, "junk": "B" * (3 << 20)}) + '{"step": 4, "lo')
    assert last_step(path) == 3
    path.write_text(line(ROW1) + json.dumps({"step": 3, "junk": "B" * 100}))  # no newline yet
    assert last_step(path) == 1


def test_last_step_refuses_a_fifo_without_waiting(tmp_path: Path) -> None:
    from rltune.metrics.jsonl import RunFileError

    os.mkfifo(tmp_path / "metrics.jsonl")
    with pytest.raises(RunFileError, match="is a FIFO"):
        last_step(tmp_path / "metrics.jsonl")


@pytest.mark.parametrize("token", ["abc+defghijklmnop0123", "abc&defghijklmnop0123", "abc#defghijklmnop0123",
                                   "abc%2Bdefghijklmnop0123"])
def test_a_token_with_url_characters_works_percent_encoded_and_as_a_header(tmp_path: Path, start, token: str) -> None:
    """A base64 token (``openssl rand -base64``) holds + and may hold others: the header
    carries it as it is, and the page's URL percent-encoded."""
    from urllib.parse import quote

    server = start([write_run(tmp_path / "a", [ROW1])], token=token)
    assert fetch(server.port, "/api/runs", headers={"Authorization": f"Bearer {token}"}).status == 200
    assert fetch(server.port, "/api/runs").status == 401
    assert fetch(server.port, "/?token=" + quote(token, safe="")).status == 303


def test_an_ipv6_address_may_be_given_in_brackets(tmp_path: Path, start) -> None:
    try:
        with socket.socket(socket.AF_INET6) as trial:
            trial.bind(("::1", 0))
    except OSError as err:
        pytest.skip(f"no IPv6 loopback here ({err})")
    server = start([write_run(tmp_path / "a", [ROW1])], host="[::1]")
    assert server.url == f"http://[::1]:{server.port}/" and server.loopback
