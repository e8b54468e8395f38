"""``builtin:lookup``: questions whose answers live only in a document store.

Each of 300 made-up names (consonant-vowel-consonant, e.g. ``kav``) has a random two-digit
code; the corpus holds one document per name (``"kav is 47"``) and a question asks
``code of kav?``. Nothing in the question or the model's training tells the code: a model
that answers without calling the search tool is right 1 time in 90; one that searches for
the right name is answered by the document store.

The environment of the recipes (``builtin:tools`` with ``answer_tools: [search]``) is a
search agent that answers with the passage it found: a search call ends the episode and
the result is the answer the reward scores. The skill is deciding to search and writing
the right query (copying the name into the call); reading the code back out of the
result and writing it again is a step a model of a few million parameters does not learn
within a CPU budget (tried: 600 steps of SFT on demonstrations of it left the copy at
chance), so the task does not ask for it.

Splits: ``train`` (240 questions) and ``eval`` (the other 60 names; their documents are in
the same corpus). ``train-demo`` holds 2000 demonstrations for a warm-up by SFT, in the
tool-call format of :mod:`rltune.envs.tool_format`: in ``DEMO_SEARCH_FRAC`` of them the
teacher calls search with the name, in the rest it guesses a code. They are about any of
the 980 possible names, so imitation learns to search and to copy the name, not this
corpus's codes. Imitation gives a policy that searches about as often as the teacher; a
reward for the right code teaches it to search always. :func:`lookup_documents` is the
corpus (rows ``id``, ``text``), named in a search spec as ``documents: builtin:lookup``.
"""

from __future__ import annotations

import json
import random

_SEED = 20261202
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
N_NAMES, N_EVAL = 300, 60
DEMO_SEARCH_FRAC = 0.5
N_DEMOS = 2000


def _all_names() -> list[str]:
    return [c1 + v + c2 for c1 in _CONSONANTS for v in _VOWELS for c2 in _CONSONANTS]


def _codes() -> dict[str, int]:
    rng = random.Random(_SEED)
    names = _all_names()
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
    if split == "train-demo":
        return _demonstrations()
    items = list(_codes().items())
    if split == "eval":
        chosen = items[:N_EVAL]
    elif split == "train":
        chosen = items[N_EVAL:]
    else:
        raise ValueError(f"unknown split {split!r}; this task has 'train', 'eval' and 'train-demo'")
    return [{"id": f"lookup/{name}", "prompt": f"code of {name}?", "answer": str(code)} for name, code in chosen]


def _demonstrations() -> list[dict[str, str]]:
    rng = random.Random(_SEED + 1)
    names = _all_names()
    rows = []
    for i in range(N_DEMOS):
        name, code = rng.choice(names), rng.randrange(10, 100)
        if rng.random() < DEMO_SEARCH_FRAC:
            completion = search_call(name)
        else:
            completion = str(rng.randrange(10, 100))
        rows.append({"id": f"lookup-demo/{i}", "prompt": f"code of {name}?", "answer": str(code), "completion": completion})
    return rows
