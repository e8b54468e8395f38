"""`rltune export RUN_DIR OUT_DIR [--checkpoint PATH]`: the exported directory loads with
plain transformers and computes what the checkpoint's model computes; LoRA runs come out
merged; a missing run, a run without checkpoints, a checkpoint path that is not one, a
busy output directory, an output under a file or inside the run's checkpoints, weights
that do not fit the run's config, a checkpoint of another run, and a checkpoint the
training run pruned while it was read are one message and exit code 2 (a newest
checkpoint pruned meanwhile gives way to the newest again)."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

import rltune.checkpoint.store as store
from rltune.checkpoint import load_checkpoint, save_checkpoint
from rltune.checkpoint.model import model_to_state
from rltune.cli import main
from rltune.config import load_config, save_resolved_config
from rltune.models.load import load_model, resolve_model
from rltune.models.lora import apply_lora
from rltune.models.routing import find_routers
from rltune.runtime.local import run_local
from cli_check import fails

pytestmark = pytest.mark.usefixtures("keep_torch_threads")

IDS = torch.tensor([[30, 70, 11, 122, 95, 14, 3], [50, 52, 200, 2, 111, 39, 3]])


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    """One message per line, paths included (rich wraps at 80 columns otherwise)."""
    monkeypatch.setenv("COLUMNS", "500")


def _config(log_dir: Path, *overrides: str):
    return load_config(None, [
        "name=export-run",
        "model.path=builtin:tiny",
        "algo.name=sft",
        "data.train=builtin:arith_small/train",
        "train.steps=2",
        "train.prompts_per_step=2",
        "train.lr=1e-2",
        "train.threads=1",
        "checkpoint.every=1",
        "checkpoint.keep=2",
        "checkpoint.final=false",
        f"log.dir={log_dir}",
        "log.console=false",
        *overrides,
    ])


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """A real 2-step SFT run with a checkpoint after each step."""
    return run_local(_config(tmp_path_factory.mktemp("runs")))


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=IDS).logits


def _checkpoint_model(path: Path) -> torch.nn.Module:
    model = load_model(resolve_model("builtin:tiny"))
    model.load_state_dict(load_checkpoint(path)[0]["model"], strict=False)  # tied lm_head
    return model


def _exported(out: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(out, local_files_only=True)


def _succeeds(capsys, argv: list[str]) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, (out, err)
    return err


def test_export_writes_the_newest_checkpoint(capsys, sft_run, tmp_path):
    checkpoints = sft_run.run_dir / "checkpoints"
    err = _succeeds(capsys, ["export", str(sft_run.run_dir), str(tmp_path / "out")])
    assert f"exported {checkpoints / 'step-2'} to {tmp_path / 'out'}" in err
    exported = _logits(_exported(tmp_path / "out"))
    assert torch.equal(exported, _logits(_checkpoint_model(checkpoints / "step-2")))
    assert torch.equal(exported, _logits(sft_run.learner.model))  # the model the run ended with
    assert (exported - _logits(load_model(resolve_model("builtin:tiny")))).abs().max() > 1e-3
    assert (tmp_path / "out" / "tokenizer.json").is_file()


def test_export_of_a_chosen_checkpoint(capsys, sft_run, tmp_path):
    step_1 = sft_run.run_dir / "checkpoints" / "step-1"
    _succeeds(capsys, ["export", str(sft_run.run_dir), str(tmp_path / "out"), "--checkpoint", str(step_1)])
    exported = _logits(_exported(tmp_path / "out"))
    assert torch.equal(exported, _logits(_checkpoint_model(step_1)))
    assert not torch.equal(exported, _logits(sft_run.learner.model))


@pytest.mark.parametrize("fmt", ["adapters", "full state_dict"])
def test_a_lora_run_is_exported_merged(capsys, tmp_path, fmt):
    """A LoRA run directory written through the config and checkpoint APIs: the resolved
    config with ``model.lora``, and a checkpoint of adapters (or, as a runtime that
    saves ``model.state_dict()`` writes it, the wrapped model's full state without meta)."""
    cfg = _config(tmp_path / "runs", "model.lora.r=4", "model.lora.alpha=8")
    run_dir = tmp_path / "runs" / cfg.name
    save_resolved_config(cfg, run_dir)
    model = apply_lora(load_model(resolve_model("builtin:tiny")), cfg.model.lora)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=g) * 0.05)
    tensors, meta = model_to_state(model) if fmt == "adapters" else (model.state_dict(), None)
    save_checkpoint(run_dir / "checkpoints", 3, tensors={"model": tensors}, meta={"model": meta}, keep=1)

    _succeeds(capsys, ["export", str(run_dir), str(tmp_path / "out")])
    assert not list((tmp_path / "out").glob("adapter*"))
    exported = _logits(_exported(tmp_path / "out"))
    torch.testing.assert_close(exported, _logits(model), atol=1e-5, rtol=0)
    assert (exported - _logits(load_model(resolve_model("builtin:tiny")))).abs().max() > 1e-2


