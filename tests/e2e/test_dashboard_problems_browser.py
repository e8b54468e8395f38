"""Runs with broken files in the dashboard, in a real browser (headless Chromium driven by
Playwright): a problem of one run stays that run's own.

The run directories are written here (no training), beside one healthy run:

* ``broken``: ``samples.jsonl`` and ``config.yaml`` are directories, and ``metrics.jsonl``
  starts with a byte-order mark and has a line that is not JSON;
* ``shapes``: sample rows of odd shapes (``"prompt": [null, 5, {"role": null}]``,
  ``"turns": [null, "x"]``, rewards that are not a table, a finish reason that is an
  object) beside one ordinary row;
* a run whose directory name is not UTF-8;
* ``links``: ``config.yaml`` is a link to a file outside the run directory.

The page must keep updating every run, draw the healthy run's charts and every readable
rollout, name each run's problems (with the server's message) in that run's entry of the
run list, never say that the server cannot be reached, never show the linked file, and
raise no page error. (The browser logs each refused request as a console error; those are
expected here, page errors are not.)"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip(f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")

from rltune.metrics.dashboard import DashboardServer, make_server

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WAIT_MS = 20_000
NON_UTF8 = b"odd\xffname"
NON_UTF8_ID = "odd\\xffname"
SECRET = "secret-outside-the-run-0123"


def lines(rows: list[Any]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def metrics(steps: int) -> list[dict[str, Any]]:
    return [{"step": step, "reward/mean": step / 10, "loss": 0.5 / step, "grad_norm": 1.0} for step in range(1, steps + 1)]


def sample(step: int, completion: Any, **extra: Any) -> dict[str, Any]:
    return {"step": step, "prompt_id": f"p{step}", "prompt": "1+1=", "completion": completion, "reward": 1.0,
            "rewards": {"acc": 1.0}, "reward_error": None, "finish_reason": "stop", "length": 2, **extra}


def write_runs(root: Path) -> None:
    good = root / "runs" / "good"
    good.mkdir(parents=True)
    (good / "config.yaml").write_text("name: good\n")
    (good / "metrics.jsonl").write_bytes(lines(metrics(3)))
    (good / "samples.jsonl").write_bytes(lines([sample(3, "fine answer")]))

    broken = root / "runs" / "broken"
    (broken / "samples.jsonl").mkdir(parents=True)
    (broken / "config.yaml").mkdir()
    rows = lines(metrics(4)).split(b"\n")
    (broken / "metrics.jsonl").write_bytes(b"\xef\xbb\xbf" + rows[0] + b"\nnot json\n" + b"\n".join(rows[1:]))

    shapes = root / "runs" / "shapes"
    shapes.mkdir()
    (shapes / "metrics.jsonl").write_bytes(lines(metrics(2)))
    (shapes / "samples.jsonl").write_bytes(lines([
        sample(2, "ordinary row"),
        sample(2, "null messages", prompt=[None, 5, {"role": None, "content": None}]),
        sample(2, "turns of odd shapes", turns=[None, "x", {"role": "tool", "content": "42", "trained": False}]),
        sample(2, "rewards not a table", rewards="notadict", finish_reason={"why": 1}),
        sample(2, "rewards not numbers", rewards={"acc": "high"}, reward_error={"not": "text"}),
    ]))

    odd = root / "runs" / os.fsdecode(NON_UTF8)
    odd.mkdir()
    (odd / "metrics.jsonl").write_bytes(lines(metrics(1)))
    (odd / "samples.jsonl").write_bytes(lines([sample(1, "from the odd name")]))

    links = root / "runs" / "links"
    links.mkdir()
    (links / "metrics.jsonl").write_bytes(lines(metrics(1)))
    (root / "secret.txt").write_text(SECRET + "\n")
    (links / "config.yaml").symlink_to(root / "secret.txt")


@dataclass
class Page:
    page: Any
    server: DashboardServer
    page_errors: list[str]

    def run_item(self, run_id: str) -> Any:
        quoted = run_id.replace("\\", "\\\\")  # a backslash escapes in a CSS string
        return self.page.locator(f'#run-list > li[data-run="{quoted}"]')


@pytest.fixture(scope="module")
def shown(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Page]:
    root = tmp_path_factory.mktemp("problems")
    write_runs(root)
    server = make_server([root / "runs"], port=0)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    try:
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1440, "height": 900})
                page_errors: list[str] = []
                page.on("pageerror", lambda err: page_errors.append(str(err)))
                page.goto(server.url)
                page.wait_for_selector("#run-list > li", timeout=WAIT_MS)
                for box in page.locator("#run-list input[type=checkbox]").all():
                    if not box.is_checked():
                        box.check()
                page.wait_for_function(
                    "() => document.querySelectorAll('#run-list > li.selected').length === 5", timeout=WAIT_MS)
                time.sleep(2 * 1.5)  # two polls with every run ticked
                yield Page(page, server, page_errors)
            finally:
                browser.close()
    finally:
        server.shutdown()
        server.server_close()


def test_every_run_is_listed_and_the_status_blames_no_server(shown: Page) -> None:
    listed = shown.page.eval_on_selector_all("#run-list > li", "items => items.map(li => li.dataset.run)")
    assert sorted(listed) == sorted(["good", "broken", "shapes", NON_UTF8_ID, "links"])
    status = shown.page.text_content("#status")
    assert "cannot reach" not in status and "error" not in status, status
    assert "runs have problems (see Runs)" in status, status


def test_each_run_names_its_own_problems(shown: Page) -> None:
    broken = shown.run_item("broken").locator(".run-problems").inner_text()
    assert "samples.jsonl: is a directory, not a regular file" in broken
    assert "config.yaml: is a directory, not a regular file" in broken
    assert "1 unreadable line in metrics.jsonl, skipped (first: line 2: not a JSON line" in broken
    assert "a link to a file outside the run directory" in shown.run_item("links").locator(".run-problems").inner_text()
    for healthy in ("good", "shapes", NON_UTF8_ID):
        assert shown.run_item(healthy).get_attribute("data-problems") == "0", healthy


def test_the_charts_show_every_readable_run(shown: Page) -> None:
    # broken's metrics: steps 1-4 (the first line after its byte-order mark kept), good's 1-3
    assert shown.page.get_attribute("#chart-reward", "data-newest-step") == "4"
    legend = shown.page.eval_on_selector_all("#chart-reward .u-legend .u-label", "els => els.map(e => e.textContent)")
    for run_id in ("good", "broken", "shapes", NON_UTF8_ID, "links"):
        assert f"{run_id} · mean" in legend, (run_id, legend)


def test_every_rollout_is_shown_malformed_ones_too(shown: Page) -> None:
    table = shown.page.inner_text("#sample-rows")
    for completion in ("fine answer", "ordinary row", "from the odd name", "null messages", "rewards not a table",
                       "rewards not numbers"):
        assert completion in table, completion
    assert "not a turn" in table and "masked" in table
    assert "not a table of rewards" in table
    assert shown.page.locator("#sample-rows tr.bad-row").count() == 0


def test_a_config_that_cannot_be_read_is_said_so_and_a_link_is_not_followed(shown: Page) -> None:
    page = shown.page
    for run_id, why in (("links", "is a link to a file outside the run directory"),
                        ("broken", "is a directory, not a regular file")):
        page.select_option("#config-run", run_id)
        page.wait_for_selector(f'#config-text[data-run="{run_id}"][data-error="true"]', timeout=WAIT_MS)
        assert why in page.text_content("#config-text")
    assert SECRET not in page.content()
    page.select_option("#config-run", "good")
    page.wait_for_selector('#config-text[data-run="good"][data-error="false"]', timeout=WAIT_MS)
    assert page.text_content("#config-text") == "name: good\n"


def test_no_page_errors(shown: Page) -> None:
    assert shown.page_errors == []
