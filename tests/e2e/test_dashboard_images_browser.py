"""A vision-language run's rollouts in the dashboard, in a real browser (headless Chromium
driven by Playwright): each rollout of a prompt with images shows them as thumbnails beside
its completion, and each thumbnail actually loaded (the browser decoded the PNG the server
sent from the run's ``images/``, with the cookie the token set); the prompt's image parts
read as ``[image]``; a text rollout has no thumbnail; nothing is logged as an error.

The run directory is written here the way a run writes it (``samples.jsonl`` through
:class:`rltune.runtime.sinks.SampleLog`, the PNGs drawn with Pillow), so the test takes
seconds. A slow case makes the run directory with one real GRPO step of
``builtin:tiny-vl`` on ``builtin:shapes`` instead."""

from __future__ import annotations

import hashlib
import io
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip(f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
Image = pytest.importorskip("PIL.Image", reason="Pillow is not installed")

from rltune.data.records import Prompt, PromptImage, Rollout
from rltune.metrics.dashboard import make_server
from rltune.runtime.loop import _write_samples
from rltune.runtime.sinks import SampleLog

TOKEN = "e2e-images-token-0123456789"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WAIT_MS = 20_000


def drawn(size: tuple[int, int], colour: str) -> PromptImage:
    """A PNG of a filled circle on white, as a dataset would give it."""
    from PIL import ImageDraw

    picture = Image.new("RGB", size, "white")
    ImageDraw.Draw(picture).ellipse((2, 2, size[0] - 3, size[1] - 3), fill=colour)
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    data = buffer.getvalue()
    return PromptImage(source=f"shapes/{colour}.png", digest=hashlib.sha256(data).hexdigest()[:16], data=data)


def rollout(prompt: Prompt, group: int, text: str, reward: float) -> Rollout:
    return Rollout(prompt_id=prompt.id, group=group, prompt_ids=torch.tensor([1]), completion_ids=torch.tensor([2, 3]),
                   completion_logprobs=None, loss_mask=torch.ones(2), text=text, finish_reason="stop",
                   policy_version=0, reward=reward, images=prompt.images)


def write_vl_run(path: Path) -> None:
    """A run directory with one step: two samples of a prompt with two images, one of a
    prompt with one, and one text sample."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("name: shapes\nalgo:\n  name: grpo\n")
    (path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    red, blue = drawn((48, 32), "red"), drawn((24, 24), "blue")
    two = Prompt(id="shapes:0", messages=[{"role": "user", "content": [
        {"type": "image", "image": "shapes/red.png"}, {"type": "image", "image": "shapes/blue.png"},
        {"type": "text", "text": "Which is larger?"}]}], images=[red, blue])
    one = Prompt(id="shapes:1", text="<image> What colour?", images=[blue])
    text = Prompt(id="arith:0", text="1+1=")
    log = SampleLog(path, resume_after_step=None)
    _write_samples(log, 1, [two, one, text], [
        rollout(two, 0, "the red one", 1.0), rollout(two, 0, "the blue one", 0.0),
        rollout(one, 1, "blue", 1.0), rollout(text, 2, "2", 1.0)], None)
    log.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One Chromium for the module (Playwright's sync API runs one instance per thread)."""
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@contextmanager
def dashboard_page(browser: Any, runs: Path) -> Iterator[Any]:
    """The dashboard of the runs under ``runs`` (token on), open in a new tab once it shows
    a rollout; ``page.problems`` gathers console and page errors."""
    server = make_server([runs], port=0, token=TOKEN)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    tab = browser.new_page(viewport={"width": 1440, "height": 900})
    try:
        tab.problems = []
        tab.on("console", lambda msg: tab.problems.append(f"console {msg.type}: {msg.text}")
               if msg.type == "error" else None)
        tab.on("pageerror", lambda err: tab.problems.append(f"page error: {err}"))
        tab.goto(f"{server.url}?token={TOKEN}")
        tab.wait_for_selector("#sample-rows tr", timeout=WAIT_MS)
        yield tab
    finally:
        tab.close()
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def page(browser: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    root = tmp_path_factory.mktemp("images-dashboard")
    write_vl_run(root / "runs" / "shapes")
    with dashboard_page(browser, root / "runs") as tab:
        yield tab


def row_with(page: Any, completion: str) -> Any:
    exactly = re.compile(f"^{re.escape(completion)}$")
    return page.locator("#sample-rows tr", has=page.locator("td[data-col=completion] .text", has_text=exactly))


def loaded_sizes(row: Any) -> list[list[int]]:
    """The natural size of each thumbnail in the row's completion cell, once all loaded."""
    thumbs = row.locator("td[data-col=completion] img.thumb")
    thumbs.first.wait_for(timeout=WAIT_MS)
    row.page.wait_for_function("imgs => imgs.every(img => img.complete)", arg=thumbs.element_handles(),
                               timeout=WAIT_MS)
    return thumbs.evaluate_all("imgs => imgs.map(img => [img.naturalWidth, img.naturalHeight])")


def test_each_image_of_a_rollout_shows_as_a_loaded_thumbnail(page: Any) -> None:
    assert loaded_sizes(row_with(page, "the red one")) == [[48, 32], [24, 24]]
    assert loaded_sizes(row_with(page, "the blue one")) == [[48, 32], [24, 24]]
    assert loaded_sizes(row_with(page, "blue")) == [[24, 24]]
    titles = row_with(page, "the red one").locator("td[data-col=completion] .thumbs a").evaluate_all(
        "links => links.map(a => a.title)")
    assert titles == ["shapes/red.png", "shapes/blue.png"]


def test_a_text_rollout_has_no_thumbnail_and_image_parts_read_as_text(page: Any) -> None:
    assert row_with(page, "2").locator("img").count() == 0
    prompt = row_with(page, "the red one").locator("td[data-col=prompt]").text_content()
    assert "[image][image]Which is larger?" in prompt


def test_no_console_or_page_errors(page: Any) -> None:
    assert page.problems == []


@pytest.mark.slow
def test_a_real_vision_language_runs_rollouts_show_their_images(browser: Any, tmp_path: Path) -> None:
    """One GRPO step of builtin:tiny-vl on builtin:shapes (about 35 s on two busy cores):
    every rollout row shows its prompt's 112x112 scene, loaded."""
    (tmp_path / "c.yaml").write_text("name: shapes-vl\n")
    args = ["model.path=builtin:tiny-vl", "algo.name=grpo", "algo.group_size=2", "data.train=builtin:shapes/train",
            "reward.0.fn=builtin:exact_text", "rollout.max_new_tokens=4", "train.steps=1",
            "train.prompts_per_step=2", "train.threads=1", "log.dir=runs", "log.console=false",
            "checkpoint.final=false"]
    done = subprocess.run([sys.executable, "-m", "rltune.cli", "train", "c.yaml", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with dashboard_page(browser, tmp_path / "runs") as tab:
        rows = tab.locator('#sample-rows tr[data-run="shapes-vl"]')
        assert rows.count() == 4
        for i in range(4):
            assert loaded_sizes(rows.nth(i)) == [[112, 112]]
        assert tab.problems == []
