"""Run a solution against unit tests in the sandbox: :func:`run_tests`.

The tests run in one process (:mod:`rltune.sandbox._harness_runner`), the solution in
another (:mod:`rltune.sandbox._harness_server`), both inside one sandbox run; the tests
reach the solution's functions through stand-ins and get back only plain values. Why
that makes the verdicts unforgeable is in the runner's docstring and ``docs/sandbox.md``.

Two forms of tests:

- a list of Python snippets, usually one ``assert`` each, run in order in one namespace
  that holds the solution's names: each snippet is one test;
- one string holding a test module: every top-level ``def test_*()`` (no parameters:
  there are no fixtures) is one test, run in definition order after the module body.

What the host decides here: a problem with the *tests* (not a list of strings or a
string, none collected, a syntax error, a test with parameters) raises ``ValueError``
before anything runs; the harness failing (the sandbox, the runner crashing, tests that
need a module the sandbox lacks or pass a function to the solution) raises
:class:`SandboxError`. Everything the *solution* does -- not loading, raising, exiting,
hanging, exhausting a limit -- is failed tests in the report.
"""

from __future__ import annotations

import ast
import functools
import secrets
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from rltune.sandbox import wire
from rltune.sandbox.mechanisms import Mechanism, SandboxError, probe_interpreter
from rltune.sandbox.runner import Limits, SandboxResult, run_python

REPLY_LIMIT = 16 * 1024 * 1024
"""Largest answer (encoded) the solution may give to one request."""
_LINE_BYTES = 4096
"""Room kept on stdout per verdict line."""
_HERE = Path(__file__).parent

TestMode = Literal["asserts", "module"]


@dataclass(frozen=True)
class TestReport:
    """The verdicts of one run. A test without a verdict (the run was killed first, or
    the output cap cut it off) counts as failed."""

    passed: int
    total: int
    verdicts: tuple[bool | None, ...]
    """Per test: True passed, False failed, None no verdict."""
    messages: tuple[str | None, ...]
    """Per failed test: the exception (``AssertionError: ...``, the solution's error)."""
    complete: bool
    """Every test ran (the runner said ``done``)."""
    result: SandboxResult

    __test__ = False  # a record, not a test class for pytest

    @property
    def pass_rate(self) -> float:
        return self.passed / self.total


@dataclass(frozen=True)
class CollectedTests:
    mode: TestMode
    source: list[str] | str
    names: list[str]
    """One per test: the function name (module) or ``<test I>`` (asserts)."""
    imports: list[str]
    """Modules the tests import (``solution`` aside): the runner imports them before the
    solution starts, so nothing the solution writes meanwhile can stand in for them."""
    library: list[str]
    """Standard-library module names the tests use as modules (``math.isclose``) but
    never call: bound to the runner's own modules, never to the solution's objects."""


def collect_tests(tests: object) -> CollectedTests:
    """Check and collect ``tests`` on the host (ValueError for anything unusable)."""
    if isinstance(tests, str):
        return _collect_module(tests)
    if isinstance(tests, Sequence) and not isinstance(tests, (bytes, bytearray)):
        items = list(tests)
        if not items:
            raise ValueError("tests: the list is empty (no tests to run)")
        for i, text in enumerate(items):
            if not isinstance(text, str):
                raise ValueError(f"tests[{i}] must be a string of Python code, "
                                 f"got {type(text).__name__}")
            try:
                compile(text, f"<test {i}>", "exec")
            except SyntaxError as exc:
                raise ValueError(f"tests[{i}] is not valid Python: {exc}") from None
        names = [f"<test {i}>" for i in range(len(items))]
        trees = [ast.parse(t) for t in items]
        return CollectedTests("asserts", items, names, _imports(trees), _library(trees))
    raise ValueError("tests must be a list of Python snippets (asserts) or a string "
                     f"holding a test module, got {type(tests).__name__}")


def _collect_module(source: str) -> CollectedTests:
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise ValueError(f"tests: the test module is not valid Python: {exc}") from None
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.AsyncFunctionDef) and node.name.startswith("test"):
            raise ValueError(f"tests: {node.name} is async; test functions must be plain")
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            args = node.args
            required = len(args.posonlyargs) + len(args.args) - len(args.defaults)
            required += sum(d is None for d in args.kw_defaults)
            if required:
                raise ValueError(f"tests: {node.name} takes parameters; test functions must "
                                 "take none (there are no fixtures)")
            if node.name not in names:
                names.append(node.name)
    if not names:
        raise ValueError("tests: the test module defines no test_* functions")
    return CollectedTests("module", source, names, _imports([tree]), _library([tree]))


