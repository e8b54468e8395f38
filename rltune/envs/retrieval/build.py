"""Building a retriever from a config mapping.

Kinds and their keys (defaults in :data:`RETRIEVERS`)::

    {"kind": "embedded", "path": None | DIR, "embedder": "minilm"}    # FAISS + SQLite
    {"kind": "bm25", "k1": 1.2, "b": 0.75}                            # keywords, in memory
    {"kind": "chroma", "host": "127.0.0.1", "port": 8000, "collection": "docs",
     "embedder": "minilm"}                                            # a Chroma server

Every kind also takes ``documents``: a JSONL corpus (see :func:`load_documents`) upserted
when the retriever is built; a persisted store embeds only what is new or changed. An
embedder is ``"minilm"``, ``"hashing"`` or a mapping with ``name`` and options (see
:data:`rltune.envs.retrieval.embedders.EMBEDDERS`). Relative paths are taken from
``base_dir`` (the directory of the config file that holds the spec), else from the
working directory.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rltune.envs.retrieval.bm25 import BM25Retriever
from rltune.envs.retrieval.documents import load_documents
from rltune.envs.retrieval.embedded import EmbeddedStore
from rltune.envs.retrieval.embedders import make_embedder
from rltune.envs.retrieval.server import ChromaStore
from rltune.envs.retrieval.spec import REQUIRED, Option, resolve_name, resolve_options
from rltune.envs.retrieval.store import Retriever

_OPTIONAL_PATH = (str, type(None))
_EMBEDDER = Option("minilm", (str, Mapping))
_COMMON = {"kind": Option(REQUIRED, (str,)), "documents": Option(None, _OPTIONAL_PATH)}

RETRIEVERS: dict[str, dict[str, Option]] = {
    "embedded": {**_COMMON, "path": Option(None, _OPTIONAL_PATH), "embedder": _EMBEDDER},
    "bm25": {**_COMMON, "k1": Option(1.2, (float, int)), "b": Option(0.75, (float, int))},
    "chroma": {
        **_COMMON,
        "host": Option("127.0.0.1", (str,)),
        "port": Option(8000, (int,)),
        "collection": Option("docs", (str,)),
        "embedder": _EMBEDDER,
    },
}
"""Retriever kind -> its config keys, with their defaults and accepted types."""


def build_retriever(spec: Mapping[str, Any], *, base_dir: str | None = None) -> Retriever:
    """The retriever ``spec`` describes, holding its ``documents`` if it names any.
    Unknown kinds and keys, values of the wrong type and bad embedder specs are
    ``ValueError``\\ s that name the bad key or value and list the valid ones."""
    if not isinstance(spec, Mapping):
        raise TypeError(f"a retrieval spec is a mapping, got {type(spec).__name__}")
    if "kind" not in spec:
        raise ValueError(f"retrieval spec has no 'kind'; valid kinds: {', '.join(sorted(RETRIEVERS))}")
    kind = resolve_name(spec["kind"], RETRIEVERS, what="retrieval kind")
    opts = resolve_options(spec, RETRIEVERS[kind], where=f"retrieval spec (kind {kind!r})")
    retriever = _make(kind, opts, base_dir)
    if opts["documents"] is not None:
        retriever.add(load_documents(_path(opts["documents"], base_dir)))
    return retriever


def _make(kind: str, opts: dict[str, Any], base_dir: str | None) -> Retriever:
    if kind == "bm25":
        return BM25Retriever(k1=opts["k1"], b=opts["b"])
    embedder = make_embedder(opts["embedder"], base_dir=base_dir, where=f"{kind} retriever's embedder")
    if kind == "embedded":
        path = None if opts["path"] is None else _path(opts["path"], base_dir)
        return EmbeddedStore(embedder, path)
    return ChromaStore(embedder, host=opts["host"], port=opts["port"], collection=opts["collection"])


def _path(path: str, base_dir: str | None) -> Path:
    return Path(base_dir or ".") / path
