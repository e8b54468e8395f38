"""The images of vision-language rows: where a row names them, reading and checking them.

A row gives its images either as image parts of its chat messages or as a list in the
images field (``data.images_field``, see :mod:`rltune.data.loaders`). Image parts are those
``processor.apply_chat_template`` accepts (HF's and OpenAI's chat formats)::

    {"type": "image", "image" | "url" | "path" | "base64": REF}
    {"type": "image_url", "image_url": {"url": REF}}   (or "image_url": REF)

next to text parts ``{"type": "text", "text": "..."}``. A REF is

- a path: relative to the directory of the dataset file (a ``datasets`` directory: that
  directory), or absolute;
- a data URI, ``data:image/png;base64,...`` (a bare base64 string under ``"base64"``);
- the encoded file's bytes (parquet, built-in tasks);
- ``{"bytes": ..., "path": ...}``, how HF ``datasets`` stores an ``Image`` feature in parquet:
  the bytes when set, else the path.

URLs (``http://``, ``https://``) are refused: a run reads no network; download the images
and refer to the files.

A row whose images sit in another field named like one (``image``, ``img``, ``pictures``,
... in any case; :data:`IMAGE_FIELD_NAMES`) would train text-only: :func:`stray_images`
finds such a field when its value looks like images (image paths, data URIs, encoded
image bytes, ``{"bytes", "path"}``, PIL images, or a list of them); any other value, such
as a caption under ``image``, is left to the reward functions.

Each image is read once into a :class:`~rltune.data.records.PromptImage` (the encoded file
as read) and decoded with Pillow to check that it is an image within the limits
(``data.max_image_bytes`` for the encoded file, ``data.max_image_pixels`` for width x
height, checked from the header before the pixels are decoded) and to give the processor
an RGB image. A failure is an :class:`ImageError` naming the image and what to fix; the
loader adds the row.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rltune.data.records import PromptImage

IMAGE_PART_TYPES = ("image", "image_url")
"""The ``type`` of a message part that holds an image."""
_IMAGE_KEYS = ("image", "url", "path", "base64")
"""The keys of an ``{"type": "image"}`` part that hold its reference (HF's order)."""
_CHECK_HINT = "check the image or remove the row"
IMAGE_FIELD_NAMES = frozenset({"image", "images", "img", "imgs", "image_path", "image_paths",
                               "picture", "pictures", "photo", "photos"})
"""Field names (lower case) that say a field holds a row's images."""
_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff")
_IMAGE_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"BM", b"II*\x00", b"MM\x00*")


class ImageError(ValueError):
    """An image that cannot be used: ``problem`` says what is wrong, ``hint`` what to do."""

    def __init__(self, problem: str, hint: str) -> None:
        super().__init__(problem)
        self.problem, self.hint = problem, hint


def split_parts(content: list[Any], where: str) -> tuple[list[dict[str, str]], list[Any]]:
    """``(parts, refs)`` of a message's list of parts: text parts as ``{"type": "text",
    "text"}``, image parts replaced by the placeholder ``{"type": "image"}``, and the image
    references in order. ``where`` names the message in errors."""
    parts: list[dict[str, str]] = []
    refs: list[Any] = []
    hint = 'each part must be {"type": "text", "text": str} or an image part (docs/multimodal.md)'
    for k, part in enumerate(content, 1):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind in IMAGE_PART_TYPES:
            refs.append(_part_ref(part, f"part {k} of {where}"))
            parts.append({"type": "image"})
        else:
            raise ImageError(f"part {k} of {where} is not a text or image part: {_short(part)}", hint)
    return parts, refs


def stray_images(fields: Mapping[str, Any], images_field: str) -> str | None:
    """What is wrong when one of a row's ``fields`` other than ``images_field`` is named
    like an images field and holds what looks like images (module docstring); else None."""
    for key, value in fields.items():
        if (isinstance(key, str) and key != images_field and key.lower() in IMAGE_FIELD_NAMES
                and looks_like_images(value)):
            return (
                f"the field {key!r} holds images ({_describe(value)}), but data.images_field is "
                f"{images_field!r}, so they would be ignored; set "
                f"data.images_field: {key}, or rename the field to {images_field!r}"
            )
    return None


def looks_like_images(value: Any) -> bool:
    """Whether ``value`` is an image reference or a non-empty list of them: a path or URL
    with an image file's extension, a data URI, encoded image bytes, ``{"bytes", "path"}``
    or a PIL image. Checks no file."""
    if isinstance(value, (list, tuple)):
        return bool(value) and all(_looks_like_image(v) for v in value)
    return _looks_like_image(value)


