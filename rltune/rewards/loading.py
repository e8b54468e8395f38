"""Turn a reward spec from the config (``module:function`` or ``path/to/file.py:function``)
into a callable, with errors that say what is wrong and what to write instead.

Spec forms::

    my_package.rewards:correct          # importlib.import_module("my_package.rewards")
    rewards/math.py:correct             # a file, loaded as a standalone module
    builtin:exact_numeric               # short for rltune.rewards.builtin:exact_numeric

A relative file path is looked up in ``base_dir`` first (the directory of the config file,
so a recipe and its reward file can move together), then in the current working
directory. The function part is split off at the *last* colon, so ``C:\\r.py:f`` works.

A file is loaded without adding its directory to ``sys.path``: a reward file that imports a
sibling module needs that directory on ``PYTHONPATH`` (or use the module form).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from rltune.rewards.contract import is_batched

# Short module names accepted before the colon. ``builtin:NAME`` is the spelling used in
# recipes; the full module path is the canonical one.
_MODULE_ALIASES = {"builtin": "rltune.rewards.builtin"}
_FILE_MODULE_PREFIX = "rltune_user_reward_"
"""Module names of reward files loaded by path: the prefix, the file's stem and a hash of
its path (two files called rewards.py do not collide)."""


_EXAMPLES = {
    "reward": ("function", "`builtin:exact_numeric` or `rewards.py:my_reward`"),
    "env": ("factory", "`builtin:tools` or `envs.py:MyEnv`"),
}
"""The kind of spec -> what its part after the colon names, and examples of the spec."""


class RewardLoadError(ValueError):
    """A reward spec that cannot be turned into a usable reward function."""


def load_reward_fn(spec: str, *, base_dir: str | None = None) -> Callable[..., Any]:
    """Load the reward function named by ``spec`` and check it can be called as
    ``fn(prompt, completion, **meta)``.

    ``base_dir``: where relative file paths are looked up first (then the current working
    directory). Raises :class:`RewardLoadError` naming the part of the spec that is wrong.
    """
    fn = load_callable(spec, base_dir=base_dir, aliases=_MODULE_ALIASES)
    check_reward_signature(fn, spec=spec)
    return fn


def load_callable(
    spec: str, *, base_dir: str | None = None, aliases: dict[str, str] | None = None,
    what: str = "reward", allow_class: bool = False,
) -> Callable[..., Any]:
    """The callable named by ``module:attr`` or ``path/to/file.py:attr`` (``aliases`` maps
    short module names such as ``builtin``). ``what`` names the kind of spec in errors;
    ``allow_class`` accepts a class (a factory whose instances are the objects wanted).
    Raises :class:`RewardLoadError` naming the part of the spec that is wrong."""
    target, sep, attr = spec.strip().rpartition(":")
    target, attr = target.strip(), attr.strip()  # `rewards.py : fn` is `rewards.py:fn`
    if not sep or not target or not attr:
        part, examples = _EXAMPLES.get(what, _EXAMPLES["reward"])
        raise RewardLoadError(
            f"{what} spec {spec!r}: expected `module:{part}` or `path/to/file.py:{part}` "
            f"(e.g. {examples})"
        )
    if _is_file_target(target):
        module = _load_file(target, spec=spec, base_dir=base_dir, what=what)
    else:
        module = _import_module((aliases or {}).get(target, target), spec=spec, base_dir=base_dir, what=what)
    return _get_callable(module, attr, spec=spec, allow_class=allow_class, what=what)


def check_reward_signature(fn: Callable[..., Any], *, spec: str) -> None:
    """Raise :class:`RewardLoadError` unless ``fn`` takes two positional arguments
    (``prompt``, ``completion``; a batched one ``prompts``, ``completions``), or ``*args``.

    Callables whose signature Python cannot inspect (some C builtins) are accepted as they
    are: a wrong one then fails on every call and shows up in ``reward/errors``.
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    positional_kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = list(sig.parameters.values())
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return
    positional = [p.name for p in params if p.kind in positional_kinds]
    if len(positional) < 2:
        name = _name(fn)
        if is_batched(fn):
            form = "fn(prompts, completions, **kwargs)"
            example = f"`@batched` over `def {name}(prompts, completions, **kwargs):`"
        else:
            form = "fn(prompt, completion, **meta)"
            example = f"`def {name}(prompt, completion, **meta):`"
        raise RewardLoadError(
            f"reward spec {spec!r}: {name}{sig} cannot be called as {form}; it needs two "
            f"positional parameters, e.g. {example}"
        )


