"""The default retriever: an embedded vector store, FAISS for search and SQLite for what
persists.

Why FAISS (``faiss-cpu``) and not LanceDB: on this project's 2-core CI, ``faiss-cpu``
1.15.1 is one 65 MB wheel with no dependencies beyond numpy, installs in about a second and
imports in 0.05 s; ``lancedb`` 0.40.0 brings 188 MB with its dependencies and imports in
1.7 s. What LanceDB adds (columns, upserts, durability) is covered here by SQLite, which is
in the standard library. Search is exact (``IndexFlatIP``: inner product of L2-normalised
vectors, that is cosine similarity), batched over all queries in one call, which at the
corpus sizes of retrieval environments (up to a few hundred thousand passages) is fast and
needs no index training.

Layout of a store at ``PATH`` (a directory): ``PATH/store.sqlite3`` with a ``docs`` table
(row, id, text, meta as JSON, the float32 vector) and an ``info`` table (format version,
dimension, and the embedding of a fixed probe text). Reopening loads the stored vectors
into FAISS without embedding any document again, and embeds the probe to check that the
embedder is the one the store was built with. ``add`` embeds only documents that are new
or whose text changed, so re-adding a whole corpus to a persisted store is cheap.

An existing store file is checked when it is opened (:mod:`rltune.envs.retrieval.store_file`):
one that is damaged or not a store is a :class:`StoreError` naming the file, and is never
written over.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from rltune.envs.retrieval.store import (
    Document, Embedder, Hit, check_documents, check_embeddings, check_k, check_queries,
    meta_from_json, meta_to_json, plan_upsert,
)
from rltune.envs.retrieval.store_file import (
    DB_FILE, Info, StoreError, connect, create, load_vectors, probe_vector, read_info, rebuild_hint,
)

__all__ = ["DB_FILE", "FORMAT_VERSION", "EmbeddedStore", "StoreError"]

FORMAT_VERSION = 1
PROBE_TEXT = "The quick brown fox jumps over the lazy dog near the riverbank at dawn."
PROBE_MIN_COSINE = 0.999
"""The probe's embedding must match the stored one this closely on reopening (exactly
the same model differs only by floating-point noise across machines)."""
SQL_CHUNK = 500
"""Ids or rows per ``IN (...)`` query, below SQLite's limit on bound parameters."""
_UPSERT = """
INSERT INTO docs (row, id, text, meta, vec) VALUES (?, ?, ?, ?, ?)
ON CONFLICT(row) DO UPDATE SET text = excluded.text, meta = excluded.meta, vec = excluded.vec
"""


def _faiss() -> Any:
    try:
        import faiss
    except ImportError as e:
        raise ImportError("the embedded retriever needs FAISS: pip install faiss-cpu==1.15.1") from e
    return faiss


