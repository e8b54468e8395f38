"""Files stay small: no file in ``rltune/`` over 500 lines, no function over 60.

A function's length is its ``def`` line (decorators aside) to its last line, as ``ast``
gives them, so a docstring and comments inside it count. Vendored files (``vendor/``
folders) are someone else's code and are left out. Every offender is named in the failure.
"""

from __future__ import annotations

import ast
from pathlib import Path

import rltune

PACKAGE_DIR = Path(rltune.__file__).parent
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60


def _source_files() -> list[Path]:
    return sorted(p for p in PACKAGE_DIR.rglob("*")
                  if p.is_file() and "vendor" not in p.relative_to(PACKAGE_DIR).parts
                  and "__pycache__" not in p.parts and p.suffix != ".pyc")


def long_files(files: list[Path], limit: int = MAX_FILE_LINES) -> list[str]:
    """``PATH (N lines)`` for each file over ``limit`` lines."""
    out = []
    for path in files:
        n = len(path.read_bytes().splitlines())
        if n > limit:
            out.append(f"{path.relative_to(PACKAGE_DIR.parent)} ({n} lines)")
    return out


def long_functions(source: str, name: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``NAME:LINE QUALNAME (N lines)`` for each function or method of ``source`` longer
    than ``limit`` lines, nested ones included (each counted whole)."""
    out: list[str] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qualname = f"{prefix}{child.name}"
                n = child.end_lineno - child.lineno + 1  # type: ignore[operator]
                if n > limit:
                    out.append(f"{name}:{child.lineno} {qualname} ({n} lines)")
                visit(child, f"{qualname}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return out


def test_no_file_in_the_package_passes_500_lines() -> None:
    offenders = long_files(_source_files())
    assert not offenders, f"files over {MAX_FILE_LINES} lines: " + ", ".join(offenders)


def test_no_function_in_the_package_passes_60_lines() -> None:
    offenders = [o for p in _source_files() if p.suffix == ".py"
                 for o in long_functions(p.read_text(encoding="utf-8"),
                                         str(p.relative_to(PACKAGE_DIR.parent)))]
    assert not offenders, (f"functions over {MAX_FUNCTION_LINES} lines: "
                           + ", ".join(offenders))


def test_the_length_counter_counts_def_to_end() -> None:
    """The checker itself: a 61-line function (def line, docstring, 59 body lines) is
    named with its class; one of exactly 60 lines, and a decorator above it, are not."""
    body = "".join(f"        x{i} = {i}\n" for i in range(58))
    source = ("class A:\n"
              "    @staticmethod\n"
              "    def fits():\n        '''doc'''\n" + body
              + "    def over():\n        '''doc'''\n" + body + "        return 1\n")
    assert long_functions(source, "m.py") == ["m.py:63 A.over (61 lines)"]
