"""Corpora and store files that cannot give a working search: each refused when the
retriever is built, with one line naming the file, what is wrong and what to do, and a
damaged store file never written over. A search environment never starts with a retriever
that holds no documents, unless it is an in-memory store given none (a control)."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from rltune.envs.loading import EnvLoadError, load_env_factory
from rltune.envs.retrieval import (
    CorpusError, EmbeddedStore, HashingEmbedder, StoreError, build_retriever, load_documents,
)

DIM = 64
HASHING = {"name": "hashing", "dim": DIM}


def _corpus(path: Path) -> Path:
    path.write_text("".join(json.dumps({"id": f"d{i}", "text": f"kav number {i}"}) + "\n" for i in range(3)))
    return path


def _store(tmp_path: Path) -> Path:
    """A good store of three documents; returns its file."""
    build_retriever({"kind": "embedded", "path": str(tmp_path / "store"), "embedder": HASHING,
                     "documents": str(_corpus(tmp_path / "docs.jsonl"))}).close()
    return tmp_path / "store" / "store.sqlite3"


def _sql(*statements: str, args: tuple = ()) -> Callable[[Path], None]:
    def damage(file: Path) -> None:
        db = sqlite3.connect(file)
        for statement in statements:
            db.execute(statement, args if "?" in statement else ())
        db.commit()
        db.close()
    return damage


def _bytes(data: bytes) -> Callable[[Path], None]:
    return lambda file: file.write_bytes(data)


NAN = np.full(DIM, np.nan, dtype=np.float32).tobytes()
LONG = np.ones(DIM, dtype=np.float32).tobytes()  # norm 8, not 1

DAMAGE = {
    "zero-bytes": (_bytes(b""), "the file is empty (0 bytes"),
    "not-a-database": (_bytes(b"hello " * 1000), "not a readable SQLite database (file is not a database)"),
    "docs-dropped": (_sql("DROP TABLE docs"), "no docs table"),
    "info-dropped": (_sql("DROP TABLE info"), "no info table"),
    "info-empty": (_sql("DELETE FROM info"), "the info table is empty (the store holds 3 documents but no format"),
    "info-and-docs-empty": (_sql("DELETE FROM info", "DELETE FROM docs"), "the info table is empty (the store holds no"),
    "format-text": (_sql("UPDATE info SET value = 'v1' WHERE key = 'format'"), "the info row 'format' is 'v1', not an integer"),
    "format-2": (_sql("UPDATE info SET value = '2' WHERE key = 'format'"), "format 2, this version reads 1"),
    "dim-text": (_sql("UPDATE info SET value = 'x' WHERE key = 'dim'"), "the info row 'dim' is 'x', not an integer"),
    "probe-missing": (_sql("DELETE FROM info WHERE key = 'probe'"), "the info table has no 'probe' row"),
    "probe-short": (_sql("UPDATE info SET value = x'0000' WHERE key = 'probe'"), "the stored probe has 2 bytes, expected 256"),
    "probe-nan": (_sql("UPDATE info SET value = ? WHERE key = 'probe'", args=(NAN,)), "the stored probe is not finite"),
    "vector-short": (_sql("UPDATE docs SET vec = x'000000' WHERE id = 'd1'"),
                     "document 'd1': its stored vector is 3 bytes, expected 256 bytes (64 float32)"),
    "vector-nan": (_sql("UPDATE docs SET vec = ? WHERE id = 'd2'", args=(NAN,)),
                   "document 'd2': its stored vector is not finite (NaN or inf)"),
    "vector-norm": (_sql("UPDATE docs SET vec = ? WHERE id = 'd0'", args=(LONG,)),
                    "document 'd0': its stored vector has L2 norm 8.000000, not 1"),
    "meta-not-json": (_sql("UPDATE docs SET meta = '{not json' WHERE id = 'd1'"), "document 'd1': its meta is not a JSON object"),
    "meta-a-list": (_sql("UPDATE docs SET meta = '[1]' WHERE id = 'd1'"), "document 'd1': its meta is not a JSON object"),
    "old-schema": (_sql("ALTER TABLE docs DROP COLUMN meta"), "the docs table has no column meta"),
}


@pytest.mark.parametrize("name", list(DAMAGE))
def test_a_damaged_store_file_is_refused_by_name_and_left_as_it_is(tmp_path, name):
    # each used to be a raw exception without the file (int(), KeyError, reshape, sqlite),
    # or silently empty or wrong (a 0-byte or emptied store initialised anew, a NaN vector
    # that never matches)
    damage, message = DAMAGE[name]
    file = _store(tmp_path)
    damage(file)
    before = file.read_bytes()
    for create_empty in (True, False):
        with pytest.raises(StoreError) as info:
            build_retriever({"kind": "embedded", "path": str(file.parent), "embedder": HASHING},
                            create_empty=create_empty)
        text = str(info.value)
        assert text.startswith(f"embedded store {file}") and message in text and "\n" not in text
        assert file.read_bytes() == before  # never initialised or written over
    assert text.endswith(f"; rebuild it: delete {file} and build the store again from its documents "
                         "(`documents:` in the search spec)")


def test_a_damaged_store_fails_the_environment_at_build(tmp_path):
    file = _store(tmp_path)
    _sql("UPDATE docs SET vec = ? WHERE id = 'd2'", args=(NAN,))(file)
    spec = {"kind": "embedded", "path": str(file.parent), "embedder": HASHING}
    with pytest.raises(EnvLoadError, match=f"StoreError: embedded store {file}: document 'd2'"):
        load_env_factory("builtin:tools", {"tools": ["search"], "search": spec})


def test_a_store_is_still_built_new_and_reopened(tmp_path):
    file = _store(tmp_path)
    store = EmbeddedStore(HashingEmbedder(DIM), file.parent)
    assert len(store) == 3 and store.search("kav number 2", k=1)[0].id == "d2"


# --------------------------------------------------------------------------- nothing to search


@pytest.mark.parametrize("kind", ["bm25", "embedded"])
def test_an_empty_corpus_file_is_refused_naming_it(tmp_path, kind):
    # a failed export used to train with every search answering "no results"
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    spec = {"kind": kind, "documents": "empty.jsonl", **({"embedder": HASHING} if kind == "embedded" else {})}
    with pytest.raises(CorpusError, match=f"documents 'empty.jsonl': the corpus file {empty} holds no documents"):
        build_retriever(spec, base_dir=str(tmp_path))
    with pytest.raises(EnvLoadError, match="holds no documents"):
        load_env_factory("builtin:tools", {"tools": ["search"], "search": spec}, base_dir=tmp_path)


def test_a_search_store_that_holds_no_documents_is_refused_naming_it(tmp_path):
    file = _store(tmp_path)
    _sql("DELETE FROM docs")(file)
    spec = {"kind": "embedded", "path": str(file.parent), "embedder": HASHING}
    with pytest.raises(EnvLoadError, match=f"the store {file} holds no documents, so every search would find nothing"):
        load_env_factory("builtin:tools", {"tools": ["search"], "search": spec})
    assert len(build_retriever(spec)) == 0  # build_retriever alone may open an empty store
    # an in-memory store given no documents is a control, kept
    make = load_env_factory("builtin:tools", {"tools": ["search"], "search": {"kind": "bm25"}})
    assert make().tools["search"]("kav") == "no results"


# --------------------------------------------------------------------------- corpora


def test_a_corpus_that_is_not_utf8_names_the_file_and_line(tmp_path):
    # a raw UnicodeDecodeError used to reach the user, without the file
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"id": "a", "text": "ok"}\n{"id": "b", "text": "caf\xe9"}\n')
    with pytest.raises(CorpusError, match=rf"^{path}:2: not UTF-8 \(byte 0xe9 at byte column 25\); save the corpus as UTF-8$"):
        load_documents(path)


def test_a_corpus_path_that_is_a_directory_is_a_corpus_error(tmp_path):
    with pytest.raises(CorpusError, match=f"^{tmp_path}: cannot read the corpus file"):
        load_documents(tmp_path)


def test_a_new_store_whose_embedder_fails_leaves_no_file_behind(tmp_path):
    # the empty file would otherwise be refused as a 0-byte store at the next start
    class Failing:
        dim = DIM

        def embed(self, texts):
            return np.full((len(texts), DIM), np.nan, dtype=np.float32)

    with pytest.raises(ValueError, match="embed\\(\\) returned non-finite values"):
        EmbeddedStore(Failing(), tmp_path / "store")
    assert not (tmp_path / "store" / "store.sqlite3").exists()
    assert len(EmbeddedStore(HashingEmbedder(DIM), tmp_path / "store")) == 0
