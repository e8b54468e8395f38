"""Tools and the environment that lets a model call them.

A tool is a plain function ``tool(**arguments) -> str``: the model's call
``{"name": NAME, "arguments": {...}}`` becomes ``tools[NAME](**arguments)`` and the string
it returns is the observation. Arguments that do not fit the tool's signature (a missing
or an unknown one) are refused before the call, and a tool that cannot do what was asked
raises :class:`ToolError`: either way the message is shown to the model, which may try
again. Anything else a tool raises (a TypeError or ValueError included: a broken search
index, an embedder that fails) is a harness failure, and the episode is not scored.

Built in: :func:`calculator` (arithmetic, evaluated on the syntax tree, bounded),
:func:`python_tool` (code run in :mod:`rltune.sandbox`), and :func:`search_tool` over any
:class:`~rltune.envs.retrieval.Retriever`. :func:`tools_env` is the ``builtin:tools``
environment factory.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rltune.data.records import Prompt
from rltune.envs.base import MAX_OBSERVATION_CHARS, StepResult
from rltune.envs.retrieval.store import check_k
from rltune.envs.tool_format import ToolCallError, parse_tool_call
from rltune.rewards.keyed_cache import KeyedCache

_MAX_RESULT_CHARS = 2000
MIN_PYTHON_TIMEOUT_S = 1.0
"""The shortest ``timeout_s`` of the python tool: the sandbox's start-up counts against
its wall clock (about 0.05 s on an idle machine, more under load), and its CPU limit is
whole seconds, so a shorter one would fail or not mean what it says."""


class ToolError(Exception):
    """A tool could not do what the call asked; the message goes to the model."""


class ToolHarnessError(RuntimeError):
    """A built-in tool's machinery failed (the search index or its embedder, the sandbox),
    not the model's call: it fails the episode unscored instead of reaching the model."""


class ToolEnv:
    """An episode in which each assistant turn may call one tool. A turn without a call is
    the final answer and ends the episode; every step's reward is 0 (score the answer with
    a reward function). Results and error messages longer than ``max_result_chars`` (at
    most :data:`~rltune.envs.base.MAX_OBSERVATION_CHARS`) are cut. A call of one of
    ``answer_tools`` ends the episode with its result as the answer (see
    :class:`~rltune.envs.base.StepResult`): a search agent that answers with the passage
    it found. :class:`ToolError`, ``TypeError`` and ``ValueError`` (a custom tool's way
    to refuse the model's input, e.g. ``int("five")``) and arguments that do not fit a
    tool's signature are shown to the model; anything else a tool raises propagates (a
    harness failure), as does a built-in tool's broken machinery (:class:`ToolHarnessError`)."""

    def __init__(
        self, tools: Mapping[str, Callable[..., str]], *, max_result_chars: int = _MAX_RESULT_CHARS,
        answer_tools: Sequence[str] = (),
    ) -> None:
        if not tools:
            raise ValueError("ToolEnv needs at least one tool")
        if isinstance(answer_tools, str):  # a bare name would be read letter by letter
            raise ValueError(f"answer_tools must be a list of tool names, e.g. [{answer_tools}], not a string")
        if isinstance(max_result_chars, bool) or not isinstance(max_result_chars, int) or max_result_chars < 1:
            raise ValueError(f"max_result_chars must be an integer >= 1, got {max_result_chars!r}")
        if max_result_chars > MAX_OBSERVATION_CHARS:
            raise ValueError(f"max_result_chars must be at most {MAX_OBSERVATION_CHARS} (the most "
                             f"characters an observation may have), got {max_result_chars!r}")
        unknown = sorted(set(answer_tools) - set(tools))
        if unknown:
            raise ValueError(f"answer_tools {unknown} are not among the tools {sorted(tools)}")
        self.tools = dict(tools)
        self._signatures = {name: _signature(name, tool) for name, tool in self.tools.items()}
        self.answer_tools = frozenset(answer_tools)
        self.max_result_chars = max_result_chars
        self.calls = 0

    def reset(self, prompt: Prompt) -> None:
        self.calls = 0
        return None

    def step(self, action: str) -> StepResult:
        try:
            call = parse_tool_call(action)
        except ToolCallError as exc:
            return self._error(str(exc))
        if call is None:
            return StepResult(done=True)
        self.calls += 1
        tool = self.tools.get(call.name)
        if tool is None:
            return self._error(f"unknown tool {call.name!r} (tools: {', '.join(sorted(self.tools))})")
        wrong = _argument_error(call.name, self._signatures[call.name], call.arguments)
        if wrong is not None:
            return self._error(wrong)
        try:
            result = tool(**call.arguments)
        except (ToolError, TypeError, ValueError) as exc:  # the model's mistake; anything else is the harness's
            return self._error(str(exc))
        if not isinstance(result, str):
            raise TypeError(f"tool {call.name!r} returned {type(result).__name__}, not str")
        return StepResult(observation=result[: self.max_result_chars], done=call.name in self.answer_tools)

    def _error(self, message: str) -> StepResult:
        """The observation that shows the model its call failed."""
        return StepResult(observation=f"error: {message}"[: self.max_result_chars])


