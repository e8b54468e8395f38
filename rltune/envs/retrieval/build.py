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

A ``documents`` file that holds no documents (a failed export) is refused, naming it.
With ``create_empty=False`` (a search environment's retriever) an ``embedded`` ``path``
that holds no store is refused unless there are documents to build it from, and so is a
retriever that ends up holding no documents (an emptied store, an empty collection),
naming where they were to come from: it would answer every search with nothing. Only an
in-memory store given no documents at all may be empty (a deliberate control).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rltune.envs.retrieval.bm25 import BM25Retriever
from rltune.envs.retrieval.documents import CorpusError, load_documents
from rltune.envs.retrieval.embedded import DB_FILE, EmbeddedStore
from rltune.envs.retrieval.embedders import make_embedder
from rltune.envs.retrieval.server import ChromaStore
from rltune.envs.retrieval.spec import REQUIRED, Option, resolve_name, resolve_options
from rltune.envs.retrieval.store import Document, Retriever

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


def build_retriever(spec: Mapping[str, Any], *, base_dir: str | None = None,
                    corpus: Sequence[Document] | None = None, create_empty: bool = True) -> Retriever:
    """The retriever ``spec`` describes, holding its ``documents`` if it names any, and
    ``corpus`` (documents given in code, e.g. a built-in task's). Unknown kinds and keys,
    values of the wrong type and bad embedder specs are ``ValueError``\\ s that name the
    bad key or value and list the valid ones. ``create_empty=False``: see the module
    docstring."""
    if not isinstance(spec, Mapping):
        raise TypeError(f"a retrieval spec is a mapping, got {type(spec).__name__}")
    if "kind" not in spec:
        raise ValueError(f"retrieval spec has no 'kind'; valid kinds: {', '.join(sorted(RETRIEVERS))}")
    kind = resolve_name(spec["kind"], RETRIEVERS, what="retrieval kind")
    where = f"retrieval spec (kind {kind!r})"
    opts = resolve_options(spec, RETRIEVERS[kind], where=where)
    documents = None if opts["documents"] is None else _documents_file(opts["documents"], base_dir, where)
    rows = None if documents is None else _corpus(documents, opts["documents"], where)  # before any store
    if not create_empty and kind == "embedded" and opts["path"] is not None and documents is None \
            and corpus is None:
        _check_store_exists(opts["path"], base_dir, where)
    retriever = _make(kind, opts, base_dir)
    if rows is not None:
        retriever.add(rows)
    if corpus is not None:
        retriever.add(corpus)
    if not create_empty and len(retriever) == 0:
        _refuse_empty(retriever, kind, opts, base_dir, where, corpus is not None)
    return retriever


def resolve_path(path: str, base_dir: str | None) -> Path:
    """``path`` as written when absolute; a relative one from ``base_dir`` (the config
    file's directory), else from the working directory: the first of the two where it
    exists, as reward files are found, and the config's when it exists in neither (a
    store to build)."""
    given = Path(path).expanduser()
    if given.is_absolute():
        return given
    first = (Path(base_dir) if base_dir else Path.cwd()) / given
    if not first.exists() and (Path.cwd() / given).exists():
        return Path.cwd() / given
    return first


def _documents_file(path: str, base_dir: str | None, where: str) -> Path:
    """The corpus file ``documents: path`` names, which must exist."""
    resolved = resolve_path(path, base_dir)
    if not resolved.is_file():
        start = "" if Path(path).expanduser().is_absolute() else (
            " (a relative path starts at the config file's directory, then the working directory)" if base_dir
            else " (a relative path starts at the working directory)")
        raise CorpusError(f"{where}: documents {path!r}: no such corpus file {resolved}{start}")
    return resolved


def _corpus(path: Path, given: str, where: str) -> list[Document]:
    """The documents of the corpus file ``path``; one without any is refused."""
    rows = load_documents(path)
    if not rows:
        raise CorpusError(f"{where}: documents {given!r}: the corpus file {path} holds no documents "
                          "(a failed export?); give a JSONL file with one {\"id\", \"text\"} object per line")
    return rows


def _refuse_empty(retriever: Retriever, kind: str, opts: dict[str, Any], base_dir: str | None,
                  where: str, given_corpus: bool) -> None:
    """Refuse a search environment's retriever that holds no documents, naming where they
    were to come from; an in-memory store given none is a control, kept."""
    if kind == "embedded" and opts["path"] is not None:
        source = f"the store {resolve_path(opts['path'], base_dir) / DB_FILE}"
    elif kind == "chroma":
        source = f"the Chroma collection {opts['collection']!r} at {opts['host']}:{opts['port']}"
    elif given_corpus:
        source = "the documents given"
    else:
        return
    close = getattr(retriever, "close", None)
    if close is not None:
        close()
    raise ValueError(f"{where}: {source} holds no documents, so every search would find nothing; "
                     "give `documents:` (a JSONL corpus) to fill it")


def _check_store_exists(path: str, base_dir: str | None, where: str) -> None:
    """Refuse a store ``path`` that holds no store, which would be made empty."""
    store = resolve_path(path, base_dir)
    if not (store / DB_FILE).is_file():
        raise ValueError(f"{where}: path {path!r}: there is no store at {store} and no "
                         "`documents:` are given, so it would be made empty and every search would "
                         "find nothing; give `documents:` (a JSONL corpus) to build it there, or "
                         "the path of an existing store")


def _make(kind: str, opts: dict[str, Any], base_dir: str | None) -> Retriever:
    if kind == "bm25":
        return BM25Retriever(k1=opts["k1"], b=opts["b"])
    embedder = make_embedder(opts["embedder"], base_dir=base_dir, where=f"{kind} retriever's embedder")
    if kind == "embedded":
        path = None if opts["path"] is None else resolve_path(opts["path"], base_dir)
        return EmbeddedStore(embedder, path)
    return ChromaStore(embedder, host=opts["host"], port=opts["port"], collection=opts["collection"])
