"""``rltune report`` on a vision-language run written here: the images of the rollouts the
page shows are copied beside it (into a report folder outside the run too) and shown as
``<img>`` links relative to the page; a missing image, or a path in ``samples.jsonl`` that
is not a stored image, is named and never copied; a message of parts reads as text."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib")

from rltune.metrics.report import ReportError, write_report

RED = b"\x89PNG\r\n\x1a\n" + b"red pixels"
BLUE = b"\x89PNG\r\n\x1a\n" + b"blue pixels"
UNSHOWN = b"\x89PNG\r\n\x1a\n" + b"a middle sample's image"
WORST = b"\x89PNG\r\n\x1a\n" + b"the worst sample's image"


def name(data: bytes) -> str:
    return f"{hashlib.sha256(data).hexdigest()[:16]}.png"


def sample(reward: float, images: list[str], **extra: Any) -> dict[str, Any]:
    return {"step": 1, "prompt_id": "shapes:0", "completion": f"answer {reward}", "reward": reward,
            "rewards": {"acc": reward}, "finish_reason": "stop", "length": 2,
            "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many circles?"}]}],
            "images": [{"path": path, "source": f"shapes/{i}.png"} for i, path in enumerate(images)], **extra}


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "images").mkdir(parents=True)
    for data in (RED, BLUE, UNSHOWN, WORST):
        (run / "images" / name(data)).write_bytes(data)
    (run / "config.yaml").write_text("name: shapes\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    samples = [
        sample(1.0, [f"images/{name(RED)}", f"images/{name(BLUE)}"]),
        sample(0.75, []), sample(0.7, []), sample(0.6, [f"images/{name(UNSHOWN)}"]), sample(0.5, []),
        sample(0.25, [f"images/{'0' * 16}.png"]),  # its file is gone
        sample(0.0, ["../config.yaml", f"images/{name(WORST)}"]),  # not a stored image: never copied
    ]
    (run / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return run


def test_the_shown_rollouts_images_are_copied_beside_the_page(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "elsewhere"
    page = write_report(run_dir, out).read_text()

    assert sorted(p.name for p in (out / "images").iterdir()) == sorted([name(RED), name(BLUE), name(WORST)])
    assert (out / "images" / name(BLUE)).read_bytes() == BLUE
    best = page.split("<h3>Best</h3>")[1].split("<div class=\"sample\">")[1]
    assert f'<a href="images/{name(RED)}"><img src="images/{name(RED)}"' in best
    assert f'<img src="images/{name(BLUE)}"' in best
    assert "user: [image]How many circles?" in best
    assert f"images/{'0' * 16}.png is missing from the run directory" in page
    assert "../config.yaml is missing from the run directory" in page
    assert f'<img src="images/{name(WORST)}"' in page.split("<h3>Worst</h3>")[1]
    assert name(UNSHOWN) not in page  # the rollout with it is neither among the best nor the worst
    assert not (out / "config.yaml").exists()


def test_a_report_inside_the_run_copies_into_its_own_folder(run_dir: Path) -> None:
    page = write_report(run_dir)
    assert (run_dir / "report" / "images" / name(RED)).read_bytes() == RED
    assert f'<img src="images/{name(RED)}"' in page.read_text()
    assert write_report(run_dir) == page  # made again over the last one


def test_an_image_the_report_would_overwrite_in_another_folder_is_refused(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "elsewhere"
    (out / "images").mkdir(parents=True)
    (out / "images" / name(BLUE)).write_bytes(b"someone else's file")
    with pytest.raises(ReportError) as info:
        write_report(run_dir, out)
    assert str(info.value).startswith(f"report directory {out} already holds images/{name(BLUE)}, which the report "
                                      "would overwrite or remove")
    assert [p.name for p in out.rglob("*")] == ["images", name(BLUE)]
    assert (out / "images" / name(BLUE)).read_bytes() == b"someone else's file"


def test_a_report_into_the_run_directory_itself_leaves_its_images(run_dir: Path) -> None:
    # the images the page shows are the run's own: nothing to copy, nothing in the way
    images = sorted(p.name for p in (run_dir / "images").iterdir())
    page = write_report(run_dir, run_dir).read_text()
    assert f'<img src="images/{name(RED)}"' in page
    assert sorted(p.name for p in (run_dir / "images").iterdir()) == images
    assert (run_dir / "images" / name(RED)).read_bytes() == RED
