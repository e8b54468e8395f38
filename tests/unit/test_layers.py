"""The import layering ("Import layers" in ``docs/architecture.md``), checked by walking
the AST of every module in rltune/.

Every import counts: ``import x`` and ``from x import y``, relative ones, and those inside
functions or under ``if TYPE_CHECKING:``. A violation is reported as ``FILE:LINE``.

Layers, low to high; a package may import itself and the packages of lower layers only
(two packages of one layer are independent of each other)::

    metrics -> algos, config, sandbox -> data -> models -> rollout, rewards -> envs, learner
        -> parallel -> checkpoint -> runtime -> plan -> cli

``metrics`` (typed metrics, sinks, dashboard, report) is at the bottom so that every
layer, the loss math included, can return its measurements as typed metrics; it reads
run directories, never the rest of the package.

Besides the layers: ``algos`` imports only torch and the standard library, ``config``
imports no torch, and the optional dependencies (ray, vllm, wandb, mlflow) appear only in
their adapter modules, which the core imports only inside functions, so that the core
installs and runs without them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

import rltune

PACKAGE_DIR = Path(rltune.__file__).parent
REPO_ROOT = PACKAGE_DIR.parent

ORDER: list[tuple[str, ...]] = [
    ("metrics",),
    ("algos", "config", "sandbox"),
    ("data",),
    ("models",),
    ("rollout", "rewards"),
    ("envs", "learner"),
    ("parallel",),
    ("checkpoint",),
    ("runtime",),
    ("plan",),
    ("cli",),
]

_BASE = {"algos", "config", "metrics", "sandbox"}
ALLOWED: dict[str, set[str]] = {
    "metrics": {"metrics"},
    "algos": {"algos", "metrics"},
    "config": {"config", "metrics"},
    "sandbox": {"sandbox", "metrics"},
    "data": {"data"} | _BASE,
    "models": {"models", "data"} | _BASE,
    "rollout": {"rollout", "models", "data"} | _BASE,
    "rewards": {"rewards", "models", "data"} | _BASE,
    "envs": {"envs", "rollout", "rewards", "models", "data"} | _BASE,
    "learner": {"learner", "rollout", "rewards", "models", "data"} | _BASE,
    "parallel": {"parallel", "envs", "learner", "rollout", "rewards", "models", "data"} | _BASE,
    "checkpoint": {"checkpoint", "parallel", "envs", "learner", "rollout", "rewards", "models", "data"} | _BASE,
    "runtime": {
        "runtime", "checkpoint", "parallel", "envs", "learner", "rollout", "rewards", "models", "data",
    } | _BASE,
    "plan": {
        "plan", "runtime", "checkpoint", "parallel", "envs", "learner", "rollout", "rewards", "models", "data",
    } | _BASE,
    "cli": {
        "cli", "plan", "runtime", "checkpoint", "parallel", "envs", "learner", "rollout", "rewards", "models", "data",
    } | _BASE,
}
"""Package -> the packages of rltune it may import. ``rltune`` itself (the top-level
``__init__``, run before any subpackage) may be imported by anyone and imports nothing of
rltune, so importing ``rltune.config`` never drags in torch."""

THIRD_PARTY_ONLY = {"algos": {"torch"}}
"""Package -> the only non-stdlib modules it may import."""

FORBIDDEN = {"config": {"torch"}, "": {"torch"}}
"""Package (``""`` is the top-level ``__init__``) -> modules it must not import."""

ADAPTERS = {
    "ray": ("rltune.runtime.ray.",),
    "vllm": ("rltune.rollout.vllm",),
    "wandb": ("rltune.metrics.sinks", "rltune.metrics.wandb"),
    "mlflow": ("rltune.metrics.sinks", "rltune.metrics.mlflow"),
}
"""Optional dependency -> prefixes of the module names allowed to import it
(``rltune.runtime.ray`` and below; ``rltune/rollout/vllm*``; the metrics sink modules)."""


@dataclass(frozen=True)
class Import:
    module: str
    """The importing module, e.g. ``rltune.runtime.loop``."""
    target: str
    """What it imports: a module of rltune (``rltune.algos.reduce``) or a dotted name."""
    path: Path
    line: int
    lazy: bool
    """Inside a function or under ``if TYPE_CHECKING:``: not run when the module loads."""

    def where(self) -> str:
        return f"{self.path.relative_to(REPO_ROOT)}:{self.line}"


# --------------------------------------------------------------------------- collecting


def module_name(path: Path, package_dir: Path = PACKAGE_DIR) -> str:
    parts = (package_dir.name, *path.relative_to(package_dir).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def collect_imports(
    source: str, *, module: str, is_package: bool, known: set[str], path: Path
) -> list[Import]:
    """Every import statement of ``source``. ``from X import n`` imports ``X.n`` when
    that is a module in ``known``, else ``X``; relative imports are resolved."""
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend(Import(module, a.name, path, node.lineno, lazy) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module=module, is_package=is_package)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append(Import(module, sub if sub in known else base, path, node.lineno, lazy))
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(node, ast.If) and _is_type_checking(node.test) and child in node.body:
                inner = True
            visit(child, inner)

    visit(ast.parse(source), False)
    return found


def _absolute(node: ast.ImportFrom, *, module: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def package_imports(package_dir: Path = PACKAGE_DIR) -> list[Import]:
    files = sorted(package_dir.rglob("*.py"))
    known = {module_name(f, package_dir) for f in files}
    out: list[Import] = []
    for f in files:
        out += collect_imports(
            f.read_text(encoding="utf-8"), module=module_name(f, package_dir),
            is_package=f.name == "__init__.py", known=known, path=f,
        )
    return out


# --------------------------------------------------------------------------- rules


def layer_of(module: str) -> str:
    """``rltune.data.loaders`` -> ``data``; ``rltune.cli`` -> ``cli``; ``rltune`` -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _ours(target: str) -> bool:
    return target == "rltune" or target.startswith("rltune.")


