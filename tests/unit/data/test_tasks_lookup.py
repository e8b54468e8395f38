"""builtin:lookup: answers only in the corpus, disjoint splits, demonstrations laid out
exactly as the episode runner lays out a search turn for the tiny model's template."""

from __future__ import annotations

from rltune.data.tasks.lookup import lookup, lookup_documents, search_call
from rltune.envs.tool_format import ToolCall, parse_tool_call, turn_glue
from rltune.models.tiny import build_tokenizer


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


def test_demonstrations_match_the_runner_layout() -> None:
    glue = turn_glue(build_tokenizer())
    demos = lookup("train-demo")
    searched = [r for r in demos if r["completion"].startswith("<tool_call>")]
    assert 0.4 < len(searched) / len(demos) < 0.6
    for row in searched:
        name = row["prompt"][len("code of "):-1]
        call = search_call(name)
        assert parse_tool_call(call) == ToolCall("search", {"query": name})
        observation = glue.observation_text(f"{name} is {row['answer']}", ended_turn=False)
        assert row["completion"] == call + observation + row["answer"]
    guesses = [r for r in demos if r not in searched]
    assert all(r["completion"].isdigit() and len(r["completion"]) == 2 for r in guesses)
