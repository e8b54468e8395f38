"""The images of a vision-language run's rollouts, on disk and read back.

A run stores each distinct prompt image once, as ``RUN_DIR/images/<digest>.<ext>``:
``digest`` is the first 16 hex digits of the SHA-256 of the encoded file, ``ext`` is
named from the file's first bytes (its format's signature; ``bin`` when it is none of
:data:`FORMATS`). ``samples.jsonl`` refers to an image by that path, relative to the run
directory. The dashboard serves these files (:func:`resolve_image`) and the report copies
the few it shows.
"""

from __future__ import annotations

import hashlib
import html
import os
import re
import secrets
import shutil
from collections.abc import Iterable, Mapping, Sequence, Set
from pathlib import Path
from typing import Any

IMAGES_DIR = "images"
"""The folder of a run directory that holds its rollouts' images."""

FORMATS: tuple[tuple[bytes, int, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", 0, "png"),
    (b"\xff\xd8\xff", 0, "jpg"),
    (b"GIF87a", 0, "gif"),
    (b"GIF89a", 0, "gif"),
    (b"WEBP", 8, "webp"),  # after "RIFF" and the chunk size
    (b"BM", 0, "bmp"),
    (b"II*\x00", 0, "tiff"),
    (b"MM\x00*", 0, "tiff"),
)
"""(signature, offset, extension) of the image formats a browser can be sent."""

CONTENT_TYPES = {
    "png": "image/png", "jpg": "image/jpeg", "gif": "image/gif", "webp": "image/webp",
    "bmp": "image/bmp", "tiff": "image/tiff", "bin": "application/octet-stream",
}

NAME = re.compile(r"[0-9a-f]{16}\.(?:png|jpg|gif|webp|bmp|tiff|bin)")
"""The name of a stored image; nothing else under ``images/`` is ever served."""

_DIGEST = re.compile(r"[0-9a-f]{16}")


def image_extension(data: bytes) -> str:
    """The file extension for an encoded image, from its signature (``bin`` if unknown)."""
    for signature, offset, ext in FORMATS:
        if data[offset:offset + len(signature)] == signature:
            if ext != "webp" or data[:4] == b"RIFF":
                return ext
    return "bin"


def image_digest(data: bytes) -> str:
    """The first 16 hex digits of the SHA-256 of ``data`` (a stored image's name)."""
    return hashlib.sha256(data).hexdigest()[:16]


class ImageStore:
    """Writes a run's images into ``RUN_DIR/images/``, each distinct one once.

    A file already there (an earlier step, or the run before a resume) is not written
    again; a new one is written to a temporary name and renamed, so a reader never sees
    half an image."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self._paths: dict[str, str] = {}

    def add(self, digest: str, data: bytes) -> str:
        """Store an image (if not stored yet); returns its path relative to the run
        directory, ``images/<digest>.<ext>``. ``digest`` must be ``data``'s digest."""
        known = self._paths.get(digest)
        if known is not None:
            return known
        if not _DIGEST.fullmatch(digest) or image_digest(data) != digest:
            raise ValueError(f"image digest {digest!r} is not the first 16 hex digits of its data's SHA-256 "
                             f"({image_digest(data)})")
        name = f"{digest}.{image_extension(data)}"
        folder = self.run_dir / IMAGES_DIR
        if not (folder / name).is_file():
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".{name}.{secrets.token_hex(4)}.tmp"
            try:
                tmp.write_bytes(data)
                os.replace(tmp, folder / name)
            finally:
                tmp.unlink(missing_ok=True)
        self._paths[digest] = relative = f"{IMAGES_DIR}/{name}"
        return relative


def resolve_image(run_dir: Path, relative: str) -> Path | None:
    """The file ``relative`` (as ``samples.jsonl`` gives it, ``images/<name>``) names in
    ``run_dir``, or None unless it is a stored image's name and a plain file directly in
    the run's own ``images/`` folder: links (the file, or the folder itself), ``..`` and
    any other name are refused."""
    folder, sep, name = relative.partition("/")
    if folder != IMAGES_DIR or not sep or not NAME.fullmatch(name):
        return None
    images = Path(run_dir).resolve() / IMAGES_DIR
    target = images / name
    if target.is_symlink() or target.resolve().parent != images or not target.is_file():
        return None
    return target


def content_type(path: Path) -> str:
    """The ``Content-Type`` of a stored image, from its extension."""
    return CONTENT_TYPES[path.suffix.lstrip(".")]


def sample_image_paths(sample: Mapping[str, Any]) -> list[str]:
    """The ``path`` of each image a ``samples.jsonl`` row refers to (none for a text row)."""
    images = sample.get("images")
    if not isinstance(images, list):
        return []
    return [image["path"] for image in images if isinstance(image, dict) and isinstance(image.get("path"), str)]


def copy_images(run_dir: Path, paths: Iterable[str], out_dir: Path) -> set[str]:
    """Copy the stored images ``paths`` (as ``samples.jsonl`` gives them) of ``run_dir``
    to the same paths under ``out_dir``; returns those copied. A path that is not a stored
    image of the run (missing, or not a name :func:`resolve_image` accepts) is left out."""
    copied = set()
    for relative in dict.fromkeys(paths):
        source = resolve_image(run_dir, relative)
        if source is None:
            continue
        target = Path(out_dir) / relative
        if target.resolve() != source:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.unlink(missing_ok=True)  # a link there is replaced, not written through
            shutil.copyfile(source, target)
        copied.add(relative)
    return copied


def images_html(paths: Sequence[str], copied: Set[str]) -> str:
    """A report's images of one sample: those ``copied`` beside the page as thumbnails
    linked to the full image, any other named as missing from the run directory."""
    e = lambda text: html.escape(text, quote=True)  # noqa: E731
    shown = [f"<a href=\"{e(p)}\"><img src=\"{e(p)}\" alt=\"{e(p)}\"></a>" if p in copied
             else f"<span class=\"error\">{e(p)} is missing from the run directory</span>" for p in paths]
    return f"<div class=\"label\">images</div><div class=\"images\">{''.join(shown)}</div>" if shown else ""
