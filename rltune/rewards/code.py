"""Reward for code: the fraction of unit tests that model-written code passes, in the
sandbox. Name it in a config as ``rltune.rewards.code:code_tests``.

Scoring, in the reward contract's terms (``docs/sandbox.md`` has the full story):

- a score (0.0 to 1.0) is a verdict on the *program*: tests passed / tests collected. A
  program that does not parse, raises, exits early, hangs, or exhausts a limit fails the
  tests it did not pass; one that passes half of them scores 0.5;
- an exception is "no score": the *tests* are unusable (``ValueError``: none collected, not
  valid Python, a test with parameters) or the *harness* failed (``SandboxError``: the
  sandbox did not start, the test runner crashed, the tests need a module the sandbox
  lacks). Either way the sample is masked out, never scored 0.

The verdicts cannot be forged from inside the program (printing markers, writing files,
``exit(0)``, raising ``SystemExit``, patching builtins, an object whose ``__eq__`` is
always True, ``ctypes``): the tests run in a separate process that receives only plain
values from the program; see :mod:`rltune.sandbox.harness`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from rltune.data.records import Prompt
from rltune.rewards.contract import verifier
from rltune.sandbox import Limits, SandboxError, isolation, run_tests

_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)^[ \t]*```", re.DOTALL | re.MULTILINE)
_OPEN_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+#.-]*)[^\n]*\n", re.MULTILINE)
_PYTHON_TAGS = frozenset({"python", "py", "python3"})


def extract_code(completion: str) -> str:
    """The program in a completion: the last fenced block tagged ``python`` (or ``py``,
    ``python3``), else the last fenced block of any kind, else the whole completion.

    A fence opened and never closed (a completion cut off at the token limit) counts as a
    block running to the end of the text."""
    blocks: list[tuple[str, str]] = []
    end = 0
    for match in _FENCE.finditer(completion):
        blocks.append((match.group(1).lower(), match.group(2)))
        end = match.end()
    unclosed = _OPEN_FENCE.search(completion, end)
    if unclosed is not None:
        blocks.append((unclosed.group(1).lower(), completion[unclosed.end():]))
    python = [body for tag, body in blocks if tag in _PYTHON_TAGS]
    if python:
        return python[-1]
    if blocks:
        return blocks[-1][1]
    return completion


@verifier
def code_tests(
    prompt: Prompt,
    completion: str,
    *,
    tests: Sequence[str] | str,
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    **meta: object,
) -> float:
    """Tests passed / tests run for the code in ``completion`` (:func:`extract_code`).

    ``tests`` (usually the dataset row's ``tests`` field): a list of Python snippets, one
    test each (``"assert add(1, 2) == 3"``), or one string holding a test module whose
    ``test_*`` functions are the tests; the program's top-level names are available to
    both, and it is importable as ``solution``. ``timeout_s`` bounds the whole run (wall
    clock, and CPU per process); ``memory_mb`` the address space of each process."""
    limits = Limits(cpu_s=timeout_s, wall_s=timeout_s, memory_mb=memory_mb)
    try:
        report = run_tests(extract_code(completion), tests, limits=limits)
    except ValueError as exc:
        raise ValueError(f"prompt {prompt.id!r}: {exc}") from exc
    except SandboxError as exc:
        raise SandboxError(f"prompt {prompt.id!r}: {exc}") from exc
    return report.pass_rate


def _check_code_tests(kwargs: dict) -> None:
    """The config's kwargs, checked when it loads; the sandbox's mechanism is chosen then
    too, so that a machine that can only limit resources (no namespaces) is said before
    the first generation (:func:`rltune.sandbox.isolation` warns once per process)."""
    for key in ("timeout_s", "memory_mb"):
        value = kwargs.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ValueError(f"kwargs.{key} must be a number > 0, got {value!r}")
    isolation()


code_tests.check_kwargs = _check_code_tests  # type: ignore[attr-defined]