def _is_file_target(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def _resolve_file(target: str, *, spec: str, base_dir: str | None, what: str) -> Path:
    path = Path(target).expanduser()
    if path.is_absolute():
        candidates = [path]
    else:
        roots = ([Path(base_dir)] if base_dir is not None else []) + [Path.cwd()]
        # base_dir is often the working directory: look there once, and say so once
        candidates = list(dict.fromkeys((root / path).resolve() for root in roots))
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    directory = next((c for c in candidates if c.is_dir()), None)
    if directory is not None:
        raise RewardLoadError(f"{what} spec {spec!r}: {directory} is a directory, not a Python file")
    tried = ", ".join(str(c) for c in candidates)
    raise RewardLoadError(f"{what} spec {spec!r}: file not found (looked for {tried})")


def _load_file(target: str, *, spec: str, base_dir: str | None, what: str = "reward") -> ModuleType:
    path = _resolve_file(target, spec=spec, base_dir=base_dir, what=what)
    # One module name per file path: two files both called rewards.py must not collide, and
    # loading the same file twice reuses the module (its globals, caches) like an import.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    module_name = f"{_FILE_MODULE_PREFIX}{path.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    import_spec = importlib.util.spec_from_file_location(module_name, path)
    if import_spec is None or import_spec.loader is None:
        raise RewardLoadError(f"{what} spec {spec!r}: {path} cannot be loaded as a Python file")
    module = importlib.util.module_from_spec(import_spec)
    # Registered before running it, as `import` does: a dataclass in the user's file looks
    # its module up in sys.modules while the file runs.
    sys.modules[module_name] = module
    try:
        import_spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # the user's file raised (or exited) while running: name the file
        del sys.modules[module_name]
        raise RewardLoadError(
            f"{what} spec {spec!r}: running {path} failed: {type(exc).__name__}: {exc}"
        ) from exc
    return module


def _import_module(name: str, *, spec: str, base_dir: str | None, what: str = "reward") -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        hint = _file_form_hint(name, base_dir=base_dir, what=what)
        raise RewardLoadError(
            f"{what} spec {spec!r}: cannot import module {name!r}: {exc}{hint}"
        ) from exc
    except (Exception, SystemExit) as exc:  # the module itself raised (or exited) on import
        raise RewardLoadError(
            f"{what} spec {spec!r}: importing module {name!r} failed: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _file_form_hint(name: str, *, base_dir: str | None, what: str) -> str:
    """The common slip: `my_rewards:fn` for a file next to the config, which is not on
    sys.path when rltune runs as a console script. The part after the colon is named as
    the kind of spec names it (a reward's FUNCTION, an environment's FACTORY)."""
    relative = Path(*name.split(".")).with_suffix(".py")
    roots = ([Path(base_dir)] if base_dir is not None else []) + [Path.cwd()]
    part = _EXAMPLES.get(what, _EXAMPLES["reward"])[0].upper()
    for root in roots:
        if (root / relative).is_file():
            return f" (there is a file {root / relative}: write it as `{relative.as_posix()}:{part}`)"
    return ""


def _get_callable(
    module: ModuleType, attr: str, *, spec: str, allow_class: bool = False, what: str = "reward"
) -> Callable[..., Any]:
    if not hasattr(module, attr):
        available = _public_callables(module, classes=allow_class)
        close = difflib.get_close_matches(attr, available, n=1)
        suggestion = f"; did you mean {close[0]!r}?" if close else ""
        listing = ", ".join(available) if available else "none"
        kinds = "functions and classes" if allow_class else "functions"
        raise RewardLoadError(
            f"{what} spec {spec!r}: {_describe_module(module)} has no attribute {attr!r}"
            f"{suggestion} (its {kinds}: {listing})"
        )
    fn = getattr(module, attr)
    if not callable(fn) or (inspect.isclass(fn) and not allow_class):
        kind = "a class" if inspect.isclass(fn) else f"a value of type {type(fn).__name__}"
        hint = (
            "a reward is `def fn(prompt, completion, **meta) -> float | None`" if what == "reward"
            else f"a {what} spec names a function or class"
        )
        raise RewardLoadError(f"{what} spec {spec!r}: {attr!r} is {kind}, not a function; {hint}")
    return fn


def _describe_module(module: ModuleType) -> str:
    """``module 'NAME'``, or ``file PATH`` for a file loaded by path, whose module name
    (:data:`_FILE_MODULE_PREFIX`, a hash) is rltune's own, not the user's."""
    if module.__name__.startswith(_FILE_MODULE_PREFIX) and module.__file__:
        return f"file {module.__file__}"
    return f"module {module.__name__!r}"


def _public_callables(module: ModuleType, *, classes: bool = False) -> list[str]:
    """The public functions of ``module``; with ``classes``, also the classes it defines
    (not those it imports, such as ``Path`` or ``Any``)."""
    return sorted(
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and callable(value) and (
            not inspect.isclass(value) or (classes and value.__module__ == module.__name__))
    )


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", type(fn).__name__)