def _library(trees: list[ast.Module]) -> list[str]:
    used, called = set(), set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                used.add(node.value.id)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                called.add(node.func.id)
    return sorted(n for n in used - called if n in sys.stdlib_module_names)


def _imports(trees: list[ast.Module]) -> list[str]:
    found: list[str] = []
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            found += [m for m in modules if m.split(".")[0] != "solution" and m not in found]
    return found


def run_tests(
    code: str,
    tests: Sequence[str] | str,
    *,
    limits: Limits = Limits(),
    python: str = sys.executable,
    mechanism: Mechanism | None = None,
) -> TestReport:
    """Run the solution ``code`` (as module ``solution``) against ``tests``.

    ``limits`` bound the whole run, tests and solution together (``wall_s`` covers every
    test); stdout is widened to hold one line per test."""
    collected = collect_tests(tests)
    nonce = secrets.token_hex(16)
    orders = {
        "nonce": nonce, "mode": collected.mode, "source": collected.source,
        "names": collected.names, "imports": collected.imports,
        "library": collected.library, "server": _server_program(),
        "reply_limit": REPLY_LIMIT, "sys_path": list(probe_interpreter(python).site),
    }
    room = _LINE_BYTES * (len(collected.names) + 2)
    result = run_python(
        _runner_program(), stdin=wire.dumps(orders), files={"solution.py": code},
        limits=replace(limits, output_bytes=max(limits.output_bytes, room)),
        python=python, mechanism=mechanism,
    )
    return _report(result, nonce, len(collected.names))


def _report(result: SandboxResult, nonce: str, total: int) -> TestReport:
    verdicts: list[bool | None] = [None] * total
    messages: list[str | None] = [None] * total
    complete = False
    prefix = nonce + " "
    for line in result.stdout.splitlines():
        if not line.startswith(prefix):
            continue  # not the runner's: nothing else knows the secret
        word, _, rest = line[len(prefix):].partition(" ")
        if word in ("pass", "fail"):
            index_text, _, message = rest.partition(" ")
            if not index_text.isdigit() or int(index_text) >= total:
                continue  # a line cut by the output cap
            i = int(index_text)
            if verdicts[i] is None:
                verdicts[i] = word == "pass"
                messages[i] = _unescape(message) if word == "fail" else None
        elif word == "done":
            complete = True
        elif word == "harness":
            raise SandboxError(f"the tests cannot run in the sandbox: {_unescape(rest)}")
    if not complete and result.limit_hit is None and (result.exit_code or 0) >= 0:
        raise SandboxError(f"the test runner stopped without finishing (exit "
                           f"{result.exit_code}): {result.stderr.strip()[-2000:]}")
    return TestReport(
        passed=sum(v is True for v in verdicts), total=total, verdicts=tuple(verdicts),
        messages=tuple(messages), complete=complete, result=result,
    )


def _unescape(text: str) -> str:
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text):
            out.append({"n": "\n", "r": "\r", "\\": "\\"}.get(text[i + 1], text[i + 1]))
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


# --------------------------------------------------------------------------- programs

_LOADER = '''import sys


def _load(name, source):
    """Make module `name` from `source` (no files: the working directory is writable
    by the solution, and the sandbox has no rltune installed)."""
    module = type(sys)(name)
    module.__file__ = "<" + name + ">"
    sys.modules[name] = module
    parent, _, leaf = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], leaf, module)
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


for _name in ("rltune", "rltune.sandbox"):
    _package = type(sys)(_name)
    _package.__path__ = []
    sys.modules[_name] = _package
sys.modules["rltune"].sandbox = sys.modules["rltune.sandbox"]
'''


def _source(name: str) -> str:
    return (_HERE / f"{name}.py").read_text(encoding="utf-8")


@functools.lru_cache(maxsize=1)
def _runner_program() -> str:
    """main.py of the sandbox run: drops the working directory from ``sys.path`` before
    anything else, then runs the test runner."""
    return (
        "import sys\n"
        "del sys.path[0]  # the working directory: the solution can write there\n"
        + _LOADER
        + f"_load('rltune.sandbox.wire', {_source('wire')!r})\n"
        + f"_load('rltune.sandbox._harness_runner', {_source('_harness_runner')!r}).main()\n"
    )


@functools.lru_cache(maxsize=1)
def _server_program() -> str:
    """The solution server's ``-c`` program; extra import paths follow its two fds."""
    return (
        _LOADER
        + "sys.path.extend(sys.argv[3:])\n"
        + f"_load('rltune.sandbox.wire', {_source('wire')!r})\n"
        + f"_load('rltune.sandbox._harness_server', {_source('_harness_server')!r}).main()\n"
    )
