"""``train.parallel``'s degrees are whole numbers of ranks (no ``true``, ``2.0`` or
``"2"`` taken for one, nothing below 1), ``dp_shard`` one of them or ``auto``; and
``train.offload: params`` needs learners with a GPU, as ``offload: optimizer`` does."""

from __future__ import annotations

import pytest

from rltune.config import ConfigError, load_config


def config(*overrides: str):
    return load_config(None, ["name=t", *overrides])


@pytest.mark.parametrize("key", ["dp_replicate", "tp", "pp", "ep"])
@pytest.mark.parametrize(("value", "needle"), [
    ("0", "must be >= 1 (got 0)"),
    ("-2", "must be >= 1 (got -2)"),
    ("true", "must be a valid integer (got True)"),
    ("2.0", "must be a valid integer (got 2.0)"),
    ('"2"', "must be a valid integer (got '2')"),
])
def test_a_degree_is_a_whole_number_of_at_least_one(key: str, value: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        config(f"train.parallel.{key}={value}")
    problems = [line for line in str(info.value).splitlines() if line.startswith("  - ")]
    assert len(problems) == 1 and f"train.parallel.{key}: {needle}" in problems[0], str(info.value)


@pytest.mark.parametrize("value", ["0", "-1", "true", "false", "1.5", '"2"', "automatic"])
def test_dp_shard_is_a_whole_number_of_at_least_one_or_auto(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        config(f"train.parallel.dp_shard={value}")
    problems = [line for line in str(info.value).splitlines() if line.startswith("  - ")]
    assert len(problems) == 1, str(info.value)
    assert "train.parallel.dp_shard: must be a whole number >= 1 or 'auto' (got " in problems[0]


def test_valid_degrees_are_taken() -> None:
    parallel = config("train.parallel.dp_shard=2", "train.parallel.tp=2", "train.parallel.dp_replicate=1").train.parallel
    assert (parallel.dp_shard, parallel.tp, parallel.dp_replicate) == (2, 2, 1)
    assert config("train.parallel.dp_shard=auto").train.parallel.dp_shard == "auto"
    assert config().train.parallel.dp_shard == "auto"


FSDP2_RAY = ("runtime.mode=ray", "runtime.placement.learners=2", "runtime.placement.learner_strategy=fsdp2")


@pytest.mark.parametrize("layout", [("runtime.placement.learner_strategy=fsdp2",), ("train.parallel.dp_shard=2",)])
def test_params_offload_on_learners_without_a_gpu_is_refused_as_optimizer_offload_is(layout: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as info:
        config("runtime.mode=ray", "runtime.placement.learners=2", *layout, "train.offload=params")
    assert ("train.offload: params moves FSDP2's sharded parameters, gradients and optimizer state from the "
            "learners' GPUs to host memory, but the learners reserve no GPU (runtime.placement.learner.gpus: 0)"
            ) in str(info.value)
    with pytest.raises(ConfigError, match=r"the learners reserve no GPU \(runtime.placement.learner.gpus: 0\)"):
        config("runtime.mode=ray", "runtime.placement.learners=2", "train.offload=optimizer")


def test_params_offload_on_gpu_learners_is_taken() -> None:
    cfg = config(*FSDP2_RAY, "runtime.placement.learner.gpus=1", "train.offload=params")
    assert cfg.train.offload == "params"


@pytest.mark.parametrize("overrides", [(), ("train.parallel.tp=2",), ("train.parallel.dp_shard=auto",)])
def test_a_saved_config_asks_for_the_same_layout(tmp_path, overrides) -> None:
    """Setting a train.parallel key is what asks for a mesh layout: the run's config.yaml
    read back sets the same keys (not every default), so a run trained from it, or a
    layout check of it, sees the layout the run had."""
    from rltune.config.load import save_resolved_config

    cfg = load_config(None, ["reward.0.fn=m:f", "runtime.mode=ray", "runtime.placement.learners=2", *overrides])
    back = load_config(save_resolved_config(cfg, tmp_path), [])
    assert back.train.parallel.model_fields_set == cfg.train.parallel.model_fields_set
    assert back == cfg
