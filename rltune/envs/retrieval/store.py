"""The retrieval interface: documents, hits, the :class:`Retriever` and :class:`Embedder`
protocols, and the checks every implementation shares.

A retriever holds documents keyed by id. ``add`` upserts (a document whose id is already
stored replaces it), ``search`` returns at most ``k`` hits best first, and ``search_many``
answers a batch of queries in one pass (one embedding call for all of them). Scores are
"higher is better" and comparable only within one retriever: cosine similarity for the
vector stores, the BM25 score for :mod:`rltune.envs.retrieval.bm25`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

NORM_TOLERANCE = 1e-3
"""How far from 1 an embedding's L2 norm may be (0 is allowed too: a text with nothing to
embed). Inner-product search equals cosine search only on unit vectors."""


@dataclass(frozen=True)
class Document:
    """One retrievable text. ``meta`` is any JSON-serialisable mapping (source, title,
    answer, ...); it comes back unchanged in every :class:`Hit` of the document."""

    id: str
    text: str
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"Document.id must be a non-empty string, got {self.id!r}")
        if not isinstance(self.text, str):
            raise ValueError(f"Document {self.id!r}: text must be a string, "
                             f"got {type(self.text).__name__}")
        if not isinstance(self.meta, Mapping):
            raise ValueError(f"Document {self.id!r}: meta must be a mapping, "
                             f"got {type(self.meta).__name__}")


@dataclass(frozen=True)
class Hit:
    """One search result: the document's fields and its score (higher is better)."""

    id: str
    text: str
    score: float
    meta: Mapping[str, Any]


@runtime_checkable
class Retriever(Protocol):
    """A document store that answers text queries."""

    def add(self, docs: Sequence[Document]) -> None:
        """Upsert by id: a stored id is replaced, a new one is added."""
        ...

    def search(self, query: str, k: int = 3) -> list[Hit]:
        """At most ``k`` hits, best first."""
        ...

    def search_many(self, queries: Sequence[str], k: int = 3) -> list[list[Hit]]:
        """``search`` for each query, computed as one batch."""
        ...

    def __len__(self) -> int:
        """The number of stored documents."""
        ...


@runtime_checkable
class Embedder(Protocol):
    """Texts to vectors whose inner product is their similarity."""

    dim: int

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """``[N, dim]`` float32, each row L2-normalised."""
        ...


# --------------------------------------------------------------------------- shared checks


def check_k(k: int) -> int:
    """``k`` as given, or a ``ValueError`` when it is not a positive int."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    return k


def check_queries(queries: Sequence[str]) -> list[str]:
    """The queries as a list; a bare string (which would search each character) and
    non-string items are errors."""
    if isinstance(queries, str):
        raise TypeError("search_many takes a sequence of queries, got one string; "
                        "use search(query) or search_many([query])")
    out = list(queries)
    for i, q in enumerate(out):
        if not isinstance(q, str):
            raise TypeError(f"query {i} must be a string, got {type(q).__name__}")
    return out


def check_documents(docs: Sequence[Document]) -> list[Document]:
    """The documents as a list; non-documents and an id given twice in one call are
    errors (which of the two should win is not obvious, so neither does)."""
    out = list(docs)
    seen: set[str] = set()
    for i, doc in enumerate(out):
        if not isinstance(doc, Document):
            raise TypeError(f"item {i} of add() is a {type(doc).__name__}, not a Document")
        if doc.id in seen:
            raise ValueError(f"document id {doc.id!r} appears twice in one add() call")
        seen.add(doc.id)
    return out


def check_embeddings(vectors: Any, *, n: int, dim: int, who: str) -> np.ndarray:
    """``vectors`` as a C-contiguous float32 ``[n, dim]`` array, after checking the
    :class:`Embedder` contract: shape, finite values, unit (or zero) rows."""
    arr = np.ascontiguousarray(vectors, dtype=np.float32)
    if arr.shape != (n, dim):
        raise ValueError(f"{who}: embed() returned shape {arr.shape}, expected ({n}, {dim})")
    if not np.isfinite(arr).all():
        raise ValueError(f"{who}: embed() returned non-finite values")
    norms = np.linalg.norm(arr, axis=1)
    bad = ~((np.abs(norms - 1.0) <= NORM_TOLERANCE) | (norms == 0.0))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{who}: embed() row {i} has L2 norm {norms[i]:.6f}; "
                         "an Embedder returns L2-normalised rows")
    return arr


def meta_to_json(doc: Document) -> str:
    """``doc.meta`` as canonical JSON (sorted keys), the form the stores keep."""
    try:
        return json.dumps(dict(doc.meta), sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"document {doc.id!r}: meta is not JSON-serialisable ({e})") from e


def meta_from_json(text: str) -> dict[str, Any]:
    return json.loads(text)


@dataclass(frozen=True)
class UpsertPlan:
    """What an ``add`` call changes: documents to (re-)embed because they are new or
    their text changed, and documents whose meta alone changed."""

    embed: list[Document]
    meta_only: list[Document]


def plan_upsert(docs: Sequence[Document], stored: Mapping[str, tuple[str, str]]) -> UpsertPlan:
    """Compare ``docs`` with what is stored (id -> (text, meta JSON)). A document stored
    with the same text and meta is left alone, so re-adding a corpus to a persisted store
    embeds only what changed."""
    embed, meta_only = [], []
    for doc in docs:
        old = stored.get(doc.id)
        if old is None or old[0] != doc.text:
            embed.append(doc)
        elif old[1] != meta_to_json(doc):
            meta_only.append(doc)
    return UpsertPlan(embed=embed, meta_only=meta_only)
