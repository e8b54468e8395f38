"""Load an experiment config: a YAML file plus dotted ``key.sub=value`` overrides -> ``Config``.

Every problem is raised as one ``ConfigError`` that names the file and lists each bad key
by its dotted path (``reward[0].weight``), what is wrong with it, and for a typo the
closest valid key of that section. Imports no torch.
"""

from __future__ import annotations

import difflib
import os
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from rltune.config.schema import Config

Loc = tuple[str | int, ...]


class ConfigError(ValueError):
    """A config that cannot be used; the message lists every problem found."""


class _Problem(Exception):
    """One problem with one override, collected into a ``ConfigError``."""


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Read ``path`` (None: start from the defaults), apply ``overrides`` in order, validate.

    An override is ``KEY=VALUE``: KEY is a dotted path (``train.lr``, ``reward.0.weight``;
    a number indexes a list, and the index one past the end appends an item), VALUE is
    parsed as YAML (``1e-4`` stays text and the schema turns it into a float where the
    field is a number; a text field keeps VALUE as written, so ``name=2024`` is "2024").
    """
    source = "(no file)" if path is None else str(path)
    data = {} if path is None else _read_yaml(Path(path))
    empty_file = path is not None and not data
    origins: dict[Loc, str] = {}
    problems = []
    for text in overrides:
        try:
            origins[_apply_override(data, text)] = text
        except _Problem as exc:
            problems.append(f"override `{text}`: {exc}")
    if problems:
        raise ConfigError(_report(source, problems))
    if empty_file and not overrides:
        raise ConfigError(
            f"config file {source} is empty (or only comments), so every setting would be a "
            f"default and that is not a complete experiment; write its sections (model, "
            f"data, reward, ...) or start from a file in recipes/"
        )
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        lines = [_describe(err, origins) for err in exc.errors()]
        if empty_file:  # the defaults alone are no experiment: say what is really wrong
            raise ConfigError(
                f"config file {source} is empty (or only comments), so every setting is a "
                f"default and that is not a complete experiment ({lines[0]}); write its "
                f"sections (model, data, reward, ...) or start from a file in recipes/"
            ) from None
        raise ConfigError(_report(source, lines)) from None


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML: every field, defaults included, in schema order, except
    ``train.parallel``'s unset ones: setting any of them is what asks for a mesh layout
    (``rltune.parallel.layout``), so the file read back must ask for the same layout."""
    data = cfg.model_dump()
    parallel = cfg.train.parallel
    data["train"]["parallel"] = {k: v for k, v in data["train"]["parallel"].items() if k in parallel.model_fields_set}
    return yaml.safe_dump(_plain(data), sort_keys=False, allow_unicode=True)