def layer_violations(imports: list[Import]) -> list[str]:
    bad = []
    for imp in imports:
        if not _ours(imp.target) or imp.target == "rltune":
            continue
        src, dst = layer_of(imp.module), layer_of(imp.target)
        allowed = ALLOWED.get(src, set())
        if dst not in allowed:
            bad.append(f"{imp.where()}: {imp.module} imports {imp.target} "
                       f"({src or 'the top-level rltune'} may import only {sorted(allowed)})")
    return bad


def third_party_violations(imports: list[Import]) -> list[str]:
    bad = []
    for imp in imports:
        if _ours(imp.target):
            continue
        top, src = imp.target.split(".")[0], layer_of(imp.module)
        only = THIRD_PARTY_ONLY.get(src)
        if only is not None and top not in only and top not in sys.stdlib_module_names:
            bad.append(f"{imp.where()}: {imp.module} imports {imp.target}; "
                       f"{src} may import only {sorted(only)} and the stdlib")
        if top in FORBIDDEN.get(src, set()):
            bad.append(f"{imp.where()}: {imp.module} imports {imp.target}; "
                       f"{src or 'the top-level rltune'} must not")
        prefixes = ADAPTERS.get(top)
        if prefixes is not None and not _in_adapter(imp.module, prefixes):
            bad.append(f"{imp.where()}: {imp.module} imports {top}, allowed only in {list(prefixes)}")
    return bad


def _in_adapter(module: str, prefixes: tuple[str, ...]) -> bool:
    return any((module + ".").startswith(p) if p.endswith(".") else module.startswith(p) for p in prefixes)


def eager_adapter_violations(imports: list[Import]) -> list[str]:
    """A module importing an optional dependency when it loads (an adapter) is loaded by
    the rest of the package only from inside functions."""
    eager_deps = {(imp.module, imp.target.split(".")[0]) for imp in imports if not imp.lazy}
    adapters = {mod: dep for mod, dep in eager_deps if dep in ADAPTERS}
    bad = []
    for imp in imports:
        dep = adapters.get(imp.target)
        if dep is not None and not imp.lazy and not _in_adapter(imp.module, ADAPTERS[dep]):
            bad.append(f"{imp.where()}: {imp.module} imports {imp.target} (which imports {dep}) "
                       "when it loads; import it inside the function that needs it")
    return bad


# --------------------------------------------------------------------------- the package


def test_the_table_follows_the_layer_order():
    packages = [p for layer in ORDER for p in layer]
    assert sorted(ALLOWED) == sorted(packages)
    for depth, layer in enumerate(ORDER):
        below = {p for lower in ORDER[:depth] for p in lower}
        for package in layer:
            assert ALLOWED[package] == {package} | below, package


def test_every_package_is_in_the_table():
    """A new subpackage (envs/, planner/, ...) needs its place in ORDER and ALLOWED."""
    layers = {layer_of(module_name(f)) for f in PACKAGE_DIR.rglob("*.py")} - {""}
    assert layers <= set(ALLOWED), sorted(layers - set(ALLOWED))


