"""The Chroma adapter against a real Chroma server (``chroma run``) started on a free
127.0.0.1 port with a temporary data directory, and stopped after the module.

The adapter and the embedded store are given the same documents and the same embedder;
they must return the same ids in the same order, with the same cosine scores.
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from rltune.envs.retrieval import (
    ChromaStore, Document, EmbeddedStore, HashingEmbedder, build_retriever, make_embedder,
)

if importlib.util.find_spec("chromadb") is None:
    pytest.skip("the Chroma server package is not installed (pip install chromadb==1.5.9)",
                allow_module_level=True)

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Server:
    host: str
    port: int
    started_in_s: float


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chroma_executable() -> str:
    """The ``chroma`` script of this interpreter's environment, else the one on PATH."""
    beside = Path(sys.executable).parent / "chroma"
    found = str(beside) if beside.is_file() else shutil.which("chroma")
    if found is None:
        pytest.fail("chromadb is installed but its 'chroma' command is not found")
    return found


def wait_ready(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"chroma run exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.1)
    pytest.fail(f"chroma run not ready after {READY_TIMEOUT_S} s:\n{log.read_text(errors='replace')}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("chroma")
    port, log = free_port(), root / "server.log"
    start = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [chroma_executable(), "run", "--host", "127.0.0.1", "--port", str(port),
             "--path", str(root / "data")],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}/api/v2/heartbeat", log)
        yield Server("127.0.0.1", port, time.monotonic() - start)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Counting:
    def __init__(self, inner) -> None:
        self.inner, self.dim = inner, inner.dim
        self.calls: list[list[str]] = []

    def embed(self, texts):
        self.calls.append(list(texts))
        return self.inner.embed(texts)


def corpus(n: int, seed: int) -> list[Document]:
    """``n`` documents of 4 to 12 words drawn from a 60-word vocabulary."""
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(60)]
    return [Document(f"doc-{i}", " ".join(rng.choice(words, size=int(rng.integers(4, 13)))),
                     {"i": i, "tags": ["t", str(i % 3)]})
            for i in range(n)]


def queries(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice([f"w{i}" for i in range(60)], size=3)) for _ in range(n)]


def assert_same_results(a, b) -> None:
    assert [[h.id for h in hits] for hits in a] == [[h.id for h in hits] for hits in b]
    np.testing.assert_allclose([[h.score for h in hits] for hits in a],
                               [[h.score for h in hits] for hits in b], atol=1e-5)
    assert [[h.meta for h in hits] for hits in a] == [[h.meta for h in hits] for hits in b]


# --------------------------------------------------------------------------- tests


def test_server_starts_quickly(server):
    print(f"chroma run ready in {server.started_in_s:.2f} s")
    assert server.started_in_s < READY_TIMEOUT_S


class Projected:
    """Hashing features through a fixed random projection to 64 dimensions: continuous
    scores, so no two documents tie for a query (ties may come in any order)."""

    dim = 64

    def __init__(self) -> None:
        self.hashing = HashingEmbedder(1024)
        self.matrix = np.random.default_rng(7).standard_normal((1024, self.dim))

    def embed(self, texts):
        x = self.hashing.embed(texts) @ self.matrix
        return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_server_and_embedded_store_agree(server):
    embedder = Projected()
    docs, qs = corpus(300, seed=0), queries(40, seed=1)
    remote = ChromaStore(embedder, host=server.host, port=server.port, collection="agree-hashing")
    local = EmbeddedStore(embedder)
    remote.add(docs)
    local.add(docs)
    assert len(remote) == len(local) == 300
    got, want = remote.search_many(qs, k=5), local.search_many(qs, k=5)
    assert all(len(hits) == 5 for hits in got)
    gaps = np.diff([[h.score for h in hits] for hits in want], axis=1)
    assert gaps.max() < -1e-6  # strictly decreasing, beyond float32 noise: one right order
    assert_same_results(got, want)
    assert remote.search(qs[0], k=5) == got[0]


