"""The dashboard's server without a browser: its JSON API on run directories written here
(exact rows), incremental reading (cursor, a line cut short, a rewritten file, the sample
cap, reading only what was appended), run discovery, the static files, and the security
rules (token, cookie, Host header, binding off loopback, path traversal).

Every server binds port 0 on this machine and is shut down after its test."""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rltune.metrics import keys
from rltune.metrics.dashboard import DashboardError, DashboardServer, make_server, serve
from rltune.metrics.dashboard.server import STATIC_DIR
from rltune.metrics.dashboard.readers import Chunk, JsonlLog, JsonlTail, last_step

TOKEN = "s3cret-token-0123456789"
CONFIG = "name: a\nalgo:\n  name: grpo\n"
ROW1 = {"step": 1, "reward/mean": 0.25, "reward/digit_share": 0.5, "loss": -0.1, "grad_norm": 1.5}
ROW2 = {"step": 2, "reward/mean": 0.5, "reward/digit_share": None, "loss": -0.2, "grad_norm": 1.25}
EVAL2 = {"step": 2, "eval/reward/mean": 0.75}
SAMPLE = {"step": 1, "prompt_id": "p:0", "prompt": "1+1=", "completion": "2", "reward": 1.0,
          "rewards": {"digit_share": 1.0}, "reward_error": None, "dropped": False,
          "finish_reason": "stop", "length": 1, "policy_version": 0}


def line(row: dict[str, Any]) -> str:
    return json.dumps(row) + "\n"


def write_run(path: Path, metrics: list[dict[str, Any]] | None = None,
              samples: list[dict[str, Any]] | None = None, config: str | None = CONFIG) -> Path:
    """A run directory as a training run leaves it."""
    path.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (path / "config.yaml").write_text(config)
    if metrics is not None:
        (path / "metrics.jsonl").write_text("".join(line(row) for row in metrics))
    if samples is not None:
        (path / "samples.jsonl").write_text("".join(line(row) for row in samples))
    return path


def append(path: Path, text: str) -> None:
    with path.open("a", encoding="utf-8") as handle:
        handle.write(text)


def sample(step: int, completion: str) -> dict[str, Any]:
    return {**SAMPLE, "step": step, "completion": completion}


@dataclass
class Reply:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def fetch(port: int, path: str, *, headers: dict[str, str] | None = None,
          address: str = "127.0.0.1") -> Reply:
    """One GET; redirects are not followed, the Host header is the address unless given."""
    connection = http.client.HTTPConnection(address, port, timeout=10)
    try:
        connection.request("GET", path, headers=headers or {})
        response = connection.getresponse()
        return Reply(response.status, response.headers, response.read())
    finally:
        connection.close()


# ---------------------------------------------------------------- API on a run directory


def test_runs_lists_each_run_with_last_step_last_write_and_files(tmp_path: Path, start) -> None:
    run = write_run(tmp_path / "runs" / "a", [ROW1, ROW2, EVAL2], [SAMPLE])
    old = write_run(tmp_path / "runs" / "b", None, None)
    os.utime(old / "config.yaml", (1_700_000_000, 1_700_000_000))
    server = start([tmp_path / "runs"])

    body = fetch(server.port, "/api/runs").json()

    newest = max((run / name).stat().st_mtime for name in ("metrics.jsonl", "samples.jsonl", "config.yaml"))
    assert body["roots"] == [{"path": str(tmp_path / "runs"), "runs": 2, "error": None}]
    assert body["live_window_s"] == 60.0 and body["sample_cap"] == 5000
    assert body["runs"] == [
        {"id": "a", "name": "a", "path": str(run), "last_step": 2, "last_write": newest, "live": True,
         "files": {"metrics": True, "samples": True, "config": True}, "errors": []},
        {"id": "b", "name": "b", "path": str(old), "last_step": None, "last_write": 1_700_000_000.0,
         "live": False, "files": {"metrics": False, "samples": False, "config": True}, "errors": []},
    ]


