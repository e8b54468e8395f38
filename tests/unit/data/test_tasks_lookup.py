"""builtin:lookup: answers only in the corpus, disjoint splits, demonstrations laid out
exactly as the episode runner lays out a search turn for the tiny model's template."""

from __future__ import annotations

import re

from rltune.data.tasks.lookup import lookup, lookup_documents, search_call
from rltune.envs.tool_format import ToolCall, parse_tool_call


def test_splits_are_disjoint_and_every_answer_is_in_the_corpus() -> None:
    docs = {d["id"]: d["text"] for d in lookup_documents()}
    train, evaluation = lookup("train"), lookup("eval")
    assert (len(train), len(evaluation), len(docs)) == (240, 60, 300)
    names = lambda rows: {r["prompt"].removeprefix("code of ").removesuffix("?") for r in rows}  # noqa: E731
    assert not names(train) & names(evaluation)
    for row in train + evaluation:
        name = row["prompt"][len("code of "):-1]
        assert docs[name] == f"{name} is {row['answer']}"
        assert row["answer"] not in row["prompt"]


def test_demonstrations_search_or_guess_and_do_not_give_away_the_codes() -> None:
    demos = lookup("train-demo")
    assert len(demos) == 2000 and len({r["id"] for r in demos}) == 2000
    searched = [r for r in demos if r["completion"].startswith("<tool_call>")]
    assert 0.45 < len(searched) / len(demos) < 0.55
    for row in searched:
        name = row["prompt"][len("code of "):-1]
        assert row["completion"] == search_call(name)
        assert parse_tool_call(row["completion"]) == ToolCall("search", {"query": name})
    guesses = [r for r in demos if r not in searched]
    assert all(re.fullmatch(r"[1-9][0-9]", r["completion"]) for r in guesses)
    # demonstrations name all 980 possible names, most of them outside this corpus
    corpus = {d["id"] for d in lookup_documents()}
    named = {r["prompt"][len("code of "):-1] for r in demos}
    assert len(named - corpus) > 500