def _describe(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return f"{len(value)}, the first {_describe(value[0])}"
    if isinstance(value, Mapping):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"{len(value)} bytes"
    return _short(value, 60) if isinstance(value, str) else type(value).__name__


def _looks_like_image(value: Any) -> bool:
    if isinstance(value, str):
        text = value.strip().lower()
        return text.startswith("data:image/") or (text.endswith(_IMAGE_SUFFIXES) and "\n" not in text)
    if isinstance(value, (bytes, bytearray, memoryview)):
        head = bytes(value[:12])
        return head.startswith(_IMAGE_MAGIC) or (head[:4] == b"RIFF" and head[8:] == b"WEBP")
    if isinstance(value, Mapping):  # datasets' Image feature
        return bool(value) and set(value) <= {"bytes", "path"} and any(value.values())
    pil = sys.modules.get("PIL.Image")  # a PIL image exists only once Pillow is imported
    return pil is not None and isinstance(value, pil.Image)


def read_image(
    ref: Any, *, base_dir: Path | None, row: int, index: int, max_bytes: int
) -> PromptImage:
    """The encoded image that ``ref`` names (see the module docstring); ``index`` is the
    image's 1-based place in the row. Only reads: :func:`decode_image` checks it decodes."""
    inline = f"row {row}, image {index}"
    if isinstance(ref, Mapping) and set(ref) <= {"bytes", "path"}:  # datasets' Image feature
        ref = ref.get("bytes") or ref.get("path")
    if isinstance(ref, (bytes, bytearray, memoryview)):
        return _checked(bytes(ref), f"{inline} (bytes)", max_bytes)
    if not isinstance(ref, str) or not ref:
        raise ImageError(
            f"image {index} is a {type(ref).__name__}: {_short(ref)}",
            "give a path, a data URI, bytes or {\"bytes\", \"path\"}",
        )
    if ref.startswith("data:"):
        return _checked(_data_uri_bytes(ref, index), f"{inline} (data URI)", max_bytes)
    if ref.startswith(("http://", "https://")):
        raise ImageError(
            f"image {index} is a URL ({ref}); rltune reads no network",
            "download the image and refer to the file by its path",
        )
    return _read_file(ref, base_dir, index, max_bytes)


def decode_image(image: PromptImage, *, index: int, max_pixels: int) -> Any:
    """``image`` decoded by Pillow as an RGB ``PIL.Image.Image``, after checking from its
    header that width x height is at most ``max_pixels``."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as err:  # pragma: no cover - transformers' processors need Pillow too
        raise ImageError("reading images needs Pillow", "pip install pillow") from err
    what = f"image {index} ({image.source})"
    try:
        opened = Image.open(io.BytesIO(image.data))
    except UnidentifiedImageError:
        raise ImageError(f"{what} is not an image Pillow can read", _CHECK_HINT) from None
    except Image.DecompressionBombError as err:  # past Pillow's own cap, above ours
        raise ImageError(f"{what} is too large to open: {err}", "downscale the image") from None
    except (OSError, ValueError, SyntaxError) as err:
        raise ImageError(f"{what} cannot be opened: {err}", _CHECK_HINT) from None
    width, height = opened.size
    if width * height > max_pixels:
        raise ImageError(
            f"{what} is {width}x{height} = {width * height} pixels, more than "
            f"data.max_image_pixels={max_pixels}",
            "downscale the image or raise data.max_image_pixels",
        )
    try:
        return opened.convert("RGB")  # decodes every pixel: a truncated file fails here
    except (OSError, ValueError, SyntaxError) as err:
        raise ImageError(f"{what} does not decode: {err}", _CHECK_HINT) from None


def _part_ref(part: Mapping[str, Any], where: str) -> Any:
    if part["type"] == "image_url":
        url = part.get("image_url")
        ref = url.get("url") if isinstance(url, Mapping) else url
    else:
        found = [key for key in _IMAGE_KEYS if part.get(key) is not None]
        if len(found) > 1:
            raise ImageError(f"{where} has several references {found}", "keep one of them")
        ref = part[found[0]] if found else None
        if found == ["base64"] and isinstance(ref, str) and not ref.startswith("data:"):
            ref = f"data:image;base64,{ref}"
    if ref is None:
        keys = "'image_url': {'url': ...}" if part["type"] == "image_url" else " / ".join(_IMAGE_KEYS)
        raise ImageError(f"{where} is an image part without an image", f"set {keys}")
    return ref


def _data_uri_bytes(uri: str, index: int) -> bytes:
    header, comma, payload = uri.partition(",")
    if not comma or not header.endswith(";base64"):
        raise ImageError(
            f"image {index} is a data URI that is not base64 ({header[:40]}...)",
            "encode it as data:image/png;base64,...",
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ImageError(f"image {index} is a data URI with invalid base64: {err}", _CHECK_HINT) from None


def _read_file(ref: str, base_dir: Path | None, index: int, max_bytes: int) -> PromptImage:
    path = Path(ref)
    if not path.is_absolute():
        if base_dir is None:
            raise ImageError(
                f"image {index} is the relative path {ref!r}, but this source has no directory",
                "give an absolute path, a data URI or the bytes",
            )
        path = base_dir / path
    if not path.is_file():
        problem = "is a directory" if path.is_dir() else "does not exist"
        raise ImageError(f"image {index} ({path}) {problem}",
                         "check the path (relative paths start at the dataset file's directory)")
    size = path.stat().st_size
    if size > max_bytes:
        raise ImageError(_too_big(f"image {index} ({path})", size, max_bytes), _BIG_HINT)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ImageError(f"image {index} ({path}) cannot be read: {err.strerror}", _CHECK_HINT) from None
    return PromptImage(source=str(path), digest=_digest(data), data=data)


_BIG_HINT = "downscale or recompress the image, or raise data.max_image_bytes"


def _checked(data: bytes, source: str, max_bytes: int) -> PromptImage:
    if len(data) > max_bytes:
        raise ImageError(_too_big(source, len(data), max_bytes), _BIG_HINT)
    if not data:
        raise ImageError(f"{source} is empty", _CHECK_HINT)
    return PromptImage(source=source, digest=_digest(data), data=data)


def _too_big(what: str, size: int, max_bytes: int) -> str:
    return f"{what} is {size} bytes, more than data.max_image_bytes={max_bytes}"


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."
