"""Reading the images a row names (rltune.data.images): every form of reference, and the
errors that name the image and say what to fix."""

from __future__ import annotations

import base64
import hashlib
import io
from pathlib import Path

import pytest
from PIL import Image

from rltune.data.images import ImageError, decode_image, read_image, split_parts
from rltune.data.records import PromptImage

MB = 2**20


def png(width: int = 6, height: int = 4, colour: tuple[int, int, int] = (200, 10, 10)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format="PNG")
    return out.getvalue()


def read(ref, base_dir: Path | None = None, *, max_bytes: int = MB) -> PromptImage:
    return read_image(ref, base_dir=base_dir, row=3, index=2, max_bytes=max_bytes)


def test_a_relative_path_starts_at_the_dataset_directory(tmp_path):
    data = png()
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(data)
    image = read("imgs/a.png", tmp_path)
    assert image.data == data
    assert image.source == str(tmp_path / "imgs" / "a.png")
    assert image.digest == hashlib.sha256(data).hexdigest()[:16]
    assert read(str(tmp_path / "imgs" / "a.png"), None).data == data  # absolute: no base needed


def test_inline_forms_name_the_row_and_image():
    data = png()
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    assert read(uri) == PromptImage("row 3, image 2 (data URI)", hashlib.sha256(data).hexdigest()[:16], data)
    assert read(data).source == "row 3, image 2 (bytes)"
    assert read({"bytes": data, "path": "x.png"}).data == data  # datasets' Image feature
    assert read({"bytes": data, "path": "x.png"}).source == "row 3, image 2 (bytes)"


def test_the_dict_form_without_bytes_reads_its_path(tmp_path):
    (tmp_path / "b.png").write_bytes(png())
    assert read({"bytes": None, "path": "b.png"}, tmp_path).source == str(tmp_path / "b.png")


@pytest.mark.parametrize(
    "ref, message",
    [
        ("gone.png", r"image 2 \(.*gone\.png\) does not exist"),
        ("https://x.org/a.png", "image 2 is a URL"),
        ("data:image/png,abc", "data URI that is not base64"),
        ("data:image/png;base64,@@@", "data URI with invalid base64"),
        (12, "image 2 is a int"),
        (b"", r"row 3, image 2 \(bytes\) is empty"),
    ],
)
def test_bad_references(tmp_path, ref, message):
    with pytest.raises(ImageError, match=message):
        read(ref, tmp_path)


def test_the_byte_cap_is_checked_before_reading(tmp_path):
    (tmp_path / "big.png").write_bytes(png())
    size = len(png())
    with pytest.raises(ImageError, match=rf"big\.png\) is {size} bytes, more than data.max_image_bytes={size - 1}"):
        read("big.png", tmp_path, max_bytes=size - 1)
    with pytest.raises(ImageError, match=r"\(bytes\) is \d+ bytes, more than data.max_image_bytes=10"):
        read(png(), max_bytes=10)
    assert read("big.png", tmp_path, max_bytes=size).data == png()  # the cap itself passes


def test_decode_gives_rgb_and_checks_the_pixel_cap():
    image = read(png(6, 4))
    decoded = decode_image(image, index=2, max_pixels=24)  # exactly 6 x 4 passes
    assert decoded.mode == "RGB" and decoded.size == (6, 4)
    assert decoded.getpixel((0, 0)) == (200, 10, 10)
    with pytest.raises(ImageError, match=r"image 2 \(row 3, image 2 \(bytes\)\) is 6x4 = 24 pixels, "
                                         r"more than data.max_image_pixels=23"):
        decode_image(image, index=2, max_pixels=23)


def test_a_palette_image_is_converted_to_rgb():
    out = io.BytesIO()
    Image.new("P", (2, 2), 0).save(out, format="PNG")
    assert decode_image(read(out.getvalue()), index=1, max_pixels=100).mode == "RGB"


def test_files_that_are_not_images_or_are_truncated():
    with pytest.raises(ImageError, match="is not an image Pillow can read"):
        decode_image(read(b"hello, not a picture"), index=2, max_pixels=100)
    truncated = png(64, 64)[:-30]
    with pytest.raises(ImageError, match="does not decode"):
        decode_image(read(truncated), index=2, max_pixels=10**6)


def test_split_parts_keeps_text_and_puts_placeholders_for_images():
    content = [
        {"type": "image", "image": "a.png"},
        {"type": "text", "text": "how many?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
        {"type": "image", "path": "b.png"},
        {"type": "image", "base64": "QUJD"},
    ]
    parts, refs = split_parts(content, "message 1")
    assert parts == [{"type": "image"}, {"type": "text", "text": "how many?"},
                     {"type": "image"}, {"type": "image"}, {"type": "image"}]
    assert refs == ["a.png", "data:image/png;base64,AA==", "b.png", "data:image;base64,QUJD"]


@pytest.mark.parametrize(
    "part, message",
    [
        ({"type": "image"}, "part 1 of message 1 is an image part without an image"),
        ({"type": "image", "image": "a", "url": "b"}, r"several references \['image', 'url'\]"),
        ({"type": "audio", "audio": "a.wav"}, "part 1 of message 1 is not a text or image part"),
        ({"type": "text", "text": 3}, "not a text or image part"),
        ("plain", "not a text or image part"),
    ],
)
def test_split_parts_errors(part, message):
    with pytest.raises(ImageError, match=message):
        split_parts([part], "message 1")
