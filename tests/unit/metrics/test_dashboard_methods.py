"""The dashboard only reads: any other method gets 405 with ``Allow: GET, HEAD`` and a
short JSON body like the API's other errors, not http.server's 501 HTML page."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from rltune.metrics.dashboard import DashboardServer, make_server


@pytest.fixture
def server(tmp_path: Path) -> Iterator[DashboardServer]:
    (tmp_path / "runs").mkdir()
    server = make_server([tmp_path / "runs"], port=0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def _request(port: int, method: str, path: str, body: bytes | None = None) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request(method, path, body=body)
    response = connection.getresponse()
    response.body = response.read()
    connection.close()
    return response


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
@pytest.mark.parametrize("path", ["/", "/api/runs"])
def test_other_methods_are_not_allowed(server, method, path):
    response = _request(server.port, method, path, body=b'{"x": 1}')
    assert response.status == 405
    assert response.getheader("Allow") == "GET, HEAD"
    assert response.getheader("Content-Type") == "application/json; charset=utf-8"
    assert json.loads(response.body) == {
        "error": f"method {method} is not allowed: the dashboard only reads (GET, HEAD)"
    }


def test_get_still_answers(server):
    response = _request(server.port, "GET", "/api/runs")
    assert response.status == 200 and json.loads(response.body)["runs"] == []