def test_imports_follow_the_layers():
    assert layer_violations(package_imports()) == []


def test_only_cli_imports_the_runtime():
    bad = [imp.where() for imp in package_imports()
           if imp.target.startswith("rltune.runtime") and layer_of(imp.module) not in {"runtime", "plan", "cli"}]
    assert bad == []


def test_third_party_imports_stay_in_their_layers():
    assert third_party_violations(package_imports()) == []


def test_adapters_are_loaded_lazily():
    assert eager_adapter_violations(package_imports()) == []


def test_the_walk_sees_the_package():
    """Guards the tests above against passing on an empty or partial walk."""
    imports = package_imports()
    pairs = {(imp.module, imp.target) for imp in imports}
    assert ("rltune.runtime.loop", "rltune.metrics.sinks") in pairs
    assert ("rltune.algos.losses", "torch") in pairs
    lazy = {(imp.module, imp.target) for imp in imports if imp.lazy}
    assert ("rltune.cli", "rltune.runtime.local") in lazy  # inside cmd_train
    assert ("rltune.runtime.state", "rltune.runtime.parts") in lazy  # under TYPE_CHECKING


def test_config_loads_without_torch():
    """At run time too, through every ``__init__`` on the way."""
    code = "import sys, rltune.config; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT).returncode == 0


def test_the_planner_loads_without_torch():
    """Planning reads config files and does arithmetic; only its calibration (measured
    steps on this machine) may load torch, and only when it runs."""
    modules = sorted(module_name(f) for f in (PACKAGE_DIR / "plan").glob("*.py"))
    planner = [m for m in modules if m != "rltune.plan.calibrate"]
    assert "rltune.plan.spec" in planner
    code = f"import sys\nfor m in {planner!r}: __import__(m)\nsys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT).returncode == 0


# --------------------------------------------------------------------------- the checker


def _fake_package(tmp_path: Path, files: dict[str, str]) -> list[Import]:
    root = tmp_path / "rltune"
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return package_imports(root)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO_ROOT", tmp_path)
    return lambda files: _fake_package(tmp_path, files)


def test_checker_finds_every_kind_of_import(fake):
    imports = fake({
        "__init__.py": "",
        "runtime/__init__.py": "",
        "runtime/loop.py": "",
        "algos/__init__.py": "from .reduce import masked_mean\n",
        "algos/reduce.py": "import torch\n",
        "algos/bad.py": """\
            from typing import TYPE_CHECKING
            from rltune import runtime
            from ..runtime import loop
            if TYPE_CHECKING:
                from rltune.data.records import Rollout
            def f():
                import numpy as np
                from rltune.runtime.loop import train
            """,
    })
    got = {(imp.module, imp.target, imp.line, imp.lazy) for imp in imports}
    assert ("rltune.algos", "rltune.algos.reduce", 1, False) in got
    assert ("rltune.algos.bad", "rltune.runtime", 2, False) in got
    assert ("rltune.algos.bad", "rltune.runtime.loop", 3, False) in got
    assert ("rltune.algos.bad", "rltune.data.records", 5, True) in got
    assert ("rltune.algos.bad", "numpy", 7, True) in got
    assert ("rltune.algos.bad", "rltune.runtime.loop", 8, True) in got
    assert sorted(v.split(":")[1] for v in layer_violations(imports)) == ["2", "3", "5", "8"]
    assert [v.split(": ")[0] for v in third_party_violations(imports)] == ["rltune/algos/bad.py:7"]


def test_checker_flags_optional_dependencies_outside_their_adapters(fake):
    imports = fake({
        "config/load.py": "import torch\n",
        "metrics/sinks.py": "def wandb_sink():\n    import wandb\n",
        "metrics/mlflow_sink.py": "import mlflow\n",
        "runtime/ray/actors.py": "import ray\n",
        "runtime/ray/__init__.py": "from rltune.runtime.ray.actors import Actor\n",
        "runtime/loop.py": "import ray\nfrom rltune.metrics.mlflow_sink import Sink\n"
                           "def f():\n    from rltune.runtime.ray.actors import Actor\n",
        "rollout/vllm_engine.py": "import vllm\n",
        "rollout/hf.py": "from vllm import LLM\n",
    })
    bad = sorted(v.split(": ")[0] for v in third_party_violations(imports))
    assert bad == ["rltune/config/load.py:1", "rltune/rollout/hf.py:1", "rltune/runtime/loop.py:1"]
    eager = [v.split(": ")[0] for v in eager_adapter_violations(imports)]
    assert eager == ["rltune/runtime/loop.py:2"]
