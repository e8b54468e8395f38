"""BM25 keyword retrieval, in memory, batched with numpy.

Okapi BM25 with the Lucene IDF (never negative)::

    idf(t)      = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))
    score(q, d) = sum over the distinct terms t of q of
                  idf(t) * tf(t, d) * (k1 + 1) / (tf(t, d) + k1 * (1 - b + b * |d| / avgdl))

N is the number of documents, df(t) how many contain t, tf(t, d) how often t occurs in d,
|d| the number of tokens of d and avgdl its mean over the corpus; defaults k1 = 1.2,
b = 0.75 (Lucene's, and Robertson & Zaragoza, "The Probabilistic Relevance Framework:
BM25 and Beyond", 2009). Tokens are :func:`rltune.envs.retrieval.text.tokenize`'s. A query
term repeated in the query counts once. Only documents sharing at least one term with the
query are returned (their score is > 0), so a search may return fewer than ``k`` hits;
equal scores come in insertion order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rltune.envs.retrieval.store import (
    Document, Hit, check_documents, check_k, check_queries,
)
from rltune.envs.retrieval.text import tokenize
from rltune.envs.retrieval.topk import top_k

MAX_SCORE_CELLS = 1 << 24
"""Queries are scored in groups whose dense ``[queries, documents]`` score matrix has at
most this many cells (128 MiB of float64)."""


@dataclass(frozen=True)
class _Postings:
    """Per-term posting lists in CSR form: the documents of term ``t`` are
    ``docs[indptr[t]:indptr[t + 1]]``, with their BM25 term weights in ``weight``."""

    indptr: np.ndarray  # [V + 1] int64
    docs: np.ndarray  # [P] int64
    weight: np.ndarray  # [P] float64


class BM25Retriever:
    """In-memory BM25 over upserted documents (see the module docstring for the formula).

    Corpus statistics change with every ``add``, so the posting lists are rebuilt, in one
    vectorised pass over all tokens, at the first search after a change.
    """

    def __init__(self, *, k1: float = 1.2, b: float = 0.75) -> None:
        if not k1 >= 0:
            raise ValueError(f"BM25 k1 must be >= 0, got {k1!r}")
        if not 0 <= b <= 1:
            raise ValueError(f"BM25 b must be in [0, 1], got {b!r}")
        self.k1, self.b = float(k1), float(b)
        self._docs: list[Document] = []
        self._terms: list[np.ndarray] = []  # term ids of each document's tokens
        self._position: dict[str, int] = {}
        self._vocab: dict[str, int] = {}
        self._postings: _Postings | None = None

    def __len__(self) -> int:
        return len(self._docs)

    def add(self, docs: Sequence[Document]) -> None:
        """Upsert: a stored id keeps its position (for tie order) and takes the new text."""
        for doc in check_documents(docs):
            terms = np.fromiter((self._term_id(t) for t in tokenize(doc.text)), dtype=np.int64)
            at = self._position.get(doc.id)
            if at is None:
                self._position[doc.id] = len(self._docs)
                self._docs.append(doc)
                self._terms.append(terms)
            else:
                self._docs[at], self._terms[at] = doc, terms
        self._postings = None

    def search(self, query: str, k: int = 3) -> list[Hit]:
        return self.search_many([query], k)[0]

    def search_many(self, queries: Sequence[str], k: int = 3) -> list[list[Hit]]:
        queries, k = check_queries(queries), check_k(k)
        if not self._docs:
            return [[] for _ in queries]
        postings = self._index()
        group = max(1, MAX_SCORE_CELLS // len(self._docs))
        out: list[list[Hit]] = []
        for start in range(0, len(queries), group):
            scores = self.scores(queries[start : start + group], postings)
            idx, val = top_k(scores, k)
            out += [self._hits(i_row, v_row) for i_row, v_row in zip(idx, val)]
        return out

    def scores(self, queries: Sequence[str], postings: _Postings | None = None) -> np.ndarray:
        """The dense ``[len(queries), len(self)]`` BM25 score matrix, in insertion order."""
        postings = postings if postings is not None else self._index()
        n = len(self._docs)
        q_of, term = self._query_terms(queries)
        start, stop = postings.indptr[term], postings.indptr[term + 1]
        lengths = stop - start
        # Gather the concatenated ranges [start, stop) of all (query, term) pairs at once.
        first = np.repeat(start - np.cumsum(lengths) + lengths, lengths)
        at = first + np.arange(int(lengths.sum()))
        flat = np.repeat(q_of, lengths) * n + postings.docs[at]
        summed = np.bincount(flat, weights=postings.weight[at], minlength=len(queries) * n)
        return summed.reshape(len(queries), n)

    # ----------------------------------------------------------------------- internals

    def _term_id(self, term: str) -> int:
        return self._vocab.setdefault(term, len(self._vocab))

    def _query_terms(self, queries: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(query index, term id) for each distinct known term of each query."""
        q_of: list[int] = []
        term: list[int] = []
        for i, query in enumerate(queries):
            ids = {self._vocab[t] for t in tokenize(query) if t in self._vocab}
            q_of += [i] * len(ids)
            term += sorted(ids)
        return np.asarray(q_of, dtype=np.int64), np.asarray(term, dtype=np.int64)

    def _index(self) -> _Postings:
        if self._postings is None:
            self._postings = build_postings(self._terms, len(self._vocab), k1=self.k1, b=self.b)
        return self._postings

    def _hits(self, idx: np.ndarray, val: np.ndarray) -> list[Hit]:
        docs = self._docs
        return [Hit(docs[i].id, docs[i].text, float(s), docs[i].meta)
                for i, s in zip(idx.tolist(), val.tolist()) if s > 0.0]


def build_postings(terms: Sequence[np.ndarray], vocab_size: int, *, k1: float, b: float) -> _Postings:
    """BM25 posting lists for documents given as arrays of term ids."""
    n = len(terms)
    lengths = np.array([len(t) for t in terms], dtype=np.int64)
    all_terms = np.concatenate(terms) if n else np.zeros(0, dtype=np.int64)
    doc_of = np.repeat(np.arange(n, dtype=np.int64), lengths)
    # One entry per distinct (term, document), sorted by term then document.
    key, tf = np.unique(all_terms * n + doc_of, return_counts=True)
    term, doc = key // max(n, 1), key % max(n, 1)
    df = np.bincount(term, minlength=vocab_size)
    idf = np.log1p((n - df + 0.5) / (df + 0.5))
    avgdl = lengths.mean() if n and lengths.sum() > 0 else 1.0
    norm = k1 * (1.0 - b + b * lengths[doc] / avgdl)
    weight = idf[term] * tf * (k1 + 1.0) / (tf + norm)
    indptr = np.concatenate([[0], np.cumsum(df)]).astype(np.int64)
    return _Postings(indptr=indptr, docs=doc, weight=weight)