def _signature(name: str, tool: Callable[..., str]) -> inspect.Signature:
    """``tool``'s signature, read once, to check the model's arguments before a call."""
    if not callable(tool):
        raise ValueError(f"tool {name!r} is not callable (got {type(tool).__name__}); a tool is a function")
    try:
        return inspect.signature(tool)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"tool {name!r}: cannot read its signature ({exc}); a tool is a Python "
                         "function called with keyword arguments") from None


def _argument_error(name: str, signature: inspect.Signature, arguments: Mapping[str, Any]) -> str | None:
    """What is wrong with calling tool ``name`` with ``arguments``, for the model; None if
    they fit its signature."""
    params = signature.parameters.values()
    named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    unknown = [] if takes_any else [a for a in arguments if a not in named]
    missing = [p.name for p in params if p.name in named and p.default is p.empty and p.name not in arguments]
    problems = ([f"unknown argument {', '.join(map(repr, unknown))}"] if unknown else []) + (
        [f"missing argument {', '.join(map(repr, missing))}"] if missing else [])
    if problems:
        return f"{name}: {'; '.join(problems)} (its arguments: {', '.join(named) or 'none'})"
    try:
        signature.bind(**arguments)
    except TypeError as exc:
        return f"{name}: {exc}"
    return None


# -- calculator ----------------------------------------------------------------------------

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPRESSION = 200
_MAX_MAGNITUDE = 1e100


def calculator(expression: str) -> str:
    """The value of an arithmetic ``expression``: numbers, ``+ - * / // % **`` and
    brackets. Evaluated on Python's syntax tree (no ``eval``), with powers and magnitudes
    bounded (no number or result past 1e100, powers of at most 64) so that no expression
    can hang or exhaust memory; an expression past the bounds is the model's error, shown
    to it. Integers print exactly, other results with up to 12 significant digits."""
    if not isinstance(expression, str):
        raise ToolError("calculator: `expression` must be a string")
    if len(expression) > _MAX_EXPRESSION:
        raise ToolError(f"calculator: the expression is longer than {_MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):  # ValueError: a null byte, in some Python versions
        raise ToolError(f"calculator: cannot read {expression!r} as arithmetic") from None
    try:
        value = _evaluate(tree.body)
    except RecursionError:
        raise ToolError("calculator: the expression is nested too deeply") from None
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.12g}"


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value, "a number")
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or (abs(left) > 1e6 and right > 4)):
            raise ToolError("calculator: the power is too large")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("calculator: division by zero") from None
        except OverflowError:  # a float power past float range: 1e300 ** 2
            raise ToolError("calculator: the result is too large") from None
        if isinstance(value, complex):
            raise ToolError("calculator: the result is not a real number")
        return _bounded(value, "the result")
    raise ToolError(f"calculator: {type(node).__name__} is not arithmetic (numbers, + - * / // % ** and brackets)")


def _bounded(value: int | float, what: str) -> int | float:
    """``value`` if it is finite and at most 1e100 in magnitude; else the model's error."""
    if (isinstance(value, float) and not math.isfinite(value)) or abs(value) > _MAX_MAGNITUDE:
        raise ToolError(f"calculator: {what} is too large (the bound is 1e100)")
    return value


# -- python through the sandbox --------------------------------------------------------------


def python_tool(*, timeout_s: float = 5.0, memory_mb: int = 256) -> Callable[..., str]:
    """A tool ``python(code)`` that runs ``code`` in :mod:`rltune.sandbox` and returns what
    it printed (stdout, then stderr), or why it was stopped. The sandbox failing to start
    is a harness failure and raises. The sandbox's mechanism is chosen here, when the
    environment is built, so that a machine that can only limit resources (no namespaces)
    is said before the first episode, not during it. ``timeout_s`` (wall and CPU seconds
    of each call) is at least :data:`MIN_PYTHON_TIMEOUT_S`."""
    from rltune.sandbox import Limits, isolation, run_python

    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
            or not math.isfinite(timeout_s) or timeout_s < MIN_PYTHON_TIMEOUT_S:
        raise ValueError(f"python tool: timeout_s must be a number of seconds >= {MIN_PYTHON_TIMEOUT_S} "
                         "(the sandbox's start-up counts against it, and its CPU limit is whole "
                         f"seconds), got {timeout_s!r}")
    limits = Limits(wall_s=timeout_s, cpu_s=timeout_s, memory_mb=memory_mb)
    isolation()  # decided once per process; warns when it is resource limits only

    def python(code: str) -> str:
        if not isinstance(code, str):
            raise ToolError("python: `code` must be a string")
        try:
            result = run_python(code, limits=limits)
        except Exception as exc:  # the sandbox did not start: not the model's doing
            raise ToolHarnessError(f"python: the sandbox failed: {type(exc).__name__}: {exc}") from exc
        out = result.stdout + (f"\n{result.stderr}" if result.stderr else "")
        if result.limit_hit is not None:
            out += f"\n[stopped: {result.limit_hit} limit]"
        return out.strip() or "(no output)"

    return python


