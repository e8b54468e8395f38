"""The images of a vision-language run's samples: ``samples.jsonl`` names each image of a
sample's prompt (``images/<digest>.<ext>`` and its source), the run writes each distinct
image once into ``images/`` (kept on resume), only stored image names resolve (no ``..``,
no links), and the report copies the images of the rollouts it shows beside its page.
Images are PNG files written here byte by byte; digests are sha256 worked out here."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from rltune.data.records import Prompt, PromptImage, Rollout
from rltune.metrics.images import ImageStore, image_extension, resolve_image
from rltune.runtime.loop import _write_samples
from rltune.runtime.sinks import SampleLog


def png(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """A PNG of one colour (8-bit RGB, no filter)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    rows = b"".join(b"\x00" + bytes(rgb) * width for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


RED, BLUE = png(4, 3, (255, 0, 0)), png(2, 2, (0, 0, 255))


def image(data: bytes, source: str) -> PromptImage:
    return PromptImage(source=source, digest=hashlib.sha256(data).hexdigest()[:16], data=data)


def rollout(prompt: Prompt, group: int, text: str, images: list[PromptImage] | None) -> Rollout:
    return Rollout(prompt_id=prompt.id, group=group, prompt_ids=torch.tensor([1, 2]),
                   completion_ids=torch.tensor([3, 4, 5]), completion_logprobs=None,
                   loss_mask=torch.ones(3), text=text, finish_reason="stop", policy_version=0,
                   reward=1.0, images=images)


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_extension_is_named_from_the_signature() -> None:
    assert image_extension(RED) == "png"
    assert image_extension(b"\xff\xd8\xff\xe0\x00\x10JFIF") == "jpg"
    assert image_extension(b"GIF89a\x01\x00") == "gif"
    assert image_extension(b"RIFF\x10\x00\x00\x00WEBPVP8 ") == "webp"
    assert image_extension(b"RIFF\x10\x00\x00\x00WAVEfmt ") == "bin"
    assert image_extension(b"BM\x00\x00") == "bmp"
    assert image_extension(b"II*\x00\x08\x00") == "tiff"
    assert image_extension(b"P6\n2 2\n255\n") == "bin"


def test_each_image_is_written_once_under_its_digest(tmp_path: Path) -> None:
    red = image(RED, "a.png")
    store = ImageStore(tmp_path)
    assert store.add(red.digest, red.data) == f"images/{red.digest}.png"
    stored = tmp_path / "images" / f"{red.digest}.png"
    assert stored.read_bytes() == RED
    os.utime(stored, (1_000_000_000, 1_000_000_000))
    assert store.add(red.digest, red.data) == f"images/{red.digest}.png"
    # a store opened later (a resumed run) finds the file and leaves it as it is
    assert ImageStore(tmp_path).add(red.digest, red.data) == f"images/{red.digest}.png"
    assert stored.stat().st_mtime == 1_000_000_000
    assert os.listdir(tmp_path / "images") == [stored.name]  # no temporary file left


def test_a_digest_that_is_not_the_datas_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not the first 16 hex digits"):
        ImageStore(tmp_path).add(image(BLUE, "b.png").digest, RED)
    with pytest.raises(ValueError, match="not the first 16 hex digits"):
        ImageStore(tmp_path).add("../../etc/passwd", RED)
    assert not (tmp_path / "images").exists()


def vl_prompt(images: list[PromptImage]) -> Prompt:
    content = [{"type": "image", "image": b"\x89PNG"},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
               {"type": "text", "text": "How many shapes?"}]
    return Prompt(id="shapes:0", messages=[{"role": "system", "content": "Answer with a number."},
                                           {"role": "user", "content": content}], images=images)


def test_samples_name_their_prompts_images_and_each_is_stored_once(tmp_path: Path) -> None:
    red, blue = image(RED, "shapes/red.png"), image(BLUE, "row 4, image 1 (bytes)")
    vl, text = vl_prompt([red, blue]), Prompt(id="t:0", text="1+1=")
    red_again = Prompt(id="shapes:1", text="<image> colour?", images=[image(RED, "other/red-copy.png")])
    rollouts = [rollout(vl, 0, "2", vl.images), rollout(vl, 0, "3", vl.images),
                rollout(text, 1, "2", None), rollout(red_again, 2, "red", red_again.images)]
    log = SampleLog(tmp_path, resume_after_step=None)
    _write_samples(log, 1, [vl, text, red_again], rollouts, None)
    log.close()

    rows = read_rows(tmp_path / "samples.jsonl")
    refs = [{"path": f"images/{red.digest}.png", "source": "shapes/red.png"},
            {"path": f"images/{blue.digest}.png", "source": "row 4, image 1 (bytes)"}]
    assert [row.get("images") for row in rows] == [
        refs, refs, None, [{"path": f"images/{red.digest}.png", "source": "other/red-copy.png"}]]
    # the image parts name no bytes or data URI: the row's images list stands for them, in order
    assert rows[0]["prompt"] == [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "How many shapes?"}]}]
    assert rows[2]["prompt"] == "1+1=" and "images" not in rows[2]
    assert sorted(os.listdir(tmp_path / "images")) == sorted([f"{red.digest}.png", f"{blue.digest}.png"])
    assert (tmp_path / f"images/{blue.digest}.png").read_bytes() == BLUE
    assert vl.messages[1]["content"][0]["image"] == b"\x89PNG"  # the prompt itself is untouched