def save_resolved_config(cfg: Config, run_dir: str | Path) -> Path:
    """Write ``dump_config(cfg)`` to ``run_dir/config.yaml`` (temp file, then rename)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / "config.yaml"
    tmp = run_dir / ".config.yaml.tmp"
    tmp.write_text(dump_config(cfg), encoding="utf-8")
    os.replace(tmp, target)
    return target


def config_base_dir(path: str | Path | None) -> Path:
    """Directory that relative paths in the config (reward files, data) are resolved against:
    the YAML file's directory, or the working directory for a config without a file."""
    return Path.cwd() if path is None else Path(path).resolve().parent


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` semantics, except that a key written twice in one mapping is an
    error (safe_load silently keeps the last one, hiding an edit made in the wrong place)."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep=False):
    seen = set()
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
            continue
        key = loader.construct_object(key_node)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while reading a mapping", node.start_mark, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def parse_yaml(text: str, name: str) -> Any:
    """``text`` as ``yaml.safe_load`` reads it, except that a key written twice in one
    mapping is a ``yaml.YAMLError``; ``name`` (the file) is where its marks point."""
    loader = _UniqueKeyLoader(text)
    loader.name = name  # YAML error marks then say `in "NAME", line N`
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _read_yaml(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start}: {exc.reason}); "
                          "save it as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    try:
        data = parse_yaml(text, str(path))
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML:\n{exc}") from None
    if data is None:  # an empty file (or only comments): all defaults
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path}: the top level must be a mapping of sections "
            f"(model:, algo:, train:, ...), got a {type(data).__name__}"
        )
    return data


def _apply_override(data: dict, text: str) -> Loc:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise _Problem("expected KEY=VALUE, e.g. `train.lr=1e-4`")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise _Problem(f"the value is not valid YAML ({getattr(exc, 'problem', exc)})") from None
    loc, leaf = (), Config
    for part in key.strip().split("."):
        leaf, step = _step(leaf, loc, part)
        loc += (step,)
    if _strip_optional(leaf) is str and value is not None and not isinstance(value, str):
        value = raw.strip()  # a text field takes the text as written, e.g. `name=2024`
    _set_path(data, loc, value)
    return loc


def _step(tp: Any, loc: Loc, part: str) -> tuple[Any, str | int]:
    """One key of a dotted path: the annotation of ``loc + (part,)`` and the key itself."""
    tp = _strip_optional(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        if part not in tp.model_fields:
            raise _Problem(_unknown_key(loc + (part,)))
        return tp.model_fields[part].annotation, part
    if get_origin(tp) is tuple:
        if not part.isdigit():
            raise _Problem(f"`{_dotted(loc)}` is a list; index it with a number, e.g. `{_dotted(loc)}.0`")
        args, index = get_args(tp), int(part)
        if len(args) == 2 and args[1] is Ellipsis:
            return args[0], index
        if index >= len(args):
            raise _Problem(f"`{_dotted(loc)}` has exactly {len(args)} items; no index {index}")
        return args[index], index
    if get_origin(tp) is dict:  # free-form mapping such as `kwargs`
        return get_args(tp)[1], part
    if tp in (object, Any):
        return Any, part
    raise _Problem(f"`{_dotted(loc)}` is a single value, it has no key `{part}`")


def _set_path(data: dict, loc: Loc, value: Any) -> None:
    node: Any = data
    for depth, step in enumerate(loc[:-1]):
        make = list if isinstance(loc[depth + 1], int) else dict
        if isinstance(node, dict) and step not in node:
            # a list not in the file starts from its default, so `train.betas.1=0.95` works
            node[step] = _default_at(loc[: depth + 1]) if make is list else {}
        elif isinstance(node, list):
            _check_index(node, step, loc[:depth])
            if step == len(node):
                node.append(make())
        node = node[step]
        if not isinstance(node, make):
            kind = "list" if make is list else "mapping"
            raise _Problem(f"`{_dotted(loc[: depth + 1])}` is {_short(node)} in the file, not a {kind}")
    if isinstance(node, list):
        _check_index(node, loc[-1], loc[:-1])
        if loc[-1] == len(node):
            node.append(value)
            return
    node[loc[-1]] = value


def _default_at(loc: Loc) -> list:
    default = _annotation_at(loc[:-1]).model_fields[loc[-1]].get_default(call_default_factory=True)
    return _plain(default) if isinstance(default, tuple) else []


def _check_index(items: list, index: int, loc: Loc) -> None:
    if index > len(items):
        raise _Problem(
            f"`{_dotted(loc)}` has {len(items)} items; index {index} is past the end "
            f"(index {len(items)} adds one)"
        )


def _report(source: str, problems: list[str]) -> str:
    count = f" ({len(problems)} problems)" if len(problems) > 1 else ""
    return f"invalid config {source}{count}:\n" + "\n".join(f"  - {p}" for p in problems)


def _describe(err: dict, origins: dict[Loc, str]) -> str:
    loc = tuple(err["loc"])
    text = _FORMATTERS.get(err["type"], _generic)(loc, err)
    setters = [o for where, o in origins.items() if loc[: len(where)] == where]
    return text + (f" (set by override `{setters[-1]}`)" if setters else "")


def _unknown_key(loc: Loc) -> str:
    section = _annotation_at(loc[:-1])
    valid = list(section.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
    if close:
        return f"unknown key `{_dotted(loc)}`; did you mean `{_dotted(loc[:-1] + (close[0],))}`?"
    where = f" in `{_dotted(loc[:-1])}`" if loc[:-1] else ""
    return f"unknown key `{_dotted(loc)}`; valid keys{where}: {', '.join(valid)}"


def _annotation_at(loc: Loc) -> Any:
    tp: Any = Config
    for depth, step in enumerate(loc):
        tp, _ = _step(tp, loc[:depth], str(step))
    return _strip_optional(tp)


def _bound(op: str, ctx_key: str) -> Callable[[Loc, dict], str]:
    return lambda loc, err: f"{_dotted(loc)}: must be {op} {err['ctx'][ctx_key]} (got {_short(err['input'])})"


def _validator_message(loc: Loc, err: dict) -> str:
    message = str(err["ctx"]["error"]) if "error" in err.get("ctx", {}) else err["msg"]
    names_its_key = message.startswith(f"{_dotted(loc)}.")  # a section's check naming its own key
    return f"{_dotted(loc)}: {message}" if loc and not names_its_key else message


def _generic(loc: Loc, err: dict) -> str:
    message = err["msg"].replace("Input should be", "must be")
    return f"{_dotted(loc) or '(top level)'}: {message} (got {_short(err['input'])})"


_FORMATTERS: dict[str, Callable[[Loc, dict], str]] = {
    "extra_forbidden": lambda loc, err: _unknown_key(loc),
    "missing": lambda loc, err: f"{_dotted(loc)}: required key is missing",
    "greater_than": _bound(">", "gt"),
    "greater_than_equal": _bound(">=", "ge"),
    "less_than": _bound("<", "lt"),
    "less_than_equal": _bound("<=", "le"),
    "model_type": lambda loc, err: f"{_dotted(loc)}: must be a mapping of keys (got {_short(err['input'])})",
    "tuple_type": lambda loc, err: f"{_dotted(loc)}: must be a list (got {_short(err['input'])})",
    "value_error": _validator_message,
}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _dotted(loc: Loc) -> str:
    """``('reward', 0, 'fn')`` -> ``reward[0].fn``."""
    out = ""
    for step in loc:
        out += f"[{step}]" if isinstance(step, int) else (f".{step}" if out else str(step))
    return out


def _strip_optional(tp: Any) -> Any:
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _plain(value: Any) -> Any:
    """Tuples become lists (safe_dump writes no tuples); mappings and lists recursively."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