def test_missing_run_directory(capsys, tmp_path):
    err = fails(capsys, ["export", str(tmp_path / "nope"), str(tmp_path / "out")])
    assert f"run directory {tmp_path / 'nope'} does not exist" in err


def test_a_run_without_checkpoints(capsys, sft_run, tmp_path):
    run_dir = tmp_path / "bare"
    run_dir.mkdir()
    shutil.copy(sft_run.run_dir / "config.yaml", run_dir)
    err = fails(capsys, ["export", str(run_dir), str(tmp_path / "out")])
    assert f"run directory {run_dir} has no complete checkpoint under {run_dir / 'checkpoints'}" in err
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_path_that_does_not_exist(capsys, sft_run, tmp_path):
    err = fails(capsys, ["export", str(sft_run.run_dir), str(tmp_path / "out"), "--checkpoint", str(tmp_path / "step-9")])
    assert f"checkpoint {tmp_path / 'step-9'} does not exist" in err


def test_an_output_directory_with_files_is_left_alone(capsys, sft_run, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    err = fails(capsys, ["export", str(sft_run.run_dir), str(tmp_path / "out")])
    assert f"output directory {tmp_path / 'out'} already exists and is not empty" in err
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


def test_an_empty_output_directory_is_filled_and_the_files_beside_it_kept(capsys, sft_run, tmp_path):
    """An existing empty output directory is used; directories beside it, even one named
    as the export once named its backup (``.out.old``), are the user's and stay."""
    (tmp_path / "out").mkdir()
    (tmp_path / ".out.old").mkdir()
    (tmp_path / ".out.old" / "notes.txt").write_text("mine")
    _succeeds(capsys, ["export", str(sft_run.run_dir), str(tmp_path / "out")])
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert (tmp_path / ".out.old" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.old", "out"]  # nothing temporary left


def test_an_output_under_a_file(capsys, sft_run, tmp_path):
    (tmp_path / "afile").write_text("mine")
    err = fails(capsys, ["export", str(sft_run.run_dir), str(tmp_path / "afile" / "sub")])
    assert f"output directory {tmp_path / 'afile' / 'sub'}: {tmp_path / 'afile'} is a file, not a directory" in err
    assert (tmp_path / "afile").read_text() == "mine"


@pytest.mark.parametrize("where", ["the run", "a checkpoint", "the checkpoint root"])
def test_an_output_inside_the_run_s_checkpoints_or_the_run_itself(capsys, sft_run, where):
    run_dir = sft_run.run_dir
    out, message = {
        "the run": (run_dir, f"output directory {run_dir} is the run directory {run_dir}"),
        "a checkpoint": (run_dir / "checkpoints" / "step-1" / "hf",
                         f"output directory {run_dir / 'checkpoints' / 'step-1' / 'hf'} is inside the "
                         f"run's checkpoint directory {run_dir / 'checkpoints'}"),
        "the checkpoint root": (run_dir / "checkpoints" / "hf",
                                f"output directory {run_dir / 'checkpoints' / 'hf'} is inside the "
                                f"run's checkpoint directory {run_dir / 'checkpoints'}"),
    }[where]
    assert message in fails(capsys, ["export", str(run_dir), str(out)])
    assert not (run_dir / "checkpoints" / "step-1" / "hf").exists() and not (run_dir / "checkpoints" / "hf").exists()


@pytest.mark.parametrize("given", ["the run directory", "a file", "the final export"])
def test_a_checkpoint_path_that_is_not_a_checkpoint(capsys, sft_run, tmp_path, given):
    """One message naming the path (its wording is the checkpoint store's)."""
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text("{}")
    path = {"the run directory": sft_run.run_dir, "a file": sft_run.run_dir / "config.yaml",
            "the final export": tmp_path / "final"}[given]
    err = fails(capsys, ["export", str(sft_run.run_dir), str(tmp_path / "out"), "--checkpoint", str(path)])
    assert f"checkpoint {path} " in err
    assert not (tmp_path / "out").exists()


def test_weights_that_do_not_fit_the_config(capsys, sft_run, tmp_path):
    """The run's checkpoints with a config that adds LoRA: the saved full weights lack
    the adapters the rebuilt model has."""
    run_dir = tmp_path / "edited"
    shutil.copytree(sft_run.run_dir / "checkpoints", run_dir / "checkpoints")
    data = yaml.safe_load((sft_run.run_dir / "config.yaml").read_text())
    data["model"]["lora"] = {"r": 2}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(data))
    err = fails(capsys, ["export", str(run_dir), str(tmp_path / "out")])
    assert f"{run_dir / 'checkpoints' / 'step-2'}: the saved model weights do not fit the model" in err
    assert "unset `model.lora` as in the run that saved it" in err


def test_an_moe_run_with_a_routing_bias_exports_what_its_final_export_holds(tmp_path, caplog):
    """The aux-free routing bias is part of an MoE policy's state as training installs it:
    the export installs it too, and writes the very file of the run's own final export;
    load_model reads it back, and the export says that transformers does not."""
    cfg = _config(tmp_path / "runs", "model.path=builtin:tiny-moe", "model.moe.aux_free_bias=0.01",
                  "train.steps=1", "checkpoint.final=true")
    run = run_local(cfg)
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="rltune.checkpoint.export"):
        assert main(["export", str(run.run_dir), str(out)]) == 0
    assert f"{out} holds the aux-free routing bias of 2 MoE routers" in caplog.text
    assert (out / "model.safetensors").read_bytes() == (run.run_dir / "final" / "model.safetensors").read_bytes()
    trained = [g.routing_bias for g in find_routers(run.roles.learner.model)]
    assert any(bool(b.abs().sum() > 0) for b in trained)  # one step moved it
    loaded = [g.routing_bias for g in find_routers(load_model(str(out)))]
    assert all(torch.equal(a, b) for a, b in zip(loaded, trained, strict=True))


