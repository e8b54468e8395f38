"""The learner layout (``rltune.parallel.layout``): ``dp_shard: auto``, the
back-compatibility rule, every refusal (one line naming the keys, numbers and fix), and
``rltune train`` refusing an impossible layout with exit code 2 before any model loads."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import rltune.models.load
from rltune.cli import main
from rltune.config import load_config
from rltune.config.parallel import ParallelConfig
from rltune.parallel.layout import (
    Layout,
    LayoutError,
    check_layout,
    layout_for,
    layout_problems,
    model_config_of,
    resolve_layout,
    run_layout,
)

TINY = model_config_of("builtin:tiny")  # 4 heads, 2 KV heads, 4 layers, vocab 260, dense
MOE = model_config_of("builtin:tiny-moe")  # 4 experts, 2 layers
NARROW_MLP = SimpleNamespace(model_type="qwen2", num_attention_heads=4, num_key_value_heads=4, vocab_size=260,
                             intermediate_size=6)  # only the MLP's width does not split 4 ways
WIDE = SimpleNamespace(model_type="wide", num_attention_heads=8, num_key_value_heads=8, vocab_size=260,
                       num_hidden_layers=4)  # only the vocabulary refuses tp=8


def config(*overrides: str):
    return load_config(None, ["name=t", "model.path=builtin:tiny", "data.train=builtin:arith_small/train",
                              *overrides])


def test_builtin_configs_are_read_without_weights() -> None:
    assert (TINY.num_attention_heads, TINY.num_key_value_heads, TINY.num_hidden_layers, TINY.vocab_size) == (4, 2, 4, 260)
    assert (MOE.num_experts, MOE.num_hidden_layers) == (4, 2)


def test_auto_takes_what_the_other_degrees_leave() -> None:
    layout = resolve_layout(ParallelConfig(tp=2, dp_replicate=2), 8)
    assert (layout.dp_shard, layout.world, layout.data_world) == (2, 8, 4)
    assert layout.shape == (1, 2, 2, 1, 2)  # pp, dp_replicate, dp_shard, ep, tp
    assert resolve_layout(ParallelConfig(), 3).dp_shard == 3
    with pytest.raises(LayoutError, match=r"dp_shard=auto: the world of 6 .* not a multiple of .* = 4"):
        resolve_layout(ParallelConfig(tp=2, pp=2), 6)


def test_an_explicit_dp_shard_is_taken_as_is() -> None:
    layout = resolve_layout(ParallelConfig(dp_shard=2, tp=2), 8)
    assert layout.world == 4
    assert layout_problems(layout, 8, TINY) == [
        "train.parallel: pp*dp_replicate*dp_shard*ep*tp = 1*1*2*1*2 = 4 ranks, but the learner group has 8 "
        "(runtime.placement.learners on Ray; WORLD_SIZE or 1 process locally); make the product 8 "
        "(dp_shard: auto takes what the others leave)"
    ]


@pytest.mark.parametrize(("strategy", "expected"), [("ddp", Layout(dp_replicate=4)), ("fsdp2", Layout(dp_shard=4))])
def test_nothing_under_train_parallel_follows_the_learner_strategy(strategy: str, expected: Layout) -> None:
    cfg = config(f"runtime.placement.learner_strategy={strategy}")
    assert layout_for(cfg, 4) == expected


def test_any_key_under_train_parallel_makes_the_layout_its_own() -> None:
    cfg = config("runtime.placement.learner_strategy=ddp", "train.parallel.tp=2")
    assert layout_for(cfg, 4) == Layout(dp_shard=2, tp=2)


@pytest.mark.parametrize(("layout", "model", "needle"), [
    (Layout(tp=3), TINY, "tp=3 does not divide qwen2's num_attention_heads=4, num_key_value_heads=2, "
                         "vocab_size=260, intermediate_size=512 (tensor parallelism splits the heads, the "
                         "vocabulary and the MLP widths evenly); choose tp among [1, 2]"),
    (Layout(tp=4), TINY, "tp=4 does not divide qwen2's num_key_value_heads=2 ("),
    (Layout(tp=8), WIDE, "tp=8 does not divide wide's vocab_size=260 (tensor parallelism splits the heads, "
                         "the vocabulary and the MLP widths evenly); choose tp among [1, 2, 4]"),
    (Layout(tp=2), WIDE, "train.parallel.tp=2: tensor parallelism has no plan for model_type 'wide'; supported "
                         "model types: llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe; set tp: 1"),
    (Layout(tp=4), NARROW_MLP, "tp=4 does not divide qwen2's intermediate_size=6 ("),
    (Layout(pp=5), TINY, "pp=5 stages, but qwen2 has 4 layers (each stage needs at least one); set pp <= 4"),
    (Layout(ep=2), TINY, "ep=2, but qwen2 is dense (no experts to split); set ep=1"),
    (Layout(ep=3), MOE, "ep=3 does not divide qwen2_moe's 4 experts; choose ep among [1, 2, 4]"),
    (Layout(dp_shard=2, sequence_parallel=True), TINY, "sequence_parallel=true needs tp > 1"),
])
def test_each_refusal_names_keys_numbers_and_fix(layout: Layout, model, needle: str) -> None:
    problems = layout_problems(layout, layout.world, model)
    assert any(needle in p for p in problems), problems
    assert all("\n" not in p for p in problems)
    with pytest.raises(LayoutError, match="cannot run"):
        check_layout(layout, layout.world, model)


def test_possible_layouts_have_no_problem() -> None:
    for layout, model in [(Layout(tp=2), TINY), (Layout(tp=2, pp=4), TINY), (Layout(ep=4), MOE),
                          (Layout(dp_replicate=2, dp_shard=2, ep=2, tp=2, pp=2), MOE)]:
        assert layout_problems(layout, layout.world, model) == []


def test_the_world_is_the_learner_count_on_ray_and_world_size_locally(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert run_layout(config()).world == 1
    assert run_layout(config("runtime.mode=ray", "runtime.placement.learners=4", "train.parallel.tp=2")).shape == (
        1, 1, 2, 1, 2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert layout_for(config("train.parallel.dp_replicate=2"), 2).dp_replicate == 2
    # the local runtime forms no group: several processes would train separate copies
    with pytest.raises(LayoutError, match=r"WORLD_SIZE=2: runtime.mode=local .* runtime.placement.learners=2"):
        run_layout(config("train.parallel.dp_replicate=2"))


def train_before_loading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                         *overrides: str) -> tuple[int, str]:
    """``rltune train`` of a tiny config with ``overrides``, where loading a model fails the
    test; returns the exit code and the error lines (checked to be one, with no traceback)."""
    monkeypatch.setenv("COLUMNS", "500")  # rich wraps at 80 columns without a terminal
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the layout was checked")

    monkeypatch.setattr(rltune.models.load, "load_model", no_loading)
    monkeypatch.setattr(rltune.models.load, "resolve_model", no_loading)
    path = tmp_path / "run.yaml"
    path.write_text("name: t\nmodel: {path: builtin:tiny}\ndata: {train: builtin:arith_small/train}\n"
                    f"log: {{dir: {tmp_path}}}\n")
    code = main(["train", str(path), *overrides])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in out + err, err
    return code, lines[0]


def test_train_refuses_an_impossible_layout_in_one_line_before_loading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    code, line = train_before_loading(tmp_path, monkeypatch, capsys,
                                      "train.parallel.tp=3", "runtime.mode=ray", "runtime.placement.learners=3")
    assert code == 2
    assert "tp=3 does not divide qwen2's num_attention_heads=4" in line


def test_a_directory_config_is_read_from_config_json(tmp_path: Path) -> None:
    from rltune.models.load import ModelLoadError
    from rltune.models.tiny import ARCH_CONFIGS

    ARCH_CONFIGS["qwen2"](hidden_size=64, layers=3, heads=6, kv_heads=3, vocab_size=300).save_pretrained(tmp_path)
    config = model_config_of(str(tmp_path))
    assert (config.num_attention_heads, config.num_hidden_layers) == (6, 3)
    assert any("tp=4 does not divide qwen2's num_attention_heads=6" in p
               for p in layout_problems(Layout(tp=4), 4, config))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json"):  # the loader's own message
        model_config_of(str(tmp_path / "empty"))
    with pytest.raises(ModelLoadError, match="does not exist"):
        model_config_of(str(tmp_path / "missing"))
