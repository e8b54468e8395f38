"""The dashboard's ``/image`` route on run directories written here: a stored image comes
back with its bytes and image type; every other path (``..`` plain and percent-encoded,
absolute paths, other files of the run, links out of ``images/``, an ``images/`` that is a
link) is 404, an unknown run too; the token and the Host rule apply as to every route."""

from __future__ import annotations

import hashlib
import http.client
from pathlib import Path
from urllib.parse import quote

import pytest


PNG = b"\x89PNG\r\n\x1a\n" + b"not really pixels"
JPEG = b"\xff\xd8\xff\xe0" + b"nor these"
TOKEN = "image-route-token-0123456789"


def stored(data: bytes, ext: str) -> str:
    return f"images/{hashlib.sha256(data).hexdigest()[:16]}.{ext}"


def fetch(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", path, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.headers), response.read()
    finally:
        connection.close()


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    """runs/a with a PNG and a JPEG stored, a secret beside the runs, and runs/b whose
    images/ is a link to a folder outside."""
    root = tmp_path / "runs"
    run = root / "a"
    (run / "images").mkdir(parents=True)
    (run / "config.yaml").write_text("name: a\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / stored(PNG, "png")).write_bytes(PNG)
    (run / stored(JPEG, "jpg")).write_bytes(JPEG)
    (tmp_path / "secret.png").write_bytes(b"\x89PNG\r\n\x1a\nsecret")
    (run / "images" / f"{'ab' * 8}.png").symlink_to(tmp_path / "secret.png")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / f"{'cd' * 8}.png").write_bytes(PNG)
    (root / "b").mkdir()
    (root / "b" / "config.yaml").write_text("name: b\n")
    (root / "b" / "images").symlink_to(outside)
    return root


def image_url(run: str, path: str) -> str:
    return f"/image?run={quote(run, safe='')}&path={quote(path, safe='')}"


def test_a_stored_image_is_sent_with_its_type(runs: Path, start) -> None:
    server = start([runs])
    status, headers, body = fetch(server.port, image_url("a", stored(PNG, "png")))
    assert (status, headers["Content-Type"], body) == (200, "image/png", PNG)
    assert headers["X-Content-Type-Options"] == "nosniff"
    status, headers, body = fetch(server.port, image_url("a", stored(JPEG, "jpg")))
    assert (status, headers["Content-Type"], body) == (200, "image/jpeg", JPEG)


@pytest.mark.parametrize("query", [
    "run=a&path=images/../config.yaml",
    "run=a&path=images%2F..%2Fconfig.yaml",
    "run=a&path=images/%2e%2e/metrics.jsonl",
    "run=a&path=../a/{png}",
    "run=a&path=%2Fetc%2Fpasswd",
    "run=a&path=config.yaml",
    "run=a&path=metrics.jsonl",
    "run=a&path=images/",
    "run=a&path=images/abababababababab.png",  # a link to a file outside the run
    "run=b&path=images/cdcdcdcdcdcdcdcd.png",  # the run's images/ is a link
    "run=a",
    "run=a&path=images/{png}/../../config.yaml",
])
def test_anything_but_a_stored_image_is_not_found(runs: Path, start, query: str) -> None:
    server = start([runs])
    status, _, body = fetch(server.port, "/image?" + query.format(png=stored(PNG, "png").split("/")[1]))
    assert status == 404 and b"secret" not in body and b"name: a" not in body


def test_an_unknown_run_is_not_found(runs: Path, start) -> None:
    server = start([runs])
    status, _, body = fetch(server.port, image_url("../a", stored(PNG, "png")))
    assert status == 404 and b"no run '../a'" in body


def test_the_token_guards_images_too(runs: Path, start) -> None:
    server = start([runs], token=TOKEN)
    url = image_url("a", stored(PNG, "png"))
    assert fetch(server.port, url)[0] == 401
    assert fetch(server.port, url, {"Authorization": f"Bearer {TOKEN}"})[2] == PNG
    assert fetch(server.port, url, {"Host": "rebound.example:80"})[0] == 403