# --------------------------------------------------------------------------- another run, a running run


def _flat(message: str) -> str:
    """``message`` on one line (the console wraps one longer than its width)."""
    return " ".join(message.split())


def _edit_state(checkpoint: Path, edit) -> None:
    """Edit ``state.json`` and record its new checksum in the marker: the edit verifies."""
    meta = json.loads((checkpoint / "state.json").read_text())
    edit(meta)
    data = json.dumps(meta, indent=1).encode()
    (checkpoint / "state.json").write_bytes(data)
    marker = json.loads((checkpoint / "COMPLETE").read_text())
    marker["files"]["state.json"] = hashlib.sha256(data).hexdigest()
    (checkpoint / "COMPLETE").write_text(json.dumps(marker))


def _other_run(sft_run, where: Path, *, recorded: bool = True) -> Path:
    """A copy of the run as another run with another seed: in its config.yaml and in the
    config its checkpoints recorded (or, ``recorded=False``, with no record: an earlier
    rltune's checkpoint)."""
    shutil.copytree(sft_run.run_dir, where)
    data = yaml.safe_load((where / "config.yaml").read_text())
    data["train"]["seed"] = 5
    (where / "config.yaml").write_text(yaml.safe_dump(data))
    for checkpoint in (where / "checkpoints").iterdir():
        _edit_state(checkpoint, (lambda m: m["config"]["train"].update(seed=5)) if recorded else
                    (lambda m: m.pop("config")))
    return where


