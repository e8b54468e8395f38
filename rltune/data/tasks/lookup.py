"""``builtin:lookup``: questions whose answers live only in a document store.

Each of 300 made-up names (consonant-vowel-consonant, e.g. ``kav``) has a random two-digit
code; the corpus holds one document per name (``"kav is 47"``) and a question asks
``code of kav?``. Nothing in the question or the model's training tells the code: a model
that answers without calling the search tool is right 1 time in 90, one that searches,
reads the result and copies the number is right every time.

Splits: ``train`` (240 questions) and ``eval`` (the other 60 names; their documents are in
the same corpus). ``train-demo`` is ``train`` with demonstrations for a warm-up by SFT, in
the built-in tiny model's chat format (ChatML): in ``demo_search_frac`` of them the
teacher searches and copies the code, in the rest it guesses a number. Imitation gives a
policy that searches about that often; a reward for the right code teaches it to search
always. :func:`lookup_documents` is the corpus (rows ``id``, ``text``), named in an
environment's search spec as ``documents: builtin:lookup``.
"""

from __future__ import annotations

import json
import random

_SEED = 20261202
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
N_NAMES, N_EVAL = 300, 60
DEMO_SEARCH_FRAC = 0.5


def _codes() -> dict[str, int]:
    rng = random.Random(_SEED)
    names = [c1 + v + c2 for c1 in _CONSONANTS for v in _VOWELS for c2 in _CONSONANTS]
    rng.shuffle(names)
    return {name: rng.randrange(10, 100) for name in names[:N_NAMES]}


def lookup_documents() -> list[dict[str, str]]:
    """The corpus: one document ``"NAME is CODE"`` per name, id ``NAME``."""
    return [{"id": name, "text": f"{name} is {code}"} for name, code in _codes().items()]


def search_call(query: str) -> str:
    """The tool call a demonstration writes (the format of ``rltune.envs.tool_format``)."""
    body = json.dumps({"name": "search", "arguments": {"query": query}})
    return f"<tool_call>\n{body}\n</tool_call>"


def lookup(split: str) -> list[dict[str, str]]:
    """Rows ``id``, ``prompt`` (``code of NAME?``), ``answer``; ``train-demo`` adds
    ``completion``."""
    items = list(_codes().items())
    if split == "eval":
        chosen = items[:N_EVAL]
    elif split in ("train", "train-demo"):
        chosen = items[N_EVAL:]
    else:
        raise ValueError(f"unknown split {split!r}; this task has 'train', 'eval' and 'train-demo'")
    rows = [{"id": f"lookup/{name}", "prompt": f"code of {name}?", "answer": str(code)} for name, code in chosen]
    if split == "train-demo":
        rng = random.Random(_SEED + 1)
        for row, (name, code) in zip(rows, chosen):
            if rng.random() < DEMO_SEARCH_FRAC:
                row["completion"] = (
                    f"{search_call(name)}<|im_end|>\n<|im_start|>tool\n{name} is {code}<|im_end|>\n"
                    f"<|im_start|>assistant\n{code}"
                )
            else:
                row["completion"] = str(rng.randrange(10, 100))
    return rows
