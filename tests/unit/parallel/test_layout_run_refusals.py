"""What ``run_layout`` refuses before Ray starts or any model loads, beyond the degrees
and the model's shapes: LoRA where the learners cannot write its checkpoint, the MoE and
LoRA options pipeline stages cannot run, ``learner_strategy: fsdp2`` beside a layout that
shards nothing, ``pp_schedule`` without stages, a local run asked for a learner group,
and a ``WORLD_SIZE`` below 1; every problem in one line. Also the in-process guards that
stay behind those checks (the pipeline's and the checkpoint's)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from test_layout import train_before_loading

from rltune.config import load_config
from rltune.parallel.layout import LayoutError, run_layout

RAY2 = ("runtime.mode=ray", "runtime.placement.learners=2")
LORA_FIX = ("train LoRA on Ray with runtime.placement.learner_strategy: ddp and no train.parallel key, "
            "or in one process (runtime.mode: local)")


@pytest.fixture(autouse=True)
def _one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def config(*overrides: str):
    return load_config(None, ["name=t", "model.path=builtin:tiny", "data.train=builtin:arith_small/train",
                              *overrides])


def refusal(*overrides: str) -> str:
    with pytest.raises(LayoutError) as info:
        run_layout(config(*overrides))
    message = str(info.value)
    assert "\n" not in message
    return message


# ----------------------------------------------------------------------------- LoRA


@pytest.mark.parametrize("overrides", [
    ("runtime.placement.learner_strategy=fsdp2",),
    ("runtime.placement.learner_strategy=fsdp2", "runtime.placement.learners=1"),
    ("train.parallel.dp_replicate=2",),
    ("train.parallel.dp_shard=auto",),
    ("train.parallel.tp=2",),
])
def test_lora_on_ray_learners_that_cannot_write_its_checkpoint_is_refused(overrides: tuple[str, ...]) -> None:
    message = refusal(*RAY2, "model.lora.r=4", *overrides)
    assert "model.lora with " in message and "LoRA checkpoint" in message
    assert message.endswith(LORA_FIX) or LORA_FIX + ";" in message


def test_lora_is_accepted_where_its_checkpoint_can_be_written() -> None:
    assert run_layout(config(*RAY2, "model.lora.r=4")).dp_replicate == 2  # DDP learners
    assert run_layout(config("model.lora.r=4")).world == 1  # one process
    assert run_layout(config("model.lora.r=4", "train.parallel.dp_replicate=1")).world == 1


def test_the_lora_refusal_names_the_keys_that_make_the_layout_a_mesh() -> None:
    message = refusal(*RAY2, "model.lora.r=4", "train.parallel.dp_replicate=2")
    assert "model.lora with train.parallel set (dp_replicate) on Ray" in message
    message = refusal(*RAY2, "model.lora.r=4", "runtime.placement.learner_strategy=fsdp2")
    assert "model.lora with runtime.placement.learner_strategy=fsdp2" in message


def test_the_checkpoint_guards_give_the_same_advice_and_a_checkpoint_error() -> None:
    from rltune.checkpoint.sharded import refuse_lora
    from rltune.checkpoint.store import CheckpointError
    from rltune.config.schema import LoraConfig
    from rltune.models.load import load_model, resolve_model
    from rltune.models.lora import apply_lora
    from rltune.runtime.ray.fsdp_state import _refuse_fsdp2_lora

    model = apply_lora(load_model(resolve_model("builtin:tiny")), LoraConfig(r=2))
    with pytest.raises(CheckpointError, match="sharded checkpoints of a LoRA model") as info:
        refuse_lora(model, "ckpt")
    assert str(info.value).endswith(LORA_FIX) and "dp_replicate" not in str(info.value)
    with pytest.raises(CheckpointError, match="sharded with FSDP2") as info:
        _refuse_fsdp2_lora(SimpleNamespace(model=model))
    assert str(info.value).endswith(LORA_FIX)


# ----------------------------------------------------------------------------- pipeline


@pytest.mark.parametrize(("overrides", "needle"), [
    ((), "does not gather MoE router logits across stages, so it cannot add the load-balancing loss "
         "(coefficient 0.001, qwen2_moe's own router_aux_loss_coef): set model.router_aux_loss_coef: 0"),
    (("model.router_aux_loss_coef=0.02",), "(coefficient 0.02): set model.router_aux_loss_coef: 0"),
    (("model.router_aux_loss_coef=0", "model.moe.routing_replay=rollout"),
     "train.parallel.pp > 1 does not replay recorded MoE routes"),
    (("model.router_aux_loss_coef=0", "model.moe.aux_free_bias=0.01"),
     "model.moe.aux_free_bias moves each router's bias by the step's expert load"),
])
def test_what_moe_pipeline_stages_cannot_run_is_refused_at_start(overrides: tuple[str, ...], needle: str) -> None:
    message = refusal(*RAY2, "train.parallel.pp=2", "model.path=builtin:tiny-moe", *overrides)
    assert needle in message, message


def test_a_moe_pipeline_without_those_options_runs() -> None:
    layout = run_layout(config(*RAY2, "train.parallel.pp=2", "model.path=builtin:tiny-moe",
                               "model.router_aux_loss_coef=0"))
    assert layout.pp == 2
    assert run_layout(config(*RAY2, "train.parallel.pp=2")).pp == 2  # dense: no router loss to refuse


def test_sequence_parallel_and_lora_with_pipeline_stages_are_refused_at_start() -> None:
    message = refusal("runtime.mode=ray", "runtime.placement.learners=4", "train.parallel.pp=2", "train.parallel.tp=2",
                      "train.parallel.sequence_parallel=true")
    assert "pp > 1 with tp > 1 sends replicated hidden states between stages" in message
    message = refusal(*RAY2, "train.parallel.pp=2", "model.lora.r=4")
    assert "model.lora with train.parallel.pp=2: pipeline stages split a plain Llama-family decoder" in message


def test_pp_schedule_without_stages_is_refused() -> None:
    message = refusal("train.parallel.pp_schedule=gpipe")
    assert "train.parallel.pp_schedule=gpipe schedules pipeline stages, but pp=1 has none" in message
    assert run_layout(config("train.parallel.pp_schedule=1f1b")).pp == 1  # the default, written out
    assert run_layout(config(*RAY2, "train.parallel.pp=2", "train.parallel.pp_schedule=gpipe")).pp == 2


class _Built(Exception):
    """Raised in place of splitting the model: the checks before it passed."""


def _splitting(*args, **kwargs):
    raise _Built


def test_the_pipeline_refuses_a_replaying_or_moving_router_when_it_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    from rltune.models.load import load_model, resolve_model
    from rltune.models.routing import install_routing
    from rltune.parallel import pipeline

    monkeypatch.setattr(pipeline, "is_tied", _splitting)
    model = load_model(resolve_model("builtin:tiny-moe"))
    install_routing(model, replay=True)
    with pytest.raises(ValueError, match="does not replay recorded MoE routes"):
        pipeline.build_pipeline(model, mesh=None, schedule="1f1b", device=torch.device("cpu"))
    install_routing(model, aux_free_bias=0.01)
    with pytest.raises(ValueError, match="aux_free_bias moves each router's bias"):
        pipeline.build_pipeline(model, mesh=None, schedule="1f1b", device=torch.device("cpu"))
    install_routing(model, aux_free_bias=0.0)  # a bias kept at rate 0 (a restored export) does not move
    with pytest.raises(_Built):
        pipeline.build_pipeline(model, mesh=None, schedule="1f1b", device=torch.device("cpu"))


def test_recorded_routes_without_replay_do_not_stop_a_pipeline_step() -> None:
    """An MoE policy's samples carry their routes with replay off too; the stages' routers
    then choose by themselves. The step goes on to the objective (here one the pipeline
    does not run, which is the next refusal)."""
    from rltune.parallel.pipeline import Pipeline

    micro = [SimpleNamespace(routes=torch.zeros(1, 4, 2, 2, dtype=torch.int16))]
    objective = SimpleNamespace(forward=lambda *args: None)
    with pytest.raises(ValueError, match="runs the forwards logprob_forward"):
        Pipeline.train(SimpleNamespace(), micro, 1, objective, None, temperature=1.0, autocast=None, aux_loss_coef=0.0)


# ----------------------------------------------------------------------------- degrees


def test_a_local_run_asked_for_a_group_says_how_to_get_one_and_every_other_problem() -> None:
    message = refusal("train.parallel.ep=2")
    assert ("train.parallel ep=2 needs a learner group of 2 ranks, but runtime.mode=local trains the learner in one "
            "process; set runtime.mode: ray with runtime.placement.learners=2") in message
    assert "qwen2 is dense (no experts to split); set ep=1" in message
    assert "make the learner count a multiple" not in message
    message = refusal("train.parallel.tp=2", "train.parallel.pp=2")
    assert "pp=2, tp=2 needs a learner group of 4 ranks" in message and "runtime.placement.learners=4" in message
    message = refusal("train.parallel.dp_shard=2")
    assert "dp_shard=2 needs a learner group of 2 ranks" in message and "pp*dp_replicate" not in message


def test_on_ray_an_auto_that_does_not_divide_is_told_with_the_other_problems() -> None:
    message = refusal("runtime.mode=ray", "runtime.placement.learners=3", "train.parallel.ep=2")
    assert message.startswith("the learner layout (pp=1 dp_replicate=1 dp_shard=auto ep=2 tp=1) cannot run: ")
    assert "dp_shard=auto: the world of 3 learner rank(s) is not a multiple of" in message
    assert "; train.parallel.ep=2, but qwen2 is dense" in message


@pytest.mark.parametrize(("overrides", "shard"), [
    ((*RAY2, "train.parallel.dp_replicate=2"), "dp_shard=auto = 1 here"),
    (("runtime.mode=ray", "runtime.placement.learners=4", "train.parallel.tp=2"), "dp_shard=auto = 2 here"),
    ((*RAY2, "train.parallel.dp_shard=2"), "dp_shard=2 here"),
])
def test_fsdp2_beside_a_train_parallel_layout_is_refused(overrides: tuple[str, ...], shard: str) -> None:
    message = refusal(*overrides, "runtime.placement.learner_strategy=fsdp2")
    assert "runtime.placement.learner_strategy=fsdp2 is not read once train.parallel is set (" in message
    assert f"shards parameters over its dp_shard ranks ({shard}); remove learner_strategy" in message
    layout = run_layout(config(*overrides, "runtime.placement.learner_strategy=ddp"))  # the default, written out
    assert layout.world == int(overrides[1].rsplit("=", 1)[1])


@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_world_size_below_one_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("WORLD_SIZE", value)
    with pytest.raises(LayoutError, match=f"environment variable WORLD_SIZE='{value}': the number of processes"):
        run_layout(config())


def test_train_refuses_lora_on_fsdp2_learners_in_one_line_before_anything_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    code, line = train_before_loading(tmp_path, monkeypatch, capsys,
                                      *RAY2, "runtime.placement.learner_strategy=fsdp2", "model.lora.r=4")
    assert code == 2
    assert "model.lora with runtime.placement.learner_strategy=fsdp2" in line
    assert not (tmp_path / "t").exists()


# ----------------------------------------------------------------------------- tensor parallelism


def test_tp_on_a_model_type_without_a_plan_is_refused_before_ray_starts() -> None:
    """A vision-language model's own type (qwen2_vl) has no plan, though its language
    model's (qwen2) has: the learner splits the whole model, so the type is the model's."""
    message = refusal(*RAY2, "train.parallel.tp=2", "model.path=builtin:tiny-vl")
    assert message.endswith("train.parallel.tp=2: tensor parallelism has no plan for model_type 'qwen2_vl'; "
                            "supported model types: llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe; "
                            "set tp: 1 for this model")
    assert run_layout(config(*RAY2, "train.parallel.tp=2")).tp == 2  # the text model's own plan


def test_pp_on_a_vision_language_model_is_refused_before_ray_starts() -> None:
    message = refusal(*RAY2, "train.parallel.pp=2", "model.path=builtin:tiny-vl")
    assert message.endswith("train.parallel.pp=2: pipeline stages run token ids only, and model_type 'qwen2_vl' is a "
                            "vision-language model (images go through its vision tower first); set pp: 1")