class EmbeddedStore:
    """Exact cosine search over upserted documents, in memory (``path=None``) or
    persisted in the directory ``path``. Safe to share between threads (one lock). An
    existing store file that cannot be read as a store is a :class:`StoreError`."""

    def __init__(self, embedder: Embedder, path: str | os.PathLike[str] | None = None) -> None:
        faiss = _faiss()
        self._embedder = embedder
        self._dim = int(embedder.dim)
        self._lock = threading.RLock()
        self._db, self._file, new = connect(path)
        self._where = "embedded store" if self._file is None else f"embedded store {self._file}"
        try:
            self._flat = faiss.IndexFlatIP(self._dim)
            self._index = faiss.IndexIDMap2(self._flat)
            self._check_embedder(new)
            self._next_row = self._load_vectors()
        except BaseException:
            self._db.close()
            if new and self._file is not None:  # the empty file this call made, not the user's
                self._file.unlink(missing_ok=True)
            raise

    def __len__(self) -> int:
        return int(self._index.ntotal)

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> EmbeddedStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------- writing

    def add(self, docs: Sequence[Document]) -> None:
        """Upsert. New documents and those whose text changed are embedded (one call for
        all of them); a change of meta alone is written without embedding."""
        docs = check_documents(docs)
        with self._lock:
            stored = self._stored(d.id for d in docs)
            plan = plan_upsert(docs, {i: (text, meta) for i, (_, text, meta) in stored.items()})
            vectors = self._embed([d.text for d in plan.embed])
            old_rows = [stored[d.id][0] for d in plan.embed if d.id in stored]
            rows = self._assign_rows(plan.embed, stored)
            with self._db:  # one transaction
                self._db.executemany(_UPSERT, [(row, d.id, d.text, meta_to_json(d), v.tobytes())
                                               for row, d, v in zip(rows, plan.embed, vectors)])
                self._db.executemany("UPDATE docs SET meta = ? WHERE id = ?",
                                     [(meta_to_json(d), d.id) for d in plan.meta_only])
            if old_rows:
                self._index.remove_ids(np.asarray(old_rows, dtype=np.int64))
            if rows:
                self._index.add_with_ids(vectors, np.asarray(rows, dtype=np.int64))

    def _assign_rows(self, docs: list[Document], stored: dict[str, tuple[int, str, str]],
                     ) -> list[int]:
        """A stored document keeps its row (the FAISS id); a new one takes the next free."""
        rows = []
        for doc in docs:
            if doc.id in stored:
                rows.append(stored[doc.id][0])
            else:
                rows.append(self._next_row)
                self._next_row += 1
        return rows

    # ----------------------------------------------------------------------- reading

    def search(self, query: str, k: int = 3) -> list[Hit]:
        return self.search_many([query], k)[0]

    def search_many(self, queries: Sequence[str], k: int = 3) -> list[list[Hit]]:
        """One embedding call and one FAISS search for all queries; ties in score come in
        FAISS's order."""
        queries, k = check_queries(queries), check_k(k)
        if not queries or len(self) == 0:
            return [[] for _ in queries]
        q_vectors = self._embed(queries)
        with self._lock:
            scores_Qk, rows_Qk = self._index.search(q_vectors, min(k, len(self)))
            docs = self._rows(np.unique(rows_Qk).tolist())
        return [[_hit(docs[r], s) for r, s in zip(rows, scores) if r >= 0]
                for rows, scores in zip(rows_Qk.tolist(), scores_Qk.tolist())]

    # ----------------------------------------------------------------------- internals

    def _embed(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self._dim), dtype=np.float32)
        return check_embeddings(self._embedder.embed(texts), n=len(texts), dim=self._dim,
                                who=f"{self._where}: {type(self._embedder).__name__}")

    def _stored(self, ids: Iterable[str]) -> dict[str, tuple[int, str, str]]:
        """id -> (row, text, meta JSON) of the given ids that are stored."""
        ids = list(ids)
        out: dict[str, tuple[int, str, str]] = {}
        for chunk in _chunks(ids):
            marks = ",".join("?" * len(chunk))
            for row, id_, text, meta in self._db.execute(
                    f"SELECT row, id, text, meta FROM docs WHERE id IN ({marks})", chunk):
                out[id_] = (row, text, meta)
        return out

    def _rows(self, rows: list[int]) -> dict[int, tuple[str, str, dict[str, Any]]]:
        """row -> (id, text, meta) for the given rows."""
        out = {}
        for chunk in _chunks([r for r in rows if r >= 0]):
            marks = ",".join("?" * len(chunk))
            for row, id_, text, meta in self._db.execute(
                    f"SELECT row, id, text, meta FROM docs WHERE row IN ({marks})", chunk):
                out[row] = (id_, text, meta_from_json(meta))
        return out

    def _check_embedder(self, new: bool) -> None:
        """Record the dimension and the probe's embedding in a new store; in an existing
        one, check that this embedder gives the same."""
        probe = self._embed([PROBE_TEXT])[0]
        if new:
            create(self._db, Info(format=FORMAT_VERSION, dim=self._dim, probe=probe.tobytes()))
            return
        info = read_info(self._db, self._where, self._file)
        if info.format != FORMAT_VERSION:
            raise StoreError(f"{self._where}: format {info.format}, this version reads "
                             f"{FORMAT_VERSION}; {rebuild_hint(self._file)}")
        if info.dim != self._dim:
            raise StoreError(f"{self._where} holds {info.dim}-dimensional vectors; the embedder "
                             f"gives {self._dim}. Open it with the embedder it was built with.")
        cosine = float(probe_vector(info, self._where, self._file) @ probe)
        if not cosine >= PROBE_MIN_COSINE:
            raise StoreError(f"{self._where} was built with a different embedder (probe cosine "
                             f"{cosine:.4f} < {PROBE_MIN_COSINE}). Open it with the embedder it "
                             "was built with, or build a new store.")

    def _load_vectors(self) -> int:
        """Put the stored vectors into FAISS, checked (:func:`load_vectors`); the next free
        row number."""
        rows, vectors = load_vectors(self._db, self._dim, self._where, self._file)
        if not rows:
            return 0
        self._index.add_with_ids(vectors, np.asarray(rows, dtype=np.int64))
        return rows[-1] + 1


def _hit(doc: tuple[str, str, dict[str, Any]], score: float) -> Hit:
    id_, text, meta = doc
    return Hit(id=id_, text=text, score=float(score), meta=meta)


def _chunks(items: list[Any]) -> Iterable[list[Any]]:
    for start in range(0, len(items), SQL_CHUNK):
        yield items[start : start + SQL_CHUNK]
