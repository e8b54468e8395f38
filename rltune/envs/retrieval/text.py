"""The word tokenizer shared by BM25 and the hashing embedder."""

from __future__ import annotations

import re

_WORD = re.compile(r"\w+")


def tokenize(text: str) -> list[str]:
    """Lower-cased runs of word characters (Unicode letters, digits, underscore); no
    stemming and no stop words, so that scores can be worked out by hand."""
    return _WORD.findall(text.lower())
