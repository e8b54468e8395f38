"""A :class:`~rltune.envs.retrieval.store.Retriever` backed by a Chroma server, for
corpora and fleets of rollout workers that outgrow one process's embedded store.

Embeddings are computed here, by the same :class:`Embedder` the embedded store uses, and
sent to the server with the documents; the collection measures cosine distance, so a hit's
score is ``1 - distance``, the cosine similarity the embedded store reports, and the two
stores rank the same data the same way (the server's HNSW index is approximate; at the
default ``ef_search`` of 100 it is exact on small collections). ``meta`` is stored as one
JSON string (Chroma's metadata holds only flat scalars), so any JSON-serialisable meta
comes back unchanged.

Needs the Chroma client: ``chromadb-client`` (the client alone) or ``chromadb`` (which
also has the server, ``chroma run``). The import happens when a store is created, so the
rest of the package runs without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rltune.envs.retrieval.store import (
    Document, Embedder, Hit, check_documents, check_embeddings, check_k, check_queries,
    meta_from_json, meta_to_json, plan_upsert,
)

META_KEY = "meta"
"""The one Chroma metadata key, holding the document's meta as JSON."""
SPACE = "cosine"


def _chromadb() -> Any:
    try:
        import chromadb
    except ImportError as e:
        raise ImportError("the chroma retriever needs the Chroma client: "
                          "pip install chromadb-client==1.5.9 (or chromadb==1.5.9)") from e
    return chromadb


class ChromaStore:
    """Documents in the collection ``collection`` of the Chroma server at
    ``host:port``, created (cosine space) if absent. An existing collection must use the
    cosine space and hold vectors of the embedder's dimension."""

    def __init__(self, embedder: Embedder, *, host: str = "127.0.0.1", port: int = 8000,
                 collection: str = "docs") -> None:
        chromadb = _chromadb()
        from chromadb.config import Settings

        self._embedder = embedder
        self._dim = int(embedder.dim)
        self._where = f"chroma collection {collection!r} at {host}:{port}"
        try:
            self._client = chromadb.HttpClient(
                host=host, port=port, settings=Settings(anonymized_telemetry=False))
        except ValueError as e:  # the client's way of saying nothing answered
            raise ConnectionError(f"no Chroma server answers at {host}:{port} ({e})") from e
        self._collection = self._client.get_or_create_collection(
            collection, configuration={"hnsw": {"space": SPACE}}, embedding_function=None)
        self._batch = int(self._client.get_max_batch_size())
        self._check_collection()

    def __len__(self) -> int:
        return int(self._collection.count())

    def add(self, docs: Sequence[Document]) -> None:
        """Upsert, in batches of the server's maximum. As in the embedded store, only
        documents that are new or whose text changed are embedded."""
        docs = check_documents(docs)
        for start in range(0, len(docs), self._batch):
            self._add_batch(docs[start : start + self._batch])

    def search(self, query: str, k: int = 3) -> list[Hit]:
        return self.search_many([query], k)[0]

    def search_many(self, queries: Sequence[str], k: int = 3) -> list[list[Hit]]:
        """One embedding call for all queries, then one query request per server batch."""
        queries, k = check_queries(queries), check_k(k)
        n = len(self)
        if not queries or n == 0:
            return [[] for _ in queries]
        vectors = self._embed(queries)
        out: list[list[Hit]] = []
        for start in range(0, len(queries), self._batch):
            result = self._collection.query(
                query_embeddings=vectors[start : start + self._batch], n_results=min(k, n),
                include=["documents", "metadatas", "distances"])
            out += [self._hits(*row) for row in zip(
                result["ids"], result["documents"], result["metadatas"], result["distances"])]
        return out

    # ----------------------------------------------------------------------- internals

    def _add_batch(self, docs: list[Document]) -> None:
        got = self._collection.get(ids=[d.id for d in docs], include=["documents", "metadatas"])
        stored = {i: (text, _meta_json(i, meta, self._where)) for i, text, meta
                  in zip(got["ids"], got["documents"], got["metadatas"])}
        plan = plan_upsert(docs, stored)
        if plan.embed:
            self._collection.upsert(
                ids=[d.id for d in plan.embed], embeddings=self._embed([d.text for d in plan.embed]),
                documents=[d.text for d in plan.embed],
                metadatas=[{META_KEY: meta_to_json(d)} for d in plan.embed])
        if plan.meta_only:
            self._collection.update(ids=[d.id for d in plan.meta_only],
                                    metadatas=[{META_KEY: meta_to_json(d)} for d in plan.meta_only])

    def _hits(self, ids: list[str], texts: list[str], metas: list[Any],
              distances: list[float]) -> list[Hit]:
        return [Hit(id=i, text=t, score=1.0 - float(d),
                    meta=meta_from_json(_meta_json(i, m, self._where)))
                for i, t, m, d in zip(ids, texts, metas, distances)]

    def _embed(self, texts: list[str]) -> np.ndarray:
        return check_embeddings(self._embedder.embed(texts), n=len(texts), dim=self._dim,
                                who=f"{self._where}: {type(self._embedder).__name__}")

    def _check_collection(self) -> None:
        config = self._collection.configuration_json  # the server's answer, not our config
        space = (config.get("hnsw") or config.get("spann") or {}).get("space")
        if space != SPACE:
            raise ValueError(f"{self._where} measures {space!r} distance; this store "
                             f"needs a {SPACE!r} collection (use another collection name)")
        sample = self._collection.get(limit=1, include=["embeddings"])
        if sample["ids"] and len(sample["embeddings"][0]) != self._dim:
            raise ValueError(f"{self._where} holds {len(sample['embeddings'][0])}-dimensional "
                             f"vectors; the embedder gives {self._dim}")


def _meta_json(doc_id: str, metadata: Any, where: str) -> str:
    """The meta JSON that :class:`ChromaStore` writes with every document."""
    if not isinstance(metadata, dict) or not isinstance(metadata.get(META_KEY), str):
        raise ValueError(f"{where}: document {doc_id!r} has no {META_KEY!r} metadata string; "
                         "the collection holds documents not written by ChromaStore")
    return metadata[META_KEY]
