"""Retrieval: top-k, BM25 against scores worked out by hand, the hashing and MiniLM
embedders, the embedded store (exact top-k, upserts, persistence), specs and corpora.

BM25 here is Okapi BM25 with the Lucene IDF, k1 = 1.2, b = 0.75 unless a test says
otherwise::

    idf(t) = ln(1 + (N - df + 0.5) / (df + 0.5))
    w(t, d) = idf(t) * tf * (k1 + 1) / (tf + k1 * (1 - b + b * |d| / avgdl))
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from rltune.envs.retrieval import (
    BM25Retriever, CorpusError, Document, EmbeddedStore, Embedder, HashingEmbedder, Hit,
    Retriever, build_retriever, load_documents, make_embedder,
)
from rltune.envs.retrieval.topk import top_k

# --------------------------------------------------------------------------- helpers


class Counting:
    """An embedder that records the texts it is asked to embed."""

    def __init__(self, inner: Embedder) -> None:
        self.inner, self.dim = inner, inner.dim
        self.calls: list[list[str]] = []

    def embed(self, texts):
        self.calls.append(list(texts))
        return self.inner.embed(texts)

    @property
    def texts(self) -> int:
        return sum(len(c) for c in self.calls)


class Reversed:
    """The hashing embedder with its coordinates reversed: same dimension, other vectors."""

    def __init__(self, dim: int) -> None:
        self.inner, self.dim = HashingEmbedder(dim), dim

    def embed(self, texts):
        return self.inner.embed(texts)[:, ::-1].copy()


class Broken:
    def __init__(self, vectors: np.ndarray) -> None:
        self.vectors, self.dim = vectors, vectors.shape[1]

    def embed(self, texts):
        return self.vectors


def ids(hits: list[Hit]) -> list[str]:
    return [h.id for h in hits]


HASH_DIM = 1 << 16  # large enough that the features below do not collide

# --------------------------------------------------------------------------- top-k


def test_top_k_orders_best_first_and_breaks_ties_by_column():
    scores = np.array([[1.0, 3.0, 3.0, 2.0, 3.0],
                       [5.0, 4.0, 3.0, 2.0, 1.0]])
    idx, val = top_k(scores, 2)
    assert idx.tolist() == [[1, 2], [0, 1]]  # three 3.0s tie at the cut: the first two stay
    assert val.tolist() == [[3.0, 3.0], [5.0, 4.0]]
    idx, _ = top_k(scores, 4)
    assert idx.tolist() == [[1, 2, 4, 3], [0, 1, 2, 3]]
    idx, val = top_k(scores, 9)  # k > N: every column, sorted
    assert idx.tolist() == [[1, 2, 4, 3, 0], [0, 1, 2, 3, 4]]
    assert val.tolist() == [[3.0, 3.0, 3.0, 2.0, 1.0], [5.0, 4.0, 3.0, 2.0, 1.0]]


def test_top_k_of_nothing():
    idx, val = top_k(np.zeros((2, 0)), 3)
    assert idx.shape == val.shape == (2, 0)


# --------------------------------------------------------------------------- hashing embedder


def cosine(embedder: Embedder, a: str, b: str) -> float:
    x, y = embedder.embed([a, b])
    return float(x @ y)


def test_hashing_embedder_cosines_count_shared_features():
    e = HashingEmbedder(HASH_DIM)
    # "a b" -> {a, b, "a b"}; "b a" -> {b, a, "b a"}: 2 shared of 3 each.
    assert cosine(e, "a b", "b a") == pytest.approx(2 / 3, abs=1e-6)
    # "a a" -> a twice and "a a" once: (2, 1) against (1, 0) -> 2 / sqrt(5).
    assert cosine(e, "a a", "a") == pytest.approx(2 / math.sqrt(5), abs=1e-6)
    assert cosine(e, "Cat, sat!", "cat sat") == pytest.approx(1.0, abs=1e-6)
    assert cosine(e, "cat", "dog") == pytest.approx(0.0, abs=1e-6)


def test_hashing_embedder_rows_are_unit_or_zero_and_deterministic():
    e = HashingEmbedder(64)
    x = e.embed(["the cat sat on the mat", "", "!!!", "dog"])
    assert x.dtype == np.float32 and x.shape == (4, 64)
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), [1.0, 0.0, 0.0, 1.0], atol=1e-6)
    np.testing.assert_array_equal(x, HashingEmbedder(64).embed(["the cat sat on the mat", "", "!!!", "dog"]))
    assert e.embed([]).shape == (0, 64)
    assert isinstance(e, Embedder)


def test_hashing_embedder_rejects_a_bad_dim():
    for dim in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="dim must be a positive int"):
            HashingEmbedder(dim)


# --------------------------------------------------------------------------- BM25

# a: "cat cat dog" (3 tokens), b: "dog bird" (2), c: "fish fish fish bird" (4); N = 3, avgdl = 3.
# df: cat 1, dog 2, bird 2, fish 1 -> idf(cat) = idf(fish) = ln(1 + 2.5/1.5) = ln(8/3) = 0.980829,
# idf(dog) = idf(bird) = ln(1 + 1.5/2.5) = ln(1.6) = 0.470004.
# Length factors k1 * (1 - b + b |d| / avgdl): a 1.2, b 1.2 * 0.75 = 0.9, c 1.2 * 1.25 = 1.5.
CAT_A = 0.980829 * (2 * 2.2) / (2 + 1.2)  # 1.348640
DOG_A = 0.470004 * 2.2 / (1 + 1.2)  # 0.470004
DOG_B = 0.470004 * 2.2 / (1 + 0.9)  # 0.544215
BIRD_B = DOG_B
BIRD_C = 0.470004 * 2.2 / (1 + 1.5)  # 0.413603
FISH_C = 0.980829 * (3 * 2.2) / (3 + 1.5)  # 1.438550


@pytest.fixture
def animals() -> BM25Retriever:
    r = BM25Retriever()
    r.add([Document("a", "cat cat dog"), Document("b", "Dog, bird."),
           Document("c", "fish fish fish bird", {"habitat": "water"})])
    return r


def test_bm25_scores_by_hand(animals):
    assert [(h.id, round(h.score, 6)) for h in animals.search("cat")] == [("a", round(CAT_A, 6))]
    assert animals.search("cat")[0].score == pytest.approx(1.348640, abs=1e-6)
    got = animals.search("dog bird", k=3)
    assert ids(got) == ["b", "a", "c"]
    assert [h.score for h in got] == pytest.approx([DOG_B + BIRD_B, DOG_A, BIRD_C], abs=1e-5)
    assert got[0].score == pytest.approx(1.088429, abs=1e-6)
    fish = animals.search("FISH")
    assert ids(fish) == ["c"] and fish[0].score == pytest.approx(FISH_C, abs=1e-5)
    assert fish[0].meta == {"habitat": "water"} and fish[0].text == "fish fish fish bird"


def test_bm25_counts_a_repeated_query_term_once_and_ignores_unknown_ones(animals):
    assert animals.search("cat cat zebra")[0].score == pytest.approx(CAT_A, abs=1e-5)
    assert animals.search("zebra") == []
    assert animals.search("") == []


def test_bm25_returns_only_matching_documents_even_when_k_is_larger(animals):
    assert ids(animals.search("dog", k=10)) == ["b", "a"]


def test_bm25_k1_zero_is_binary_idf_and_ties_come_in_insertion_order():
    r = BM25Retriever(k1=0.0)
    r.add([Document("a", "cat cat dog"), Document("b", "dog bird"), Document("c", "fish fish fish bird")])
    got = r.search("dog bird", k=3)
    assert ids(got) == ["b", "a", "c"]  # a and c tie at idf = ln 1.6
    assert [h.score for h in got] == pytest.approx([2 * 0.470004, 0.470004, 0.470004], abs=1e-6)


def test_bm25_upsert_replaces_the_text_and_updates_corpus_statistics(animals):
    animals.add([Document("c", "cat")])
    assert len(animals) == 3
    # a: "cat cat dog" (3), b: "dog bird" (2), c: "cat" (1); avgdl = 2, df(cat) = 2, idf = ln 1.6.
    # a: 0.470004 * 2 * 2.2 / (2 + 1.2 * (0.25 + 0.75 * 1.5)) = 0.566580
    # c: 0.470004 * 2.2 / (1 + 1.2 * (0.25 + 0.75 * 0.5)) = 0.590862
    got = animals.search("cat", k=5)
    assert ids(got) == ["c", "a"]
    assert [h.score for h in got] == pytest.approx([0.590862, 0.566580], abs=1e-6)
    assert animals.search("fish") == []
    assert got[0].meta == {}  # the new document's meta replaces the old one


def test_bm25_batch_equals_one_by_one(animals):
    queries = ["cat", "dog bird", "zebra", "fish bird"]
    assert animals.search_many(queries, k=2) == [animals.search(q, k=2) for q in queries]


def test_bm25_rejects_bad_parameters():
    with pytest.raises(ValueError, match="k1"):
        BM25Retriever(k1=-1)
    with pytest.raises(ValueError, match="b must be in"):
        BM25Retriever(b=1.5)


# --------------------------------------------------------------------------- embedded store

# Hashing features: "alpha" {alpha}; "alpha beta" {alpha, beta, "alpha beta"};
# "alpha beta gamma" {alpha, beta, gamma, "alpha beta", "beta gamma"}; "delta" {delta}.
# Cosines with the query "alpha": 1, 1/sqrt(3), 1/sqrt(5), 0.
LADDER = [Document("d0", "delta"), Document("a3", "alpha beta gamma"),
          Document("a1", "alpha", {"n": 1}), Document("a2", "alpha beta")]


@pytest.fixture
def ladder() -> EmbeddedStore:
    store = EmbeddedStore(HashingEmbedder(HASH_DIM))
    store.add(LADDER)
    return store


def test_embedded_store_exact_top_k(ladder):
    got = ladder.search("alpha", k=3)
    assert ids(got) == ["a1", "a2", "a3"]
    assert [h.score for h in got] == pytest.approx([1.0, 1 / math.sqrt(3), 1 / math.sqrt(5)], abs=1e-6)
    assert got[0] == Hit(id="a1", text="alpha", score=pytest.approx(1.0, abs=1e-6), meta={"n": 1})
    assert ids(ladder.search("delta", k=1)) == ["d0"]
    # "beta gamma" shares {beta, gamma, "beta gamma"} with a3 (3 / sqrt(3 * 5)) and {beta} with a2.
    got = ladder.search("beta gamma", k=2)
    assert ids(got) == ["a3", "a2"]
    assert [h.score for h in got] == pytest.approx([3 / math.sqrt(15), 1 / 3], abs=1e-6)


def test_embedded_store_k_larger_than_the_store_returns_every_document(ladder):
    got = ladder.search("alpha", k=10)
    assert ids(got)[:3] == ["a1", "a2", "a3"] and sorted(ids(got)) == ["a1", "a2", "a3", "d0"]


def test_embedded_store_batch_embeds_once_and_equals_one_by_one():
    embedder = Counting(HashingEmbedder(HASH_DIM))
    store = EmbeddedStore(embedder)
    store.add(LADDER)
    before = len(embedder.calls)
    queries = ["alpha", "beta gamma", "delta", "nothing here"]
    batch = store.search_many(queries, k=2)
    assert len(embedder.calls) == before + 1 and embedder.calls[-1] == queries
    assert batch == [store.search(q, k=2) for q in queries]


def test_embedded_store_upsert_semantics():
    embedder = Counting(HashingEmbedder(HASH_DIM))
    store = EmbeddedStore(embedder)
    store.add(LADDER)
    assert len(store) == 4
    embedder.calls.clear()
    store.add(LADDER)  # unchanged: nothing embedded, nothing added
    assert embedder.calls == [] and len(store) == 4
    store.add([Document("a1", "delta", {"n": 2}), Document("e", "epsilon")])
    assert embedder.calls == [["delta", "epsilon"]]  # the changed text and the new one
    assert len(store) == 5
    got = store.search("delta", k=2)
    assert ids(got) == ["d0", "a1"] or ids(got) == ["a1", "d0"]  # both are exactly "delta"
    assert {h.id: h.meta for h in got}["a1"] == {"n": 2}
    assert ids(store.search("alpha", k=2)) == ["a2", "a3"]  # a1 no longer says alpha
    embedder.calls.clear()
    store.add([Document("e", "epsilon", {"tag": "x"})])  # meta only: no embedding
    assert embedder.calls == []
    assert store.search("epsilon", k=1)[0].meta == {"tag": "x"}


def test_an_id_twice_in_one_add_is_an_error(ladder):
    for store in (ladder, BM25Retriever()):
        with pytest.raises(ValueError, match="'x' appears twice"):
            store.add([Document("x", "one"), Document("x", "two")])


def test_empty_stores_answer_with_no_hits(tmp_path):
    for store in (EmbeddedStore(HashingEmbedder(32)), EmbeddedStore(HashingEmbedder(32), tmp_path / "s"),
                  BM25Retriever()):
        assert len(store) == 0
        assert store.search("anything") == []
        assert store.search_many(["a", "b"], k=5) == [[], []]
        assert store.search_many([]) == []
        store.add([])
        assert len(store) == 0


@pytest.mark.parametrize("k", [0, -1, True, 2.0])
def test_a_bad_k_is_an_error(ladder, k):
    for store in (ladder, BM25Retriever()):
        with pytest.raises(ValueError, match="k must be a positive int"):
            store.search("alpha", k=k)


def test_search_many_refuses_a_bare_string(ladder):
    with pytest.raises(TypeError, match="one string"):
        ladder.search_many("alpha")


def test_stores_follow_the_protocol(ladder):
    assert isinstance(ladder, Retriever) and isinstance(BM25Retriever(), Retriever)


def test_documents_are_checked():
    with pytest.raises(ValueError, match="non-empty string"):
        Document("", "text")
    with pytest.raises(ValueError, match="text must be a string"):
        Document("x", None)  # type: ignore[arg-type]
    store = EmbeddedStore(HashingEmbedder(32))
    with pytest.raises(ValueError, match="'x': meta is not JSON-serialisable"):
        store.add([Document("x", "text", {"when": object()})])
    with pytest.raises(TypeError, match="not a Document"):
        store.add([("x", "text")])  # type: ignore[list-item]


def test_the_embedder_contract_is_enforced():
    with pytest.raises(ValueError, match="row 0 has L2 norm 2.000000"):
        EmbeddedStore(Broken(np.array([[2.0, 0.0]], dtype=np.float32)))
    with pytest.raises(ValueError, match=r"shape \(2, 2\), expected \(1, 2\)"):
        EmbeddedStore(Broken(np.eye(2, dtype=np.float32)))


# --------------------------------------------------------------------------- persistence


def test_the_store_reopens_without_embedding_its_documents(tmp_path):
    path = tmp_path / "store"
    with EmbeddedStore(HashingEmbedder(HASH_DIM), path) as store:
        store.add(LADDER)
        store.add([Document("a2", "alpha beta", {"v": 2})])
        expected = store.search_many(["alpha", "beta gamma"], k=4)
    embedder = Counting(HashingEmbedder(HASH_DIM))
    with EmbeddedStore(embedder, path) as store:
        assert embedder.texts == 1  # the probe that checks the embedder, no document
        assert len(store) == 4
        assert store.search_many(["alpha", "beta gamma"], k=4) == expected
        assert store.search("alpha beta", k=1)[0].meta == {"v": 2}
        store.add(LADDER[:1] + [Document("new", "omega")])
        assert embedder.calls[-1] == ["omega"]
    with EmbeddedStore(HashingEmbedder(HASH_DIM), path) as store:
        assert len(store) == 5 and ids(store.search("omega", k=1)) == ["new"]


def test_reopening_with_another_embedder_is_an_error(tmp_path):
    path = tmp_path / "store"
    EmbeddedStore(HashingEmbedder(64), path).add(LADDER)
    with pytest.raises(ValueError, match="holds 64-dimensional vectors; the embedder gives 32"):
        EmbeddedStore(HashingEmbedder(32), path)
    with pytest.raises(ValueError, match="built with a different embedder"):
        EmbeddedStore(Reversed(64), path)


def test_a_store_path_that_is_a_file_is_an_error(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        EmbeddedStore(HashingEmbedder(8), tmp_path / "f")


# --------------------------------------------------------------------------- corpora


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_documents_reads_ids_text_and_meta(tmp_path):
    path = write_lines(tmp_path / "c.jsonl", [
        json.dumps({"id": "1", "text": "alpha", "title": "A", "tags": ["x"]}), "",
        json.dumps({"text": "beta", "id": "2"})])
    assert load_documents(path) == [Document("1", "alpha", {"title": "A", "tags": ["x"]}),
                                    Document("2", "beta", {})]


def test_load_documents_keeps_line_separators_inside_strings(tmp_path):
    # JSON lets U+2028, U+2029 and U+0085 stand unescaped in a string; only "\n" ends a
    # line (a "\r" before it is whitespace), so the next row is still line 2
    text = "one\u2028two\u2029three\x85four"
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"id": "1", "text": text}, ensure_ascii=False) + "\r\n"
                    + '{"id": "1", "text": "again"}\n', encoding="utf-8")
    with pytest.raises(CorpusError, match=r"c.jsonl:2: id '1' already used on line 1"):
        load_documents(path)
    path.write_text(json.dumps({"id": "1", "text": text}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert load_documents(path) == [Document("1", text, {})]


@pytest.mark.parametrize("line, message", [
    ('{"id": "2", "text": ', r"c.jsonl:2: invalid JSON"),
    ('["2", "beta"]', r"c.jsonl:2: a row is a JSON object, got list"),
    ('{"id": "2"}', r"c.jsonl:2: missing 'text' \(row keys: id\)"),
    ('{"id": 2, "text": "beta"}', r"c.jsonl:2: 'id' must be a non-empty string, got 2"),
    ('{"id": "2", "text": 5}', r"c.jsonl:2: 'text' must be a string, got int"),
    ('{"id": "1", "text": "again"}', r"c.jsonl:2: id '1' already used on line 1"),
])
def test_load_documents_names_the_bad_line(tmp_path, line, message):
    path = write_lines(tmp_path / "c.jsonl", ['{"id": "1", "text": "alpha"}', line])
    with pytest.raises(CorpusError, match=message):
        load_documents(path)


def test_load_documents_missing_file(tmp_path):
    with pytest.raises(CorpusError, match="no such corpus file"):
        load_documents(tmp_path / "nope.jsonl")


# --------------------------------------------------------------------------- specs


def test_build_retriever_from_specs(tmp_path):
    write_lines(tmp_path / "corpus.jsonl", [json.dumps({"id": d.id, "text": d.text}) for d in LADDER])
    bm25 = build_retriever({"kind": "bm25", "k1": 0, "b": 0.5, "documents": "corpus.jsonl"},
                           base_dir=str(tmp_path))
    assert isinstance(bm25, BM25Retriever) and (bm25.k1, bm25.b) == (0.0, 0.5) and len(bm25) == 4
    spec = {"kind": "embedded", "path": "store", "documents": "corpus.jsonl",
            "embedder": {"name": "hashing", "dim": HASH_DIM}}
    store = build_retriever(spec, base_dir=str(tmp_path))
    assert isinstance(store, EmbeddedStore) and (tmp_path / "store" / "store.sqlite3").is_file()
    assert ids(store.search("alpha", k=3)) == ["a1", "a2", "a3"]
    memory = build_retriever({"kind": "embedded", "embedder": "hashing"})
    assert isinstance(memory, EmbeddedStore) and len(memory) == 0


@pytest.mark.parametrize("spec, error, message", [
    ({"kind": "embeded"}, ValueError,
     r"unknown retrieval kind 'embeded' \(did you mean 'embedded'\?\); valid: bm25, chroma, embedded"),
    ({"kind": 7}, ValueError, r"unknown retrieval kind 7; valid: bm25, chroma, embedded"),
    ({"path": "x"}, ValueError, r"no 'kind'; valid kinds: bm25, chroma, embedded"),
    ({"kind": "bm25", "k2": 1.0}, ValueError,
     r"kind 'bm25'\): unknown key 'k2' \(did you mean 'k1'\?\); valid keys: b, documents, k1, kind"),
    ({"kind": "bm25", "k1": True}, ValueError, r"'k1' must be float or int, got bool True"),
    ({"kind": "chroma", "port": "8000", "embedder": "hashing"}, ValueError,
     r"'port' must be int, got str '8000'"),
    ({"kind": "embedded", "embedder": "minilmm"}, ValueError,
     r"unknown embedded retriever's embedder name 'minilmm' \(did you mean 'minilm'\?\); valid: hashing, minilm"),
    ({"kind": "embedded", "embedder": {"dim": 8}}, ValueError, r"a mapping needs 'name'"),
    ({"kind": "embedded", "embedder": {"name": "hashing", "dims": 8}}, ValueError,
     r"embedder 'hashing': unknown key 'dims' \(did you mean 'dim'\?\); valid keys: dim"),
    ({"kind": "embedded", "embedder": 3}, ValueError, r"'embedder' must be str or Mapping, got int 3"),
    (["kind", "bm25"], TypeError, r"a retrieval spec is a mapping, got list"),
])
def test_bad_specs_name_the_key_and_the_valid_values(spec, error, message):
    with pytest.raises(error, match=message):
        build_retriever(spec)


def test_a_missing_corpus_names_the_resolved_path(tmp_path):
    with pytest.raises(CorpusError, match=str(tmp_path / "none.jsonl")):
        build_retriever({"kind": "bm25", "documents": "none.jsonl"}, base_dir=str(tmp_path))


# --------------------------------------------------------------------------- MiniLM

# Reference values from sentence-transformers 6.3.0 (its own Transformer -> mean Pooling ->
# Normalize pipeline) on the same model files.
MINILM_SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.",
                    "The girl is carrying a baby.", "A cheetah chases prey across a field."]
MINILM_COSINE_01 = 0.755337
MINILM_COSINE_02 = -0.1049584
MINILM_FIRST_4 = [0.03324157, 0.00440606, -0.00627699, 0.04837877]


def test_minilm_matches_sentence_transformers_and_ranks_meaning():
    embedder = make_embedder("minilm")
    x = embedder.embed(MINILM_SENTENCES)
    assert embedder.dim == 384 and x.shape == (4, 384) and x.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(x[0, :4], MINILM_FIRST_4, atol=1e-5)
    sims = x @ x.T
    assert sims[0, 1] == pytest.approx(MINILM_COSINE_01, abs=1e-4)
    assert sims[0, 2] == pytest.approx(MINILM_COSINE_02, abs=1e-4)
    # The two eating sentences are closer to each other than to either unrelated one.
    assert sims[0, 1] > max(sims[0, 2], sims[0, 3], sims[1, 2], sims[1, 3]) + 0.5
    # Batching and length-sorting do not change a text's embedding.
    np.testing.assert_allclose(embedder.embed(MINILM_SENTENCES[2:3])[0], x[2], atol=1e-5)
    store = EmbeddedStore(embedder)
    store.add([Document(str(i), s) for i, s in enumerate(MINILM_SENTENCES)])
    assert ids(store.search("someone eats bread", k=2)) == ["1", "0"]
