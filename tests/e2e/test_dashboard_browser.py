"""The dashboard in a real browser (headless Chromium driven by Playwright) while a real
training run writes its files.

A tiny GRPO run starts in a subprocess (in a temporary folder; killed at the end) and a
dashboard is started on a free port, with a token, watching that run's (still empty)
``runs/`` folder and a second, finished run written here. The page, opened once as
``/?token=...``, must: load without console or page errors; show the run once training
starts and draw newer steps while it trains; list both runs; show rollouts that are in
the run's ``samples.jsonl``; show the run's resolved config; say "no data" for a chart
no selected run has data for.

With ``RLTUNE_DOCS_SCREENSHOT=1`` the finished run is longer and a screenshot of the whole
page is saved to ``docs/images/dashboard.png`` once the live run has drawn past it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
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

TOKEN = "e2e-dashboard-token-0123456789"
RUN = "live"
OTHER = "baseline"
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "images" / "dashboard.png"
TAKE_SCREENSHOT = os.environ.get("RLTUNE_DOCS_SCREENSHOT") == "1"
OTHER_STEPS = 60 if TAKE_SCREENSHOT else 12
"""The finished run's length: short in the test, so the live run soon draws past it."""
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
REWARD_FILE = '''
def digit_share(prompt, completion, **meta):
    """Share of the completion's characters that are digits."""
    return sum(ch.isdigit() for ch in completion) / max(1, len(completion))
'''
TRAIN_ARGS = [
    "model.path=builtin:tiny", "algo.name=grpo", "algo.group_size=8",
    "data.train=builtin:arith_small/train", "reward.0.fn=r.py:digit_share",
    "rollout.max_new_tokens=8", "train.steps=2000", "train.prompts_per_step=4", "train.lr=1e-3",
    "train.threads=1", "log.dir=runs", "log.console=false", "checkpoint.final=false",
]
STEP_WAIT_MS = 45_000


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a file the run is still appending to."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # the line being written
            pass
    return rows


def visible(text: str) -> str:
    """The page's way to show control characters: the matching U+2400 symbols."""
    return "".join(
        "\u2421" if ch == "\x7f" else chr(0x2400 + ord(ch)) if ord(ch) < 0x20 and ch not in "\n\t" else ch
        for ch in text)


