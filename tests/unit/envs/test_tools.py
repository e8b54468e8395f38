"""Tool calls in the chat-template convention, the built-in tools and ToolEnv."""

from __future__ import annotations

import pytest

from rltune.data.records import Prompt
from rltune.envs.loading import EnvLoadError, load_env_factory
from rltune.envs.tool_format import ToolCall, ToolCallError, format_tool_call, parse_tool_call
from rltune.envs.tools import ToolEnv, ToolError, calculator, tools_env

PROMPT = Prompt(id="p", text="?")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('<tool_call>\n{"name": "search", "arguments": {"query": "kav"}}\n</tool_call>', ToolCall("search", {"query": "kav"})),
        ('think first <tool_call>{"name":"calculator","arguments":{"expression":"1+1"}}</tool_call>', ToolCall("calculator", {"expression": "1+1"})),
        ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', ToolCall("f", {"x": 1})),  # arguments as a JSON string
        ('<tool_call>{"name": "a"}</tool_call> then <tool_call>{"name": "b"}</tool_call>', ToolCall("b", {})),  # the last call
        ("the answer is 42", None),
        ("<tool_call>{\"name\": \"a\"}", None),  # never closed: not a call
    ],
)
def test_parse_tool_call(text: str, expected: ToolCall | None) -> None:
    assert parse_tool_call(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<tool_call>{name: search}</tool_call>", "not valid JSON"),
        ('<tool_call>["search"]</tool_call>', 'a tool call is a JSON object {"name"'),
        ('<tool_call>{"name": "s", "arguments": [1]}</tool_call>', "arguments are not a JSON object"),
    ],
)
def test_bad_tool_calls_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ToolCallError, match=message):
        parse_tool_call(text)


def test_format_and_parse_round_trip() -> None:
    call = ToolCall("search", {"query": "código de kav"})
    assert parse_tool_call("x " + format_tool_call(call)) == call


@pytest.mark.parametrize(
    ("expression", "value"),
    [("6*7", "42"), ("2**10", "1024"), ("7/2", "3.5"), ("-(3 - 5) * 4", "8"), ("10 // 3", "3"),
     ("10 % 4", "2"), ("1/3", "0.333333333333"), ("0.1 + 0.2", "0.3"), ("4/2", "2")],
)
def test_calculator(expression: str, value: str) -> None:
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [("1/0", "division by zero"), ("2**100000", "power is too large"), ("10**99*10**99", "too large"),
     ("__import__('os')", "not arithmetic"), ("x + 1", "not arithmetic"), ("1 +", "cannot read"),
     ("9" * 300, "longer than 200")],
)
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression: str, message: str) -> None:
    with pytest.raises(ToolError, match=message):
        calculator(expression)


def test_tool_env_runs_calls_and_shows_tool_errors_to_the_model() -> None:
    env = ToolEnv({"calculator": calculator})
    assert env.reset(PROMPT) is None
    call = lambda name, args: format_tool_call(ToolCall(name, args))  # noqa: E731
    assert env.step(call("calculator", {"expression": "6*7"})).observation == "42"
    assert env.step(call("calculator", {"expression": "1/0"})).observation == "error: calculator: division by zero"
    assert env.step(call("calculator", {"expr": "1"})).observation == (
        "error: calculator: unknown argument 'expr'; missing argument 'expression' (its arguments: expression)")
    assert env.step(call("search", {"query": "x"})).observation == "error: unknown tool 'search' (tools: calculator)"
    assert env.step("<tool_call>{oops}</tool_call>").observation.startswith("error: the tool call is not valid JSON")
    final = env.step("42")
    assert final.done and final.observation is None and final.reward == 0.0
    assert env.calls == 4


def test_tool_env_treats_a_broken_tool_as_a_harness_failure() -> None:
    def broken(**_):
        raise RuntimeError("index corrupt")

    env = ToolEnv({"search": broken})
    with pytest.raises(RuntimeError, match="index corrupt"):
        env.step(format_tool_call(ToolCall("search", {"query": "q"})))


def test_builtin_search_over_the_lookup_corpus() -> None:
    env = tools_env(tools=["search"], search={"kind": "bm25", "documents": "builtin:lookup"})
    from rltune.data.tasks.lookup import lookup_documents

    doc = lookup_documents()[0]
    name = doc["id"]
    result = env.step(format_tool_call(ToolCall("search", {"query": name})))
    assert result.observation == doc["text"]
    assert env.step(format_tool_call(ToolCall("search", {"query": "zzzzz"}))).observation == "no results"


def test_env_specs_fail_early_with_the_reason(tmp_path) -> None:
    with pytest.raises(EnvLoadError, match="env spec 'builtin:toolz'.*did you mean 'tools'"):
        load_env_factory("builtin:toolz", {})
    with pytest.raises(EnvLoadError, match="unknown tools \\['abacus'\\]"):
        load_env_factory("builtin:tools", {"tools": ["abacus"]})
    with pytest.raises(EnvLoadError, match="the search tool needs `search:`"):
        load_env_factory("builtin:tools", {"tools": ["search"]})
    (tmp_path / "env.py").write_text("class NotAnEnv:\n    pass\n")
    with pytest.raises(EnvLoadError, match="made a NotAnEnv, which has no reset"):
        load_env_factory("env.py:NotAnEnv", {}, base_dir=tmp_path)
    make = load_env_factory("builtin:tools", {"tools": ["calculator"]})
    assert make() is not make()  # a fresh environment per episode


def test_python_tool_runs_in_the_sandbox() -> None:
    env = tools_env(tools=["python"], python={"timeout_s": 2.0})
    call = lambda code: format_tool_call(ToolCall("python", {"code": code}))  # noqa: E731
    assert env.step(call("print(6 * 7)")).observation == "42"
    assert "ZeroDivisionError" in env.step(call("1/0")).observation
    looped = env.step(call("while True: pass")).observation
    assert looped.endswith("[stopped: wall limit]") or looped.endswith("[stopped: cpu limit]")
    no_network = env.step(call("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)")).observation
    assert "Error" in no_network and "Traceback" in no_network


def test_an_answer_tool_ends_the_episode_with_its_result() -> None:
    env = ToolEnv({"calculator": calculator}, answer_tools=["calculator"])
    result = env.step(format_tool_call(ToolCall("calculator", {"expression": "6*7"})))
    assert result.done and result.observation == "42"
    with pytest.raises(ValueError, match="answer_tools \\['search'\\] are not among the tools"):
        ToolEnv({"calculator": calculator}, answer_tools=["search"])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tools": "calculator"}, r"`tools` must be a list of tool names, e.g. \[calculator\], not a string"),
    ({"answer_tools": "calculator"}, r"answer_tools must be a list of tool names"),
    ({"max_result_chars": -5}, r"max_result_chars must be an integer >= 1, got -5"),
    ({"max_result_chars": 0}, r"max_result_chars must be an integer >= 1, got 0"),
    ({"k": 0}, r"k must be a positive int, got 0"),
    ({"k": "2"}, r"k must be a positive int, got '2'"),
])
def test_tool_settings_are_checked_when_the_environment_is_built(kwargs, message):
    # each used to reach the episodes: letters read as tool names, results cut from the end,
    # or every search answering the model with the config's error
    from rltune.envs.tools import tools_env

    with pytest.raises(ValueError, match=message):
        tools_env(**kwargs)