def test_server_and_embedded_store_agree_with_minilm(server):
    embedder = make_embedder("minilm")
    texts = ["The cat sleeps on the warm windowsill.", "Stock markets fell sharply on Monday.",
             "A kitten naps in the sun by the window.", "The recipe needs two cups of flour.",
             "Investors sold shares as prices dropped.", "Bake the bread for forty minutes.",
             "The goalkeeper saved a penalty in the final.", "Rain is expected across the north."]
    docs = [Document(f"s{i}", t) for i, t in enumerate(texts)]
    qs = ["where is the cat resting", "financial news", "baking instructions", "football match"]
    remote = ChromaStore(embedder, host=server.host, port=server.port, collection="agree-minilm")
    local = EmbeddedStore(embedder)
    remote.add(docs)
    local.add(docs)
    got = remote.search_many(qs, k=3)
    assert_same_results(got, local.search_many(qs, k=3))
    topics = [{"s0", "s2"}, {"s1", "s4"}, {"s3", "s5"}, {"s6"}]
    assert all(hits[0].id in topic for hits, topic in zip(got, topics))


def test_upserts_on_the_server(server):
    embedder = Counting(HashingEmbedder(256))
    store = ChromaStore(embedder, host=server.host, port=server.port, collection="upserts")
    assert len(store) == 0 and store.search("w1") == [] and store.search_many(["a", "b"]) == [[], []]
    docs = [Document("a", "alpha"), Document("b", "alpha beta"), Document("c", "gamma", {"x": 1})]
    store.add(docs)
    assert len(store) == 3
    embedder.calls.clear()
    store.add(docs)  # unchanged: nothing embedded
    assert embedder.calls == [] and len(store) == 3
    store.add([Document("a", "gamma"), Document("c", "gamma", {"x": 2})])
    assert embedder.calls == [["gamma"]]  # c changed meta only
    got = store.search("gamma", k=10)  # k larger than the collection
    assert sorted(h.id for h in got) == ["a", "b", "c"] and {h.id for h in got[:2]} == {"a", "c"}
    assert {h.id: h.meta for h in got}["c"] == {"x": 2}
    assert got[0].score == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ValueError, match="'a' appears twice"):
        store.add([Document("a", "x"), Document("a", "y")])
    reopened = Counting(HashingEmbedder(256))
    again = ChromaStore(reopened, host=server.host, port=server.port, collection="upserts")
    assert len(again) == 3 and reopened.calls == []
    assert [h.id for h in again.search("alpha beta", k=1)] == ["b"]


def test_build_retriever_makes_a_chroma_store(server, tmp_path):
    (tmp_path / "c.jsonl").write_text('{"id": "1", "text": "alpha"}\n{"id": "2", "text": "beta"}\n')
    store = build_retriever({"kind": "chroma", "host": server.host, "port": server.port,
                             "collection": "from-spec", "embedder": {"name": "hashing", "dim": 64},
                             "documents": "c.jsonl"}, base_dir=str(tmp_path))
    assert isinstance(store, ChromaStore) and len(store) == 2
    assert [h.id for h in store.search("beta", k=1)] == ["2"]


def test_collections_that_do_not_fit_are_errors(server):
    import chromadb
    from chromadb.config import Settings

    client = chromadb.HttpClient(host=server.host, port=server.port,
                                 settings=Settings(anonymized_telemetry=False))
    client.get_or_create_collection("euclid", embedding_function=None)  # l2 space
    with pytest.raises(ValueError, match="measures 'l2' distance"):
        ChromaStore(HashingEmbedder(8), host=server.host, port=server.port, collection="euclid")
    ChromaStore(HashingEmbedder(16), host=server.host, port=server.port,
                collection="sixteen").add([Document("a", "alpha")])
    with pytest.raises(ValueError, match="holds 16-dimensional vectors; the embedder gives 8"):
        ChromaStore(HashingEmbedder(8), host=server.host, port=server.port, collection="sixteen")


def test_no_server_is_a_connection_error():
    with pytest.raises(ConnectionError, match="no Chroma server answers at 127.0.0.1:"):
        ChromaStore(HashingEmbedder(8), host="127.0.0.1", port=free_port())
