"""Fixtures of the dashboard's tests."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rltune.metrics.dashboard import DashboardServer, make_server


@pytest.fixture
def start() -> Iterator[Callable[..., DashboardServer]]:
    """``start(paths, **make_server_kwargs)``: a server on a free port, serving in a thread."""
    running: list[tuple[DashboardServer, threading.Thread]] = []

    def _start(paths: list[Path], **kwargs: Any) -> DashboardServer:
        kwargs.setdefault("port", 0)
        server = make_server(paths, **kwargs)
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        running.append((server, thread))
        return server

    yield _start
    for server, thread in running:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
