"""docs/algorithms.md agrees with the code: a section for every registered algorithm, the
overview table matches the registry, every ``rltune.algos`` name it gives exists, every
algorithm's functions are named in its section, and every config default it quotes is
the schema's (presets included)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import rltune.algos
from rltune.algos import ALGORITHMS
from rltune.config.schema import (
    ALGO_PRESETS,
    AlgoConfig,
    DataConfig,
    LoraConfig,
    ModelConfig,
    RolloutConfig,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "algorithms.md"
TEXT = DOC.read_text(encoding="utf-8")

# "| `algo.clip_high` | `0.28` | ..." -> ("algo.clip_high", "0.28")
CONFIG_ROW = re.compile(r"^\| `([a-z_.]+)` \| `([^`]*)` \|", re.MULTILINE)
SECTIONS = {
    "algo": lambda algo: AlgoConfig(name=algo) if algo else AlgoConfig(),
    "model.lora": lambda algo: LoraConfig(),
    "model": lambda algo: ModelConfig(),
    "rollout": lambda algo: RolloutConfig(),
    "data": lambda algo: DataConfig(),
}


def sections() -> list[tuple[str, list[str], str]]:
    """``(heading, algorithm names in its backticks, body)`` of every ``## `` section."""
    parts = re.split(r"^## ", TEXT, flags=re.MULTILINE)[1:]
    out = []
    for part in parts:
        heading, _, body = part.partition("\n")
        out.append((heading, re.findall(r"`([a-z_]+)`", heading), body))
    return out


def algorithm_sections() -> dict[str, str]:
    found: dict[str, str] = {}
    for heading, names, body in sections():
        for name in names:
            assert name in ALGORITHMS, f"section {heading!r} names {name!r}, which is not registered"
            assert name not in found, f"{name!r} has two sections"
            found[name] = body
    return found


def parse_value(text: str) -> object:
    """A default as the page writes it (YAML-like: null, true, 0.2, token-mean)."""
    if text in ("null", "true", "false"):
        return {"null": None, "true": True, "false": False}[text]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def config_rows(body: str) -> list[tuple[str, str]]:
    return CONFIG_ROW.findall(body)


def expected(key: str, algo: str | None) -> object:
    section, _, field = key.rpartition(".")
    assert section in SECTIONS, f"{key}: no config section {section!r} known to this test"
    cfg = SECTIONS[section](algo)
    assert field in type(cfg).model_fields, f"{key}: {type(cfg).__name__} has no field {field!r}"
    return getattr(cfg, field)


def test_every_registered_algorithm_has_one_section():
    assert set(algorithm_sections()) == set(ALGORITHMS)


def test_overview_table_matches_the_registry():
    for name, algo in ALGORITHMS.items():
        rows = re.findall(rf"^\| `{name}` \| (\w+) \| (\w+) \| ([^|]+) \|", TEXT, flags=re.MULTILINE)
        assert len(rows) == 1, f"overview table: {len(rows)} rows for {name!r}"
        data, critic, reference = (cell.strip() for cell in rows[0])
        assert data == ("online" if algo.online else "offline"), name
        assert critic == ("yes" if algo.needs_critic else "no"), name
        if algo.needs_reference:
            assert reference == "always", name
        elif algo.uses_reference_when_kl:
            assert reference == "if kl_coef > 0", name
        else:
            assert reference == "no", name


def resolve(dotted: str) -> object:
    """The object ``rltune.algos.a.b`` names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for split in range(len(parts), 1, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attr in parts[split:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_every_rltune_algos_name_exists():
    names = set(re.findall(r"rltune\.algos(?:\.[A-Za-z_]\w*)+", TEXT))
    assert names, "the page names no rltune.algos function"
    for dotted in sorted(names):
        try:
            resolve(dotted)
        except (AttributeError, ModuleNotFoundError):
            pytest.fail(f"docs/algorithms.md names {dotted}, which does not exist")


def test_each_section_names_its_algorithm_functions():
    for name, body in algorithm_sections().items():
        algo = ALGORITHMS[name]
        for fn in (algo.advantage, algo.baseline, algo.loss):
            if fn is not None:
                assert getattr(rltune.algos, fn.__name__) is fn
                assert f"`rltune.algos.{fn.__name__}`" in body, f"section of {name!r} lacks {fn.__name__}"


def test_defaults_quoted_in_algorithm_sections_are_the_schema_s():
    for name, body in algorithm_sections().items():
        rows = config_rows(body)
        for key, value in rows:
            assert parse_value(value) == expected(key, name), f"{name}: {key} is not `{value}`"
        quoted = {key for key, _ in rows}
        for preset_key in ALGO_PRESETS.get(name, {}):
            assert f"algo.{preset_key}" in quoted, f"{name}: preset algo.{preset_key} not in its table"


def test_defaults_quoted_elsewhere_are_the_schema_s():
    for heading, names, body in sections():
        if names:
            continue
        for key, value in config_rows(body):
            assert parse_value(value) == expected(key, None), f"{heading}: {key} is not `{value}`"


def test_every_algo_key_is_documented():
    quoted = {key for key, _ in config_rows(TEXT)}
    missing = {f"algo.{field}" for field in AlgoConfig.model_fields if field != "name"} - quoted
    assert not missing, f"docs/algorithms.md documents no default for {sorted(missing)}"


def test_parse_value():
    assert [parse_value(v) for v in ("null", "true", "8", "3e-4", "0.0", "token-mean")] == [
        None, True, 8, 3e-4, 0.0, "token-mean",
    ]