@pytest.mark.parametrize("recorded", [True, False], ids=["its record", "its run's config.yaml"])
def test_a_checkpoint_of_another_run_is_refused_naming_both(capsys, sft_run, tmp_path, recorded):
    other = _other_run(sft_run, tmp_path / "other", recorded=recorded)
    checkpoint = other / "checkpoints" / "step-2"
    err = _flat(fails(capsys, ["export", str(sft_run.run_dir), str(tmp_path / "out"), "--checkpoint", str(checkpoint)]))
    whose = (f"the config recorded in checkpoint {checkpoint}" if recorded else
             f"{other / 'config.yaml'}, the config of the run it lies in")
    assert (f"checkpoint {checkpoint} was written by another run than {sft_run.run_dir}: "
            f"{sft_run.run_dir / 'config.yaml'} differs from {whose} in what the run means (train.seed: 5 -> 0)") in err
    assert f"export it with its own run: `rltune export {other} OUT --checkpoint {checkpoint}`" in err
    assert not (tmp_path / "out").exists()
    # the control: exported with its own run, it goes out
    _succeeds(capsys, ["export", str(other), str(tmp_path / "out"), "--checkpoint", str(checkpoint)])


def test_a_copy_of_the_run_s_checkpoint_elsewhere_is_exported(capsys, sft_run, tmp_path):
    """The same run's checkpoint, copied out of it: its record says the same run."""
    copy = Path(shutil.copytree(sft_run.run_dir / "checkpoints" / "step-1", tmp_path / "saved" / "step-1"))
    _succeeds(capsys, ["export", str(sft_run.run_dir), str(tmp_path / "out"), "--checkpoint", str(copy)])
    assert torch.equal(_logits(_exported(tmp_path / "out")), _logits(_checkpoint_model(copy)))


def _prune_when_hashed(monkeypatch, checkpoint: Path) -> None:
    """The training run prunes ``checkpoint`` just after the export hashed its first file
    (as ``store._remove`` does: the marker first, then the directory)."""
    original = store._sha256

    def sha(path, **kwargs):
        out = original(path, **kwargs)
        if path.parent == checkpoint and checkpoint.exists():
            (checkpoint / "COMPLETE").unlink()
            shutil.rmtree(checkpoint)
        return out

    monkeypatch.setattr(store, "_sha256", sha)


def test_the_newest_checkpoint_pruned_while_it_is_read_gives_way_to_the_newest_again(capsys, sft_run, tmp_path,
                                                                                    monkeypatch):
    run_dir = Path(shutil.copytree(sft_run.run_dir, tmp_path / "run"))
    _prune_when_hashed(monkeypatch, run_dir / "checkpoints" / "step-2")
    err = _succeeds(capsys, ["export", str(run_dir), str(tmp_path / "out")])
    assert f"exported {run_dir / 'checkpoints' / 'step-1'} to" in err
    step_1 = sft_run.run_dir / "checkpoints" / "step-1"
    assert torch.equal(_logits(_exported(tmp_path / "out")), _logits(_checkpoint_model(step_1)))


def test_a_named_checkpoint_pruned_while_it_is_read_says_so(capsys, sft_run, tmp_path, monkeypatch):
    run_dir = Path(shutil.copytree(sft_run.run_dir, tmp_path / "run"))
    checkpoint = run_dir / "checkpoints" / "step-2"
    _prune_when_hashed(monkeypatch, checkpoint)
    err = _flat(fails(capsys, ["export", str(run_dir), str(tmp_path / "out"), "--checkpoint", str(checkpoint)]))
    assert (f"checkpoint {checkpoint} was removed or rewritten while it was read, by the run saving checkpoints "
            f"beside it") in err
    assert f"the newest complete checkpoint there now is {run_dir / 'checkpoints' / 'step-1'}" in err
    assert "corrupt" not in err and not (tmp_path / "out").exists()


def test_a_corrupt_newest_checkpoint_names_the_older_one_to_export(capsys, sft_run, tmp_path):
    run_dir = Path(shutil.copytree(sft_run.run_dir, tmp_path / "run"))
    weights = run_dir / "checkpoints" / "step-2" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    err = _flat(fails(capsys, ["export", str(run_dir), str(tmp_path / "out")]))
    step_1 = run_dir / "checkpoints" / "step-1"
    assert "model.safetensors has sha256" in err
    assert f"the next older complete checkpoint is {step_1}: export it with `--checkpoint {step_1}`" in err