def test_metrics_are_the_rows_as_written_then_only_new_rows_after_the_cursor(tmp_path: Path, start) -> None:
    run = write_run(tmp_path / "a", [ROW1, ROW2, EVAL2])
    server = start([run])

    first = fetch(server.port, "/api/metrics?run=a").json()
    assert first["rows"] == [ROW1, ROW2, EVAL2]
    assert (first["reset"], first["more"], first["bad_lines"], first["run"]) == (False, False, 0, "a")
    size = (run / "metrics.jsonl").stat().st_size
    epoch, _ = first["cursor"].split(":")
    assert first["cursor"] == f"{epoch}:{size}"  # the byte offset after the rows read

    row3 = {"step": 3, "reward/mean": 0.625}
    append(run / "metrics.jsonl", line(row3) + '{"step": 4, "loss": NaN, "kl": Infinity}\n')
    second = fetch(server.port, f"/api/metrics?run=a&cursor={first['cursor']}").json()
    assert second["rows"] == [row3, {"step": 4, "loss": None, "kl": None}]
    assert second["reset"] is False
    assert second["cursor"] == f"{epoch}:{(run / 'metrics.jsonl').stat().st_size}"

    third = fetch(server.port, f"/api/metrics?run=a&cursor={second['cursor']}").json()
    assert (third["rows"], third["cursor"], third["reset"]) == ([], second["cursor"], False)


def test_a_line_cut_short_is_returned_once_it_is_complete(tmp_path: Path, start) -> None:
    run = write_run(tmp_path / "a", [ROW1])
    server = start([run])
    cursor = fetch(server.port, "/api/metrics?run=a").json()["cursor"]

    text = line(ROW2)
    append(run / "metrics.jsonl", text[:20])
    waiting = fetch(server.port, f"/api/metrics?run=a&cursor={cursor}").json()
    assert (waiting["rows"], waiting["cursor"], waiting["bad_lines"]) == ([], cursor, 0)

    append(run / "metrics.jsonl", text[20:])
    done = fetch(server.port, f"/api/metrics?run=a&cursor={cursor}").json()
    assert done["rows"] == [ROW2]
    assert done["bad_lines"] == 0


def test_a_file_rewritten_shorter_resets_the_cursor(tmp_path: Path, start) -> None:
    """A resumed run truncates metrics.jsonl to its checkpoint's step, then appends."""
    run = write_run(tmp_path / "a", [ROW1, ROW2, EVAL2])
    server = start([run])
    cursor = fetch(server.port, "/api/metrics?run=a").json()["cursor"]

    write_run(run, [ROW1])
    answer = fetch(server.port, f"/api/metrics?run=a&cursor={cursor}").json()
    assert answer["reset"] is True
    assert answer["rows"] == [ROW1]
    assert answer["cursor"].split(":")[0] != cursor.split(":")[0]

    resumed = {"step": 2, "reward/mean": 0.375}
    append(run / "metrics.jsonl", line(resumed))
    after = fetch(server.port, f"/api/metrics?run=a&cursor={answer['cursor']}").json()
    assert (after["reset"], after["rows"]) == (False, [resumed])


READERS = {
    "log": lambda path, **kwargs: JsonlLog(path, **kwargs),
    "tail": lambda path, **kwargs: JsonlTail(path, max_rows=100, **kwargs),
}