def write_other_run(path: Path) -> None:
    """A run that finished an hour ago, with plausible curves for ``OTHER_STEPS`` steps
    and no KL, so the KL chart has no data when it is the only run shown."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(f"name: {OTHER}\nalgo:\n  name: grpo\n")
    rows: list[dict[str, Any]] = []
    for step in range(1, OTHER_STEPS + 1):
        reward = 0.08 + 0.3 * (1 - math.exp(-step / 15)) + 0.02 * math.sin(step * 1.7)
        rows.append({
            "step": step, "reward/mean": reward, "reward/digit_share": reward, "reward/std": 0.12,
            "grad_norm": 0.4 + 1.1 * math.exp(-step / 12), "entropy": 5.5 - step * 0.02,
            "length/mean": 8.0 - step * 0.03, "length/max": 8.0, "loss": 0.02 * math.cos(step),
            "samples_per_s": 210 + 6 * math.sin(step), "tokens_per_s": 1700 + 40 * math.sin(step),
            "time/generate": 0.09, "time/score": 0.004, "time/experience": 0.002, "time/learn": 0.2,
            "time/sync": 0.0001,
        })
        if step % 10 == 0:
            rows.append({"step": step, "eval/reward/mean": reward + 0.03})
    (path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    an_hour_ago = time.time() - 3600
    for name in ("config.yaml", "metrics.jsonl"):
        os.utime(path / name, (an_hour_ago, an_hour_ago))


@dataclass
class Dashboard:
    page: Any
    server: DashboardServer
    training: subprocess.Popen
    run_dir: Path
    log: Path
    problems: list[str]

    def training_output(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def newest_step(self) -> int:
        value = self.page.get_attribute("#chart-reward", "data-newest-step")
        return int(value) if value else -1

    def wait_for_step(self, at_least: int) -> int:
        """Wait until the reward chart has drawn ``at_least``; fails with the training log."""
        try:
            self.page.wait_for_function(
                "n => Number(document.querySelector('#chart-reward').dataset.newestStep || -1) >= n",
                arg=at_least, timeout=STEP_WAIT_MS)
        except sync_api.TimeoutError:
            pytest.fail(f"the reward chart did not reach step {at_least} (at {self.newest_step()}); "
                        f"training exit code {self.training.poll()}, its output:\n{self.training_output()}")
        return self.newest_step()


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dashboard]:
    root = tmp_path_factory.mktemp("dashboard")
    (root / "r.py").write_text(REWARD_FILE)
    (root / "c.yaml").write_text(f"name: {RUN}\n")
    (root / "runs").mkdir()
    write_other_run(root / "finished" / OTHER)
    log = root / "training.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log.open("wb") as out:
        training = subprocess.Popen(
            [sys.executable, "-c", "import sys; from rltune.cli import main; sys.exit(main())",
             "train", "c.yaml", *TRAIN_ARGS],
            cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    server = None
    try:
        server = make_server([root / "runs", root / "finished" / OTHER], port=0, token=TOKEN)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1440, "height": 900})
                problems: list[str] = []
                page.on("console", lambda msg: problems.append(f"console {msg.type}: {msg.text}")
                        if msg.type == "error" else None)
                page.on("pageerror", lambda err: problems.append(f"page error: {err}"))
                page.goto(f"{server.url}?token={TOKEN}")
                yield Dashboard(page, server, training, root / "runs" / RUN, log, problems)
            finally:
                browser.close()
    finally:
        training.terminate()
        try:
            training.wait(timeout=10)
        except subprocess.TimeoutExpired:
            training.kill()
            training.wait(timeout=10)
        if server is not None:
            server.shutdown()
            server.server_close()


def test_the_page_opens_with_the_token_and_lists_both_runs(dashboard: Dashboard) -> None:
    page = dashboard.page
    assert page.url == dashboard.server.url  # the token left the address bar
    try:
        page.wait_for_selector(f'#run-list li[data-run="{RUN}"]', timeout=STEP_WAIT_MS)
    except sync_api.TimeoutError:
        pytest.fail(f"the training run never appeared; its output:\n{dashboard.training_output()}")
    listed = page.eval_on_selector_all("#run-list li", "items => items.map(li => li.dataset.run)")
    assert sorted(listed) == sorted([RUN, OTHER])
    assert page.is_checked(f'#run-list li[data-run="{RUN}"] input')
    assert page.is_checked(f'#run-list li[data-run="{OTHER}"] input')


def test_the_reward_chart_follows_the_run_while_it_trains(dashboard: Dashboard) -> None:
    first = dashboard.wait_for_step(OTHER_STEPS + 2)  # past the other run's last step: drawn from this run
    later = dashboard.wait_for_step(first + 2)
    assert later > first
    assert later <= max(row["step"] for row in read_jsonl(dashboard.run_dir / "metrics.jsonl"))


def test_the_rollout_browser_shows_completions_from_samples_jsonl(dashboard: Dashboard) -> None:
    page = dashboard.page
    page.wait_for_selector(f'#sample-rows tr[data-run="{RUN}"]', timeout=STEP_WAIT_MS)
    row = page.locator(f'#sample-rows tr[data-run="{RUN}"]').first
    expand = row.locator("td[data-col=completion] button.more")
    if expand.count():
        expand.click()
    step = int(row.get_attribute("data-step"))
    reward = row.get_attribute("data-reward")
    shown = row.locator("td[data-col=completion] .text").text_content()

    samples = read_jsonl(dashboard.run_dir / "samples.jsonl")
    matching = [s for s in samples if s["step"] == step and visible(s["completion"]) == shown]
    assert matching, f"no sample of step {step} has the completion {shown!r}"
    assert any(reward == "" if s["reward"] is None else reward != "" and float(reward) == s["reward"]
               for s in matching)


def test_the_config_view_shows_the_runs_resolved_config(dashboard: Dashboard) -> None:
    page = dashboard.page
    page.select_option("#config-run", RUN)
    page.wait_for_selector(f'#config-text[data-run="{RUN}"]', timeout=STEP_WAIT_MS)
    text = page.text_content("#config-text")
    assert f"name: {RUN}\n" in text
    assert text == (dashboard.run_dir / "config.yaml").read_text()


def test_a_chart_without_data_for_the_shown_runs_says_so(dashboard: Dashboard) -> None:
    page = dashboard.page
    toggle = f'#run-list li[data-run="{RUN}"] input'
    page.uncheck(toggle)
    page.wait_for_selector("#chart-kl .no-data", state="visible", timeout=STEP_WAIT_MS)
    assert page.text_content("#chart-kl .no-data") == "no data"
    assert page.is_visible("#chart-reward .plot")
    page.check(toggle)
    page.wait_for_selector("#chart-kl .plot", state="visible", timeout=STEP_WAIT_MS)


def test_no_console_or_page_errors(dashboard: Dashboard) -> None:
    if TAKE_SCREENSHOT:
        dashboard.wait_for_step(OTHER_STEPS + 10)
        dashboard.page.evaluate("() => { document.activeElement.blur(); window.scrollTo(0, 0); }")
        dashboard.page.wait_for_timeout(500)
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        dashboard.page.screenshot(path=str(SCREENSHOT), full_page=True)
    assert dashboard.problems == []