# -- search ----------------------------------------------------------------------------------


def search_tool(retriever: Any, *, k: int = 1) -> Callable[..., str]:
    """A tool ``search(query)`` returning the ``k`` best documents of ``retriever``, one
    per line, best first; ``"no results"`` when nothing matches. A query that is not a
    non-empty string is the model's error; the retriever or its embedder failing (a
    broken store) raises on, a harness failure."""

    def search(query: str) -> str:
        if not isinstance(query, str) or not query.strip():
            raise ToolError("search: `query` must be a non-empty string")
        try:
            hits = retriever.search(query, k=k)
        except Exception as exc:  # a broken store or embedder (often a ValueError): not the model's
            raise ToolHarnessError(f"search: the retriever failed: {type(exc).__name__}: {exc}") from exc
        return "\n".join(hit.text for hit in hits) if hits else "no results"

    return search


_RETRIEVERS: KeyedCache[Any] = KeyedCache()


def tools_env(
    *, tools: Sequence[str] = ("calculator",), search: Mapping[str, Any] | None = None,
    k: int = 1, python: Mapping[str, Any] | None = None, max_result_chars: int = _MAX_RESULT_CHARS,
    answer_tools: Sequence[str] = (), base_dir: str | None = None,
) -> ToolEnv:
    """``builtin:tools``: a :class:`ToolEnv` with the named built-in tools (``calculator``,
    ``python``, ``search``). ``search`` is the retriever spec of
    :func:`rltune.envs.retrieval.build_retriever` (built once per distinct spec and shared
    by all episodes), whose relative paths start at ``base_dir`` (the config file's
    directory, which :func:`rltune.envs.loading.load_env_factory` passes), else at the
    working directory; a store ``path`` that holds no store needs ``documents``. ``python``:
    the sandbox settings of :func:`python_tool`; ``answer_tools`` as in :class:`ToolEnv`."""
    known = {"calculator", "python", "search"}
    if isinstance(tools, str):  # a bare name would be read letter by letter
        raise ValueError(f"env tools: `tools` must be a list of tool names, e.g. [{tools}], not a string")
    check_k(k)  # a bad k would reach the model as every search's error
    unknown = sorted(set(tools) - known)
    if unknown:
        raise ValueError(f"env tools: unknown tools {unknown}; built in are {sorted(known)}")
    made: dict[str, Callable[..., str]] = {}
    if "calculator" in tools:
        made["calculator"] = calculator
    if "python" in tools:
        made["python"] = python_tool(**dict(python or {}))
    if "search" in tools:
        if search is None:
            raise ValueError("env tools: the search tool needs `search:` (a retriever spec, e.g. {kind: bm25, documents: docs.jsonl})")
        key = json.dumps([search, base_dir], sort_keys=True, default=str)
        retriever = _RETRIEVERS.get(key, lambda: _retriever(search, base_dir))
        made["search"] = search_tool(retriever, k=k)
    return ToolEnv(made, max_result_chars=max_result_chars, answer_tools=answer_tools)


def _retriever(spec: Mapping[str, Any], base_dir: str | None) -> Any:
    """:func:`~rltune.envs.retrieval.build_retriever` (no new store made empty), plus
    ``documents: builtin:TASK`` for the corpus of a built-in task (``builtin:lookup``)."""
    from rltune.data.tasks.lookup import lookup_documents
    from rltune.envs.retrieval import Document, build_retriever

    documents = spec.get("documents")
    if not (isinstance(documents, str) and documents.startswith("builtin:")):
        return build_retriever(spec, base_dir=base_dir, create_empty=False)
    corpora = {"lookup": lookup_documents}
    name = documents.removeprefix("builtin:")
    if name not in corpora:
        raise ValueError(f"search documents {documents!r}: built-in corpora are {sorted(f'builtin:{c}' for c in corpora)}")
    rows = [Document(row["id"], row["text"]) for row in corpora[name]()]
    return build_retriever({k: v for k, v in spec.items() if k != "documents"}, base_dir=base_dir,
                           corpus=rows, create_empty=False)