@pytest.mark.parametrize("reader", READERS)
def test_a_file_emptied_and_grown_past_the_old_offset_is_read_again(tmp_path: Path, reader: str) -> None:
    """A new run with the same name empties the file in place (same inode) and may have
    written more than before by the next poll; the bytes before the offset tell."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(line(ROW1))
    tail = READERS[reader](path)
    first = tail.read(None, limit=100)

    new_rows = [{"step": step, "reward/mean": step / 16} for step in range(1, 5)]
    with path.open("r+", encoding="utf-8") as handle:
        handle.truncate(0)
        handle.write("".join(line(row) for row in new_rows))
    assert path.stat().st_size > len(line(ROW1))  # the size alone does not tell
    again = tail.read(first.cursor, limit=100)
    assert again.reset is True
    assert again.rows == new_rows


@pytest.mark.parametrize("reader", READERS)
def test_the_reader_parses_only_bytes_appended_since_the_last_read(tmp_path: Path, reader: str) -> None:
    """Garbage written over the start of the file after it was read (in place, away from
    the bytes just before the offset) is never parsed: no bad line, no reset."""
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": step, "reward/mean": step / 8, "note": "x" * 40} for step in range(1, 5)]
    path.write_text("".join(line(row) for row in rows))
    tail = READERS[reader](path)
    first = tail.read(None, limit=100)
    assert first.rows == rows

    with path.open("r+b") as handle:
        handle.write(b"#" * 30)
    append(path, line(ROW2))
    second = tail.read(first.cursor, limit=100)
    assert (second.rows, second.reset, second.bad_lines) == ([ROW2], False, 0)


@pytest.mark.parametrize("reader", READERS)
def test_reads_stop_at_their_byte_budget_but_never_split_a_line(tmp_path: Path, reader: str) -> None:
    path = tmp_path / "samples.jsonl"
    rows = [sample(step, "abc") for step in range(1, 4)]
    long_row = sample(4, "z" * 500)
    path.write_text("".join(line(row) for row in [*rows, long_row]))
    size = len(line(rows[0]))
    tail = READERS[reader](path, read_bytes=2 * size + 5)

    first = tail.read(None, limit=100)
    assert (first.rows, first.more) == (rows[:2], True)
    second = tail.read(first.cursor, limit=100)
    assert (second.rows, second.more) == ([rows[2]], True)
    third = tail.read(second.cursor, limit=100)  # one line longer than the budget: read whole
    assert (third.rows, third.more) == ([long_row], False)
    assert tail.read(third.cursor, limit=100) == Chunk([], third.cursor, reset=False, more=False)

    limited_reader = READERS[reader](path)
    limited = limited_reader.read(None, limit=3)
    assert (limited.rows, limited.more) == (rows, True)
    rest = limited_reader.read(limited.cursor, limit=3)
    assert (rest.rows, rest.more) == ([long_row], False)


def test_lines_that_are_not_json_objects_are_skipped_and_counted(tmp_path: Path, start) -> None:
    run = write_run(tmp_path / "a", None)
    (run / "metrics.jsonl").write_text(line(ROW1) + "not json\n[1, 2]\n\n" + line(ROW2))
    server = start([run])
    answer = fetch(server.port, "/api/metrics?run=a").json()
    assert (answer["rows"], answer["bad_lines"]) == ([ROW1, ROW2], 2)
    again = fetch(server.port, f"/api/metrics?run=a&cursor={answer['cursor']}").json()
    assert (again["rows"], again["bad_lines"]) == ([], 0)


def test_samples_keep_only_the_newest_rows_and_skip_reading_older_ones(tmp_path: Path, start) -> None:
    run = write_run(tmp_path / "a", [ROW1])
    # a bad line among the older rows: never parsed, since the file is read from its tail
    (run / "samples.jsonl").write_text(
        line(sample(1, "one")) + "garbage\n" + "".join(line(sample(step, f"s{step}")) for step in range(2, 6)))
    server = start([run], max_samples=3)

    first = fetch(server.port, "/api/samples?run=a").json()
    assert [row["completion"] for row in first["rows"]] == ["s3", "s4", "s5"]
    assert first["rows"][0] == sample(3, "s3")
    assert first["bad_lines"] == 0

    append(run / "samples.jsonl", line(sample(6, "s6")) + line(sample(7, "s7")))
    second = fetch(server.port, f"/api/samples?run=a&cursor={first['cursor']}").json()
    assert [row["completion"] for row in second["rows"]] == ["s6", "s7"]
    fresh = fetch(server.port, "/api/samples?run=a").json()
    assert [row["completion"] for row in fresh["rows"]] == ["s5", "s6", "s7"]
    stale = fetch(server.port, f"/api/samples?run=a&cursor={first['cursor'].split(':')[0]}:1").json()
    assert [row["completion"] for row in stale["rows"]] == ["s5", "s6", "s7"]  # older ones are gone


def test_last_step_is_the_last_complete_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(line(ROW1) + line(EVAL2) + '{"step": 3, "loss"')
    assert last_step(path) == 2
    path.write_text(line(ROW1))
    assert last_step(path) == 1
    path.write_text('{"step": 1')
    assert last_step(path) is None
    # the last whole line is longer than one block read backwards
    path.write_text("".join(line({"step": step, "loss": 0.5}) for step in range(1, 3000))
                    + line({"step": 3000, "note": "x" * 100_000}) + '{"step": 3001')
    assert last_step(path) == 3000
    assert last_step(path, search_bytes=65536) is None  # the search is bounded
    assert last_step(tmp_path / "missing.jsonl") is None


def test_config_is_the_files_text_and_null_before_it_exists(tmp_path: Path, start) -> None:
    with_config = write_run(tmp_path / "runs" / "a", [ROW1])
    write_run(tmp_path / "runs" / "b", [ROW1], config=None)
    server = start([tmp_path / "runs"])
    assert fetch(server.port, "/api/config?run=a").json() == {
        "run": "a", "path": str(with_config / "config.yaml"), "text": CONFIG}
    assert fetch(server.port, "/api/config?run=b").json()["text"] is None


def test_the_page_gets_its_metric_names_from_the_server(tmp_path: Path, start) -> None:
    server = start([write_run(tmp_path / "a", [ROW1])])
    answer = fetch(server.port, "/api/keys").json()
    assert answer == json.loads(json.dumps(keys.for_dashboard()))
    assert answer["reward_mean"] == "reward/mean" and answer["eval_reward_mean"] == "eval/reward/mean"
    assert [key for key, _ in answer["time_phases"]] == [
        "time/generate", "time/score", "time/experience", "time/learn", "time/sync"]
    # the page names no metric key itself: every series key comes from the answer above
    script = "\n".join(p.read_text() for p in sorted(STATIC_DIR.glob("*.js")))
    names = {v for v in answer.values() if isinstance(v, str) and v != answer["sep"]}
    nested = {n for n in names if "/" in n} | {key for key, _ in answer["time_phases"]}
    nested.add(answer["reward"] + answer["sep"])
    assert not [n for n in nested if re.search(rf"[\"'`]{re.escape(n)}", script)]
    assert not [n for n in names if re.search(rf"key: [\"'`]{re.escape(n)}[\"'`]", script)]


def test_bad_requests_name_what_is_wrong(tmp_path: Path, start) -> None:
    server = start([write_run(tmp_path / "a", [ROW1])])
    unknown = fetch(server.port, "/api/metrics?run=nope")
    assert (unknown.status, unknown.json()) == (404, {"error": "no run 'nope' (known runs: a)"})
    missing = fetch(server.port, "/api/samples")
    assert (missing.status, missing.json()["error"]) == (400, "missing ?run=ID (ids are listed by /api/runs)")
    cursor = fetch(server.port, "/api/metrics?run=a&cursor=banana")
    assert cursor.status == 400 and "'banana'" in cursor.json()["error"]
    epoch = fetch(server.port, "/api/metrics?run=a").json()["cursor"].split(":")[0]
    mid_line = fetch(server.port, f"/api/metrics?run=a&cursor={epoch}:5")
    assert (mid_line.status, mid_line.json()["error"]) == (
        400, f"cursor offset 5 is not the start of a line of {tmp_path / 'a' / 'metrics.jsonl'}")
    past = fetch(server.port, f"/api/metrics?run=a&cursor={epoch}:100000")
    assert past.status == 400 and past.json()["error"].startswith(f"cursor '{epoch}:100000' is past the end of")
    assert fetch(server.port, "/api/nothing").status == 404


# ---------------------------------------------------------------- run discovery


def test_a_run_started_after_the_dashboard_appears(tmp_path: Path, start) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    server = start([runs])
    assert fetch(server.port, "/api/runs").json()["runs"] == []

    write_run(runs / "late", [ROW1])
    listed = fetch(server.port, "/api/runs").json()
    assert [run["id"] for run in listed["runs"]] == ["late"]
    assert listed["roots"] == [{"path": str(runs), "runs": 1, "error": None}]
    assert fetch(server.port, "/api/metrics?run=late").json()["rows"] == [ROW1]


def test_runs_with_the_same_name_get_distinct_ids(tmp_path: Path, start) -> None:
    first = write_run(tmp_path / "x" / "a", [ROW1])
    second = write_run(tmp_path / "y" / "a", [ROW2])
    (tmp_path / "x" / "notes").mkdir()  # not a run: no metrics.jsonl, no config.yaml
    server = start([tmp_path / "x", second, first])  # the first run, given twice
    runs = fetch(server.port, "/api/runs").json()["runs"]
    assert [(run["id"], run["path"]) for run in runs] == [("a", str(first)), ("y/a", str(second))]
    assert fetch(server.port, "/api/metrics?run=y/a").json()["rows"] == [ROW2]


@pytest.mark.parametrize("make, message", [
    (lambda root: root / "missing", "does not exist"),
    (lambda root: (root / "file.txt", (root / "file.txt").write_text("x"))[0], "is a file, not a directory"),
])
def test_a_path_that_is_not_a_directory_is_refused(tmp_path: Path, make, message: str) -> None:
    path = make(tmp_path)
    with pytest.raises(DashboardError, match=re.escape(f"{path} {message}")):
        make_server([path], port=0)


def test_no_path_at_all_is_refused() -> None:
    with pytest.raises(DashboardError, match="no run directory given"):
        make_server([], port=0)


# ---------------------------------------------------------------- page and static files


def test_the_page_and_its_files_are_served_with_a_self_only_policy(tmp_path: Path, start) -> None:
    server = start([write_run(tmp_path / "a", [ROW1])])
    page = fetch(server.port, "/")
    assert page.status == 200
    assert page.headers["Content-Type"] == "text/html; charset=utf-8"
    policy = page.headers["Content-Security-Policy"]
    assert "default-src 'none'" in policy and "script-src 'self'" in policy and "connect-src 'self'" in policy
    assert page.body == (STATIC_DIR / "index.html").read_bytes()
    script = fetch(server.port, "/static/app.js")
    assert (script.status, script.headers["Content-Type"]) == (200, "text/javascript; charset=utf-8")
    api = fetch(server.port, "/api/runs")
    assert api.headers["Cache-Control"] == "no-store"
    assert api.headers["Content-Type"] == "application/json; charset=utf-8"


@pytest.fixture
def static_folder(tmp_path: Path) -> Path:
    """A static folder with a page and a sub folder, next to files it must not give away:
    ``secret.css`` beside it and a link inside it that points there; a folder whose name
    looks like a served file."""
    folder = tmp_path / "site" / "static"
    (folder / "vendor").mkdir(parents=True)
    (folder / "index.html").write_text("<p>page</p>")
    (folder / "vendor" / "lib.js").write_text("var lib;")
    (folder / "vendor" / "notes.md").write_text("notes")
    (folder / ".hidden.css").write_text("hidden")
    (folder / "folder.css").mkdir()
    (tmp_path / "site" / "secret.css").write_text("secret")
    (folder / "link.css").symlink_to(tmp_path / "site" / "secret.css")
    return folder


@pytest.mark.parametrize("path", [
    "/static/../secret.css", "/static/%2e%2e/secret.css", "/static/..%2fsecret.css", "/static/%2E%2E%2Fsecret.css",
    "/static/vendor/../../secret.css", "/static/vendor/%2e%2e/%2e%2e/secret.css", "/static/./vendor/lib.js",
    "/static//secret.css", "/static/%2fetc%2fpasswd", "/static/..\\secret.css", "/static/link.css",
    "/static/vendor", "/static/vendor/", "/static/", "/static/folder.css", "/static/vendor/notes.md", "/static/.hidden.css",
    "/static/index.html%00.css", "/../secret.css", "//etc/passwd", "/secret.css",
])
def test_no_path_leaves_the_static_folder_and_no_folder_is_listed(
        tmp_path: Path, start, static_folder: Path, path: str) -> None:
    server = start([write_run(tmp_path / "a", [ROW1])])
    server.static_dir = static_folder
    assert fetch(server.port, "/static/vendor/lib.js").body == b"var lib;"
    reply = fetch(server.port, path)
    assert (reply.status, reply.body) == (404, b"not found\n")


def test_the_page_loads_nothing_from_elsewhere() -> None:
    page = (STATIC_DIR / "index.html").read_text()
    references = re.findall(r'(?:src|href)="([^"]*)"', page)
    assert references == ["/static/favicon.svg", "/static/vendor/uplot/uPlot.min.css", "/static/app.css",
                          "/static/vendor/uplot/uPlot.iife.min.js", "/static/charts.js",
                          "/static/rollouts.js", "/static/runlist.js", "/static/app.js",
                          "#charts", "#rollouts", "#config"]
    for reference in references:
        if reference.startswith("/static/"):
            assert (STATIC_DIR / reference.removeprefix("/static/")).is_file(), reference
    for name in ("index.html", "app.js", "charts.js", "rollouts.js", "runlist.js", "app.css"):
        text = (STATIC_DIR / name).read_text()
        assert not re.search(r"https?:|//[a-z0-9.-]+\.[a-z]{2,}/", text, re.IGNORECASE), name


# ---------------------------------------------------------------- token, cookie, Host


def test_with_a_token_every_request_needs_it(tmp_path: Path, start) -> None:
    server = start([write_run(tmp_path / "a", [ROW1])], token=TOKEN)
    for path in ("/", "/static/app.js", "/api/runs", f"/api/runs?token={TOKEN}"):
        refused = fetch(server.port, path)
        assert refused.status == 401, path
        assert refused.body.startswith(b"unauthorized: this dashboard needs its token")
        assert TOKEN.encode() not in refused.body
    assert fetch(server.port, "/api/runs", headers={"Authorization": "Bearer wrong-token-0123456789"}).status == 401
    assert fetch(server.port, "/api/runs", headers={"Authorization": f"Bearer {TOKEN}"}).status == 200
    assert fetch(server.port, "/", headers={"Authorization": f"bearer {TOKEN}"}).status == 200


def test_the_token_in_the_page_url_sets_a_strict_http_only_cookie(tmp_path: Path, start) -> None:
    server = start([write_run(tmp_path / "a", [ROW1])], token=TOKEN)
    redirect = fetch(server.port, f"/?token={TOKEN}")
    assert redirect.status == 303
    assert redirect.headers["Location"] == "/"
    cookie = redirect.headers["Set-Cookie"]
    name_value, *attributes = [part.strip() for part in cookie.split(";")]
    assert sorted(attributes) == ["HttpOnly", "Path=/", "SameSite=Strict"]
    name, value = name_value.split("=")
    assert name == f"rltune_dashboard_{server.port}" and TOKEN not in value

    assert fetch(server.port, "/api/runs", headers={"Cookie": name_value}).status == 200
    assert fetch(server.port, "/", headers={"Cookie": f'other="a;b; {name_value}; x'}).status == 200
    assert fetch(server.port, "/api/runs", headers={"Cookie": f"{name}=0123abcd"}).status == 401
    assert fetch(server.port, "/api/runs", headers={"Cookie": f"rltune_dashboard_1={value}"}).status == 401
    assert fetch(server.port, "/?token=wrong-token-0123456789").status == 401
    again = fetch(server.port, f"/?token={TOKEN}", headers={"Cookie": name_value})
    assert (again.status, again.headers["Location"]) == (303, "/")  # the token leaves the address bar


@pytest.mark.parametrize("host, status", [
    ("localhost:{port}", 200), ("127.0.0.1:{port}", 200), ("[::1]:{port}", 200), ("LOCALHOST", 200),
    ("127.0.0.2:{port}", 200), ("evil.example:{port}", 403), ("127.0.0.1.evil.example", 403),
    ("localhost.evil.example:{port}", 403), ("", 403),
])
def test_on_loopback_only_loopback_host_headers_are_answered(tmp_path: Path, start, host: str, status: int) -> None:
    server = start([write_run(tmp_path / "a", [ROW1])])
    reply = fetch(server.port, "/api/runs", headers={"Host": host.format(port=server.port)})
    assert reply.status == status
    if status == 403:
        assert reply.body.startswith(b"forbidden: this dashboard answers only requests addressed to localhost")


def test_a_request_without_host_header_is_refused_on_loopback(tmp_path: Path, start) -> None:
    server = start([write_run(tmp_path / "a", [ROW1])])
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    connection.putrequest("GET", "/api/runs", skip_host=True)
    connection.endheaders()
    assert connection.getresponse().status == 403
    connection.close()


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_binding_off_loopback_needs_a_token(tmp_path: Path, host: str) -> None:
    with pytest.raises(DashboardError, match=re.escape(
            f"binding to {host} exposes the runs to other machines; it needs --token or RLTUNE_DASHBOARD_TOKEN")):
        make_server([write_run(tmp_path / "a", [ROW1])], host=host, port=0)


@pytest.mark.parametrize("token, message", [
    ("short", "the dashboard token is 5 characters long; use at least 16"),
    ("with space in the token", "the dashboard token must be printable ASCII without spaces"),
])
def test_weak_tokens_are_refused(tmp_path: Path, token: str, message: str) -> None:
    with pytest.raises(DashboardError, match=re.escape(message)):
        make_server([write_run(tmp_path / "a", [ROW1])], port=0, token=token)


def test_bad_ports_are_refused(tmp_path: Path, start) -> None:
    run = write_run(tmp_path / "a", [ROW1])
    with pytest.raises(DashboardError, match=re.escape("port 70000 is not a port number")):
        make_server([run], port=70000)
    taken = start([run])
    with pytest.raises(DashboardError, match=re.escape(f"cannot listen on 127.0.0.1:{taken.port}")):
        make_server([run], port=taken.port)


def _non_loopback_ipv4() -> str | None:
    """An IPv4 address of this machine that is not loopback, or None. The UDP socket is
    only connected (which picks the outgoing address); nothing is sent."""
    candidates = []
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: never routed anywhere real
            candidates.append(probe.getsockname()[0])
    except OSError:
        pass
    try:
        candidates += [info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    except OSError:
        pass
    return next((address for address in candidates if not address.startswith("127.")), None)


def test_from_another_address_the_page_needs_the_token(tmp_path: Path, start) -> None:
    address = _non_loopback_ipv4()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to send a request from")
    run = write_run(tmp_path / "a", [ROW1])

    open_server = start([run], host="0.0.0.0", token=TOKEN)
    assert fetch(open_server.port, "/", address=address).status == 401
    assert fetch(open_server.port, "/", address=address, headers={"Authorization": f"Bearer {TOKEN}"}).status == 200

    local_server = start([run], host="127.0.0.1")
    assert fetch(local_server.port, "/").status == 200
    with pytest.raises(ConnectionRefusedError):
        fetch(local_server.port, "/", address=address)


# ---------------------------------------------------------------- serve


def test_serve_prints_where_to_open_the_page_and_what_it_watches(tmp_path: Path, monkeypatch) -> None:
    runs = tmp_path / "runs"
    write_run(runs / "a", [ROW1])
    empty = tmp_path / "later"
    empty.mkdir()

    def interrupted(self: DashboardServer, poll_interval: float = 0.5) -> None:
        lines.append(f"serving {self.url}")
        raise KeyboardInterrupt

    monkeypatch.setattr(DashboardServer, "serve_forever", interrupted)
    lines: list[str] = []
    serve([runs, empty], port=0, token=TOKEN, log=lines.append)
    url = re.fullmatch(r"rltune dashboard: (http://127\.0\.0\.1:\d+/)", lines[0]).group(1)
    assert lines[1:] == [
        f"  watching {runs} (1 run)",
        f"  watching {empty} (no runs yet)",
        "  token required: open the page once as /?token=TOKEN, or send 'Authorization: Bearer TOKEN'",
        "  press Ctrl-C to stop",
        f"serving {url}",
        "dashboard stopped",
    ]
    with pytest.raises(DashboardError, match="does not exist"):
        serve([tmp_path / "nowhere"], port=0, log=lines.append)
