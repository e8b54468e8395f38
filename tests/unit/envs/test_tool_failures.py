"""Whose failure a tool call is: the model's (a bad call, arguments that do not fit, an
expression past the calculator's bounds), shown to it as ``error: ...``; or the harness's
(a broken search index, a failing embedder), which fails the episode unscored. And tool
settings that could never work, refused when the environment is built."""

from __future__ import annotations

import json

import pytest
import torch

from rltune.data.chat import encode_prompt
from rltune.data.records import Prompt, Rollout, SamplingParams
from rltune.envs.base import MAX_OBSERVATION_CHARS
from rltune.envs.episodes import EpisodeGenerator
from rltune.envs.loading import EnvLoadError, load_env_factory
from rltune.envs.retrieval import BM25Retriever, Document
from rltune.envs.tool_format import ToolCall, ToolCallError, format_tool_call, parse_tool_call, turn_glue
from rltune.envs.tools import ToolEnv, ToolError, ToolHarnessError, calculator, search_tool, tools_env
from rltune.models.tiny import build_tokenizer


def _call(name: str, **arguments) -> str:
    return format_tool_call(ToolCall(name, arguments))


class _BrokenIndex:
    """A retriever whose store is damaged: every search raises ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def search(self, query, k=3):
        raise self.error

    def __len__(self) -> int:
        return 1


# --------------------------------------------------------------------------- harness failures


@pytest.mark.parametrize("error", [
    json.JSONDecodeError("Expecting property name enclosed in double quotes", "{not json", 1),
    ValueError("embed() returned non-finite values"),
    TypeError("unsupported operand"),
])
def test_a_broken_index_is_a_harness_failure_not_the_models_error(error):
    # a ValueError from the store (corrupt meta, a bad embedding) used to reach the model as
    # "error: ..." and the episode was scored
    env = ToolEnv({"search": search_tool(_BrokenIndex(error))}, answer_tools=["search"])
    with pytest.raises(ToolHarnessError, match=rf"^search: the retriever failed: {type(error).__name__}: "):
        env.step(_call("search", query="kav"))


class _Calls:
    """A generator whose every turn is ``text`` and EOS."""

    version = 0

    def __init__(self, tok, text: str) -> None:
        self.tok, self.text = tok, text

    def generate(self, prompts, params):
        ids = self.tok(self.text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return [Rollout(prompt_id=p.id, group=0, prompt_ids=torch.tensor(p.input_ids),
                        completion_ids=torch.tensor(ids), completion_logprobs=torch.zeros(len(ids)),
                        loss_mask=torch.ones(len(ids)), text=self.text, finish_reason="stop", policy_version=0)
                for p in prompts]


def test_a_broken_index_fails_the_episode_unscored():
    tok = build_tokenizer()
    make = lambda: ToolEnv({"search": search_tool(_BrokenIndex(ValueError("bad vector")))})  # noqa: E731
    runner = EpisodeGenerator(_Calls(tok, _call("search", query="kav")), tok, make, glue=turn_glue(tok),
                              encode=lambda p: encode_prompt(tok, p), max_turns=2, max_total_tokens=400,
                              eos_ids=[tok.eos_token_id])
    prompt = Prompt(id="p", text="code of kav?")
    prompt.input_ids = encode_prompt(tok, prompt)
    [r] = runner.generate([prompt], SamplingParams(n=1, max_new_tokens=200))
    assert r.env_error == ("env: step raised ToolHarnessError: search: the retriever failed: ValueError: bad vector")
    assert r.env_reward is None


def test_a_custom_tools_value_or_type_error_is_the_models_and_others_the_harnesss():
    """A custom tool refuses the model's input with ValueError or TypeError (``int("five")``),
    as it always could; any other exception is the tool's own failure."""
    def lookup(key: str) -> str:
        return str(int(key))

    def crashing(key: str) -> str:
        raise RuntimeError("the table is corrupt")

    env = ToolEnv({"lookup": lookup, "crashing": crashing})
    assert env.step(_call("lookup", key="five")).observation == (
        "error: invalid literal for int() with base 10: 'five'")
    with pytest.raises(RuntimeError, match="the table is corrupt"):
        env.step(_call("crashing", key="a"))


# --------------------------------------------------------------------------- the model's errors