def test_a_resumed_run_keeps_the_images_and_refers_to_them_again(tmp_path: Path) -> None:
    red = image(RED, "red.png")
    prompt = Prompt(id="p", text="<image>?", images=[red])
    log = SampleLog(tmp_path, resume_after_step=None)
    for step in (1, 2):
        _write_samples(log, step, [prompt], [rollout(prompt, 0, f"step {step}", [red])], None)
    log.close()
    stored = tmp_path / "images" / f"{red.digest}.png"
    os.utime(stored, (1_000_000_000, 1_000_000_000))

    log = SampleLog(tmp_path, resume_after_step=1)  # resumed from the checkpoint of step 1
    _write_samples(log, 2, [prompt], [rollout(prompt, 0, "again", [red])], None)
    log.close()
    rows = read_rows(tmp_path / "samples.jsonl")
    assert [(row["step"], row["completion"]) for row in rows] == [(1, "step 1"), (2, "again")]
    assert rows[1]["images"] == [{"path": f"images/{red.digest}.png", "source": "red.png"}]
    assert stored.read_bytes() == RED and stored.stat().st_mtime == 1_000_000_000


@pytest.fixture
def run_dir(tmp_path: Path) -> tuple[Path, str]:
    """A run directory with one stored image; returns it and the image's path."""
    run = tmp_path / "run"
    relative = ImageStore(run).add(image(RED, "r.png").digest, RED)
    (run / "config.yaml").write_text("name: x\n")
    return run, relative


def test_a_stored_image_resolves(run_dir: tuple[Path, str]) -> None:
    run, relative = run_dir
    assert resolve_image(run, relative) == run.resolve() / relative
    (run.parent / "link").symlink_to(run)  # the run directory itself may be reached through a link
    assert resolve_image(run.parent / "link", relative) == run.resolve() / relative


@pytest.mark.parametrize("asked", [
    "images/../config.yaml", "../run/images/{name}", "images/{name}/..", "/etc/passwd", "{name}",
    "images/./{name}", "images//{name}", "images/sub/{name}", "images/.hidden.png", "images/{stem}.PNG",
    "images/{stem}.html", "images/{stem}0.png", "images\\{name}", "images/{name}\x00", "",
])
def test_only_stored_image_names_resolve(run_dir: tuple[Path, str], asked: str) -> None:
    run, relative = run_dir
    name = relative.split("/")[1]
    assert resolve_image(run, asked.format(name=name, stem=name.split(".")[0])) is None


def test_links_and_folders_do_not_resolve(run_dir: tuple[Path, str], tmp_path: Path) -> None:
    run, _ = run_dir
    secret = tmp_path / "secret.png"
    secret.write_bytes(BLUE)
    linked = f"{'ab' * 8}.png"
    (run / "images" / linked).symlink_to(secret)
    assert resolve_image(run, f"images/{linked}") is None
    (run / "images" / f"{'cd' * 8}.png").mkdir()
    assert resolve_image(run, f"images/{'cd' * 8}.png") is None
    # an images folder that is a link to elsewhere serves nothing, even a well-named file
    other = tmp_path / "other"
    other.mkdir()
    (other / f"{'ef' * 8}.png").write_bytes(BLUE)
    linked_run = tmp_path / "linked-run"
    linked_run.mkdir()
    (linked_run / "images").symlink_to(other)
    assert resolve_image(linked_run, f"images/{'ef' * 8}.png") is None
