"""What a resume checks in a checkpoint's state before loading anything (its files
verified: a state.json edited with its checksum, or written by a faulty save): the step,
the number kinds of the counters, schedule and optimizer, the roles the state belongs to,
and the KL reference's fingerprint. Each refusal is one CheckpointError naming the
checkpoint and the entry."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rltune.checkpoint.state import optimizer_from_state, optimizer_to_state
from rltune.checkpoint.store import CheckpointError
from rltune.runtime.resumable import check_resumable, check_step

PATH = Path("runs/r/checkpoints/step-2")

META = {
    "step": 2,
    "model": {"format": "full"},
    "optimizer": {"state": {}, "param_groups": [{
        "lr": 7e-05, "betas": [0.9, 0.99], "eps": 1e-08, "weight_decay": 0.0, "amsgrad": False, "maximize": False,
        "foreach": None, "capturable": False, "differentiable": False, "fused": True, "decoupled_weight_decay": True,
        "initial_lr": 7e-05, "params": [0, 1]}]},
    "scheduler": {"base_lrs": [7e-05], "last_epoch": 2, "_step_count": 3, "_is_initial": False,
                  "_get_lr_called_within_step": False, "_last_lr": [6e-05], "lr_lambdas": [{}]},
    "learner": {"version": 2, "nonfinite_in_a_row": 0, "nonfinite_total": 0, "precision": {}},
}


class _Reference:
    def __init__(self, fingerprint: str | None) -> None:
        self._fingerprint = fingerprint

    def fingerprint(self) -> str | None:
        return self._fingerprint


def _run(*, steps: int = 3, critic: bool = False, kl: bool = False, reference: str | None = None,
         lora_reference: bool = False, algo: str = "grpo"):
    ref = _Reference(None) if lora_reference else (_Reference(reference) if reference is not None else None)
    cfg = SimpleNamespace(train=SimpleNamespace(steps=steps), model=SimpleNamespace(path="models/base"),
                          algo=SimpleNamespace(name=algo, kl_coef=0.04 if ref is not None else 0.0))
    roles = SimpleNamespace(critic=object() if critic else None, kl=object() if kl else None, reference=ref)
    return SimpleNamespace(cfg=cfg, roles=roles)


def _check(run, meta, tensors=None, marker_step=2):
    return check_resumable(run, tensors or {"model": {}}, meta, PATH, marker_step=marker_step)


def _edited(edit) -> dict:
    meta = copy.deepcopy(META)
    edit(meta)
    return meta


def test_a_checkpoint_as_a_run_writes_it_passes() -> None:
    assert _check(_run(), META) == ()


@pytest.mark.parametrize("step, match", [
    (-1, "state.json has step -1, not a whole number >= 0"),
    ("2", "state.json has step '2', not a whole number >= 0"),
    (2.0, "state.json has step 2.0, not a whole number >= 0"),
    (True, "state.json has step True, not a whole number >= 0"),
    (100, "state.json says step 100 but COMPLETE says 2"),
    (1, "state.json says step 1 but COMPLETE says 2"),
])
def test_a_step_other_than_the_marker_s_is_refused(step, match) -> None:
    with pytest.raises(CheckpointError, match=rf"checkpoint {PATH}: {match}; the checkpoint was edited"):
        _check(_run(), _edited(lambda m: m.update(step=step)))


def test_a_checkpoint_past_train_steps_is_refused_saying_what_to_do() -> None:
    with pytest.raises(CheckpointError, match=rf"checkpoint {PATH} is at step 2, past train.steps=1: there is nothing "
                       r"left to train; to continue the run set train.steps above 2; to write out its model use "
                       rf"`rltune export RUN OUT --checkpoint {PATH}`"):
        _check(_run(steps=1), META)
    assert check_step(META, PATH, marker_step=2, total=2) == 2  # the run's last step: nothing left, not an error


@pytest.mark.parametrize("edit, match", [
    (lambda m: m["learner"].update(version="abc"), r"learner.version is 'abc', not a whole number >= 0"),
    (lambda m: m["learner"].update(nonfinite_in_a_row="x"),
     r"learner.nonfinite_in_a_row is 'x', not a whole number >= 0"),
    (lambda m: m["learner"].update(nonfinite_total=-1), r"learner.nonfinite_total is -1, not a whole number >= 0"),
    (lambda m: m["learner"].update(precision={"scale": "big"}), r"learner.precision.scale is 'big', not a number > 0"),
    (lambda m: m["scheduler"].update(last_epoch=-5), r"scheduler.last_epoch is -5, not a whole number >= 0"),
    (lambda m: m["scheduler"].update(base_lrs=["fast"]),
     r"scheduler.base_lrs is \['fast'\], not a list of numbers >= 0"),
    (lambda m: m["optimizer"]["param_groups"][0].update(lr="fast"),
     r"optimizer.param_groups\[0\].lr is 'fast', not a number >= 0"),
    (lambda m: m["optimizer"]["param_groups"][0].update(lr=float("nan")),
     r"optimizer.param_groups\[0\].lr is nan, not a number >= 0"),
    (lambda m: m["optimizer"]["param_groups"][0].update(betas=[0.9]),
     r"optimizer.param_groups\[0\].betas is \[0.9\], not two numbers in \[0, 1\)"),
    (lambda m: m["optimizer"]["param_groups"][0].update(fused="yes"),
     r"optimizer.param_groups\[0\].fused is 'yes', not true, false or null"),
])
def test_a_value_of_the_wrong_kind_is_refused_before_loading(edit, match) -> None:
    with pytest.raises(CheckpointError, match=rf"checkpoint {PATH}: state.json's {match}; the checkpoint was edited"):
        _check(_run(), _edited(edit))


def test_the_critic_s_state_is_checked_too() -> None:
    meta = _edited(lambda m: m.update(critic_learner={"version": "v"}))
    with pytest.raises(CheckpointError, match=r"critic_learner.version is 'v'"):
        _check(_run(critic=True), meta, tensors={"model": {}, "critic_model": {}})


def test_a_critic_in_a_run_without_one_is_refused() -> None:
    """PPO's checkpoint resumed by GRPO (its config record gone): the critic's state would
    be dropped silently."""
    meta = _edited(lambda m: m.update(critic_learner=m["learner"], kl_coef=0.02))
    with pytest.raises(CheckpointError, match=rf"checkpoint {PATH} holds a critic \(critic_learner, critic_model\), "
                       r"which only an algorithm with a value model \(ppo\) writes; it was not written by a run of "
                       r"algo 'grpo'"):
        _check(_run(), meta, tensors={"model": {}, "critic_model": {}})


def test_an_in_reward_kl_coefficient_in_a_run_without_one_is_refused() -> None:
    with pytest.raises(CheckpointError, match=r"holds an in-reward KL coefficient \(kl_coef\)"):
        _check(_run(), _edited(lambda m: m.update(kl_coef=0.02)))
    with pytest.raises(CheckpointError, match=r"state.json's kl_coef is 'abc', not a number >= 0"):
        _check(_run(kl=True), _edited(lambda m: m.update(kl_coef="abc")))


def test_a_kl_reference_in_a_run_without_one_is_refused() -> None:
    with pytest.raises(CheckpointError, match=r"was written by a run with a KL reference \(algo.kl_coef > 0\), "
                       r"and this run has none"):
        _check(_run(), _edited(lambda m: m.update(reference="ab12")))


def test_another_kl_reference_at_model_path_is_refused() -> None:
    meta = _edited(lambda m: m.update(reference="ab12"))
    assert _check(_run(reference="ab12"), meta) == ()
    with pytest.raises(CheckpointError, match=rf"checkpoint {PATH}: the KL reference loaded from "
                       r"model.path=models/base is not the one the run started from .* put back the weights the run "
                       r"started from, or start a new run"):
        _check(_run(reference="cd34"), meta)


def test_a_checkpoint_without_a_reference_record_resumes_with_a_note() -> None:
    """Written by an earlier rltune: nothing to compare with, and the console says so;
    a LoRA checkpoint's own fingerprint covers its base, and a LoRA run's reference (the
    base with adapters off) is not recorded."""
    (note,) = _check(_run(reference="cd34"), META)
    assert note.startswith(f"note: checkpoint {PATH} records no fingerprint of the KL reference")
    adapters = _edited(lambda m: m.update(model={"format": "lora-adapters", "frozen": "x"}))
    assert _check(_run(reference="cd34"), adapters) == ()
    assert _check(_run(lora_reference=True), _edited(lambda m: m.update(reference="ab12"))) == ()


def test_the_optimizer_refuses_hyper_parameters_of_another_kind() -> None:
    """The library-level check, for a checkpoint loaded without the runtime's checks."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    tensors, meta = optimizer_to_state(opt)
    meta["param_groups"][0]["lr"] = "fast"
    with pytest.raises(CheckpointError, match=r"optimizer meta param_groups\[0\]\['lr'\] is 'fast', where the "
                       r"optimizer has 0.1"):
        optimizer_from_state(opt, tensors, meta)
    meta["param_groups"][0].update(lr=0.2, betas=[0.9, "x"])
    with pytest.raises(CheckpointError, match=r"\['betas'\] is \[0.9, 'x'\]"):
        optimizer_from_state(opt, tensors, meta)
    meta["param_groups"][0]["betas"] = [0.8, 0.9]
    optimizer_from_state(opt, tensors, meta)
    assert opt.param_groups[0]["lr"] == 0.2 and opt.param_groups[0]["betas"] == (0.8, 0.9)