def test_arguments_that_do_not_fit_the_tool_are_the_models_error():
    def lookup(key: str, *, exact: bool = False) -> str:
        return key

    env = ToolEnv({"lookup": lookup, "search": search_tool(BM25Retriever())})
    assert env.step(_call("lookup")).observation == (
        "error: lookup: missing argument 'key' (its arguments: key, exact)")
    assert env.step(_call("lookup", key="a", fuzzy=1)).observation == (
        "error: lookup: unknown argument 'fuzzy' (its arguments: key, exact)")
    assert env.step(_call("lookup", key="a", exact=True)).observation == "a"
    assert env.step(_call("search", query=3)).observation == "error: search: `query` must be a non-empty string"
    assert env.step(_call("search", q="kav")).observation == (
        "error: search: unknown argument 'q'; missing argument 'query' (its arguments: query)")


def test_tool_errors_are_cut_like_results():
    def loud() -> str:
        raise ToolError("x" * 5000)

    assert len(ToolEnv({"loud": loud}, max_result_chars=100).step(_call("loud")).observation) == 100


@pytest.mark.parametrize(("expression", "message"), [
    ("1e300**2", "too large"),   # a float power past float range: OverflowError
    ("1e6**64", "too large"),
    ("1e99*10.0**60", "too large"),
    ("1e999", "too large"),     # inf, as a literal
    ("1" + "0" * 150, "too large"),  # an integer literal past the bound
    ("-1e999", "too large"),
])
def test_the_calculators_bounds_are_the_models_error(expression, message):
    # OverflowError used to escape the tool and fail the episode as the harness's error,
    # and 1e999 answered "inf"
    with pytest.raises(ToolError, match=message):
        calculator(expression)
    observation = ToolEnv({"calculator": calculator}).step(_call("calculator", expression=expression)).observation
    assert observation.startswith("error: calculator:") and message in observation


def test_numbers_within_the_bounds_still_work():
    assert calculator("1e100") == "1e+100"
    assert calculator("1e6**16") == "1e+96"
    assert calculator("2**64") == str(2**64)


@pytest.mark.parametrize(("text", "message"), [
    ("<tool_call>" + "[" * 100_000 + "</tool_call>", "nested too deeply"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}, "x": ' + "1" * 5000 + "}</tool_call>",
     "an integer of more than 4300 digits"),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": ' + "1" * 5000 + '}"}</tool_call>',
     "an integer of more than 4300 digits"),
])
def test_tool_call_json_past_the_parsers_limits_is_the_models_error(text, message):
    # a RecursionError and json's ValueError used to escape parse_tool_call
    with pytest.raises(ToolCallError, match=message):
        parse_tool_call(text)
    assert ToolEnv({"calculator": calculator}).step(text).observation == f"error: {parse_error(text)}"


def parse_error(text: str) -> str:
    try:
        parse_tool_call(text)
    except ToolCallError as exc:
        return str(exc)
    raise AssertionError("no error")


# --------------------------------------------------------------------------- settings at build time


@pytest.mark.parametrize("timeout", [0.01, 0.5, 0, -1, float("nan"), True, "5"])
def test_a_python_timeout_below_what_the_sandbox_can_start_in_is_refused(timeout):
    # 0.01 s used to be accepted, then every call failed as a harness error
    with pytest.raises(ValueError, match=r"python tool: timeout_s must be a number of seconds >= 1.0 "
                                         r"\(the sandbox's start-up counts against it"):
        tools_env(tools=["python"], python={"timeout_s": timeout})
    with pytest.raises(EnvLoadError, match="timeout_s must be a number of seconds >= 1.0"):
        load_env_factory("builtin:tools", {"tools": ["python"], "python": {"timeout_s": timeout}})


def test_max_result_chars_is_at_most_the_observation_bound():
    ToolEnv({"calculator": calculator}, max_result_chars=MAX_OBSERVATION_CHARS)
    with pytest.raises(ValueError, match=f"max_result_chars must be at most {MAX_OBSERVATION_CHARS}"):
        ToolEnv({"calculator": calculator}, max_result_chars=MAX_OBSERVATION_CHARS + 1)


def test_a_tool_whose_signature_cannot_be_read_is_refused():
    with pytest.raises(ValueError, match=r"tool 'x' is not callable \(got int\); a tool is a function"):
        ToolEnv({"x": 3})  # type: ignore[dict-item]


def test_a_search_over_documents_still_answers():
    retriever = BM25Retriever()
    retriever.add([Document("1", "kav is 47")])
    assert ToolEnv({"search": search_tool(retriever)}).step(_call("search", query="kav")).observation == "kav is 47"
