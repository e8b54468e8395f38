"""Sharded (DCP) checkpoints of a learner group (``rltune/checkpoint/sharded.py``): two real
processes (gloo, CPU) on the built-in tiny model.

* Exact resume: a group that saves after its first step and a fresh group that loads
  that checkpoint take the same second step, to the bit (same layout, same arithmetic in
  the same order: nothing may differ); a control that loads the weights but not the
  optimizer state does not.
* Resharding: written at tp=2, the checkpoint loads at dp_shard=2 (FSDP2) and into one
  process with the same weights and optimizer state to the bit (loading copies bytes).
  The second step taken there agrees with the tp=2 group's own second step within
  PARAM_ATOL = 1e-6: the layouts add the same fp32 terms in another order (~1e-7
  relative in the gradient), and with Adam's eps at 1e-3 (learner_group_workers.ADAM_EPS)
  the update's slope in the gradient is at most lr/eps = 1, so parameters move apart by
  about lr * 1e-7 relative, far below 1e-6; a step moves them by ~1e-3.
* No rank holds the full model: each rank writes its own file, and every sharded weight
  is saved as more than one chunk.
* Export: the full weights read back in one process equal the group's weights.
"""

from __future__ import annotations

from pathlib import Path

import contextlib

import pytest
import torch
import torch.distributed as dist
from learner_group_workers import make_batch, make_learner
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from rltune.checkpoint.export import export_run
from rltune.checkpoint.sharded import chunk_counts, load_sharded, read_full, shard_files
from rltune.checkpoint.store import CheckpointError, load_checkpoint, save_checkpoint
from rltune.data.records import TrainBatch
from rltune.learner.distributed import shard_batch
from rltune.learner.launch import spawn_learner_group
from rltune.learner.parallel import NoParallelism, make_parallelism
from rltune.models.load import load_model, resolve_model
from rltune.parallel.layout import Layout
from rltune.parallel.strategy import MeshParallelism
from rltune.runtime.ray import sync
from rltune.runtime.ray.gather import Gathering, gather_one_by_one, send_streamed
from rltune.runtime.ray.fsdp_state import rank_load_checkpoint_state
from rltune.runtime.state import apply_learner_state, learner_state, sharded_learner_state

PARAM_ATOL = 1e-6


LAYOUTS = {"tp": Layout(tp=2), "dp_shard": Layout(dp_shard=2), "pp": Layout(pp=2, pp_schedule="gpipe"),
           "ep": Layout(ep=2)}
"""The learner meshes of two ranks the tests write and read; ``none``: one process.
``fsdp2``: the FSDP2 strategy of ``runtime.placement.learner_strategy``."""


def build(model_dir: str, layout: str):
    """A learner on a fresh model under ``layout`` (a key of LAYOUTS, ``fsdp2`` or ``none``)."""
    if layout == "none":
        parallelism = NoParallelism()
    elif layout == "fsdp2":
        parallelism = make_parallelism("fsdp2")
    else:
        parallelism = MeshParallelism(LAYOUTS[layout])
    return make_learner(load_model(model_dir), parallelism)


def rows_of(batch: TrainBatch, learner) -> TrainBatch:
    """This rank's rows: its data shard (the whole batch for tp and pp peers)."""
    return shard_batch(batch, learner.parallelism.rank, learner.parallelism.world)


def full_optimizer(learner) -> dict[str, torch.Tensor]:
    """The optimizer state by ``fqn.name``, full tensors on every rank."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    state = get_optimizer_state_dict(learner.model, learner.optimizer, options=options)["state"]
    return {f"{fqn}.{k}": (v.full_tensor() if isinstance(v, DTensor) else v).clone()
            for fqn, entries in state.items() for k, v in entries.items()}


def weights(learner) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in learner.export_weights().items()}


def save_then_resume(model_dir: str, batch: TrainBatch, layout: str, directory: str) -> dict:
    """One rank: a learner takes a step, saves, takes its second step; a fresh learner
    loads the checkpoint and takes the second step; a control loads only the weights."""
    torch.set_num_threads(1)
    first = build(model_dir, layout)
    rows = rows_of(batch, first)
    first.step(rows)
    saved = {"weights": weights(first), "optimizer": full_optimizer(first)}
    _, meta = sharded_learner_state(first, "", Path(directory))  # into directory/learner
    first.step(rows)
    out = {"meta": meta, "saved": saved, "uninterrupted": weights(first)}
    resumed = build(model_dir, layout)
    apply_learner_state(resumed, {}, meta, Path(directory), "")
    resumed.step(rows)
    out["resumed"] = weights(resumed)
    out["sync"] = weight_sync(resumed)
    control = build(model_dir, layout)
    load_sharded(control.model, control.optimizer, Path(directory) / "learner", {**meta["optimizer"], "stepped": False})
    control.step(rows)
    out["weights_only"] = weights(control)
    return out


class RecordingChannel:
    """Stands in for the weight channel's sender: reads the mapping as
    ``sync.WeightChannel.send`` does (bucket by bucket, each gathered into one flat
    tensor) and keeps the flats; ``fail_after``: raises after that many buckets."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.flats: list[torch.Tensor] = []
        self.fail_after = fail_after

    def send(self, tensors, version: int) -> int:
        for names in sync.buckets(tensors):
            if self.fail_after is not None and len(self.flats) == self.fail_after:
                raise ConnectionError("a receiver is gone")
            self.flats.append(torch.cat([tensors[n].reshape(-1) for n in names]))
        return sum(f.numel() * f.element_size() for f in self.flats)


def weight_sync(learner) -> dict:
    """The weights as the generators get them from a sharded group: gathered one tensor
    at a time (rank 0 keeps them), broadcast bucket by bucket (small buckets here), a send
    that fails midway, and a gather after it (the group's collectives still match)."""
    sync.BUCKET_BYTES = 64 * 1024
    sender = dist.get_rank() == 0
    out = {"kept": gather_one_by_one(learner, keep=sender) or {}}
    channel = RecordingChannel()
    send_streamed(channel, learner, sender=sender)
    out["flats"] = channel.flats
    out["buckets"] = sync.buckets(Gathering(learner.model))
    with contextlib.suppress(ConnectionError):
        send_streamed(RecordingChannel(fail_after=1), learner, sender=sender)
    out["after_failure"] = gather_one_by_one(learner, keep=sender) or {}
    out["local_numel"] = {k: (v.to_local() if isinstance(v, DTensor) else v).numel()
                          for k, v in Gathering(learner.model).items()}
    return out


def load_one_file(model_dir: str, layout: str, tensors: dict, meta: dict) -> dict:
    """One rank: a one-file checkpoint (one process's) into ``layout``, every rank taking
    its part of the full tensors."""
    torch.set_num_threads(1)
    learner = build(model_dir, layout)
    rank_load_checkpoint_state(learner, "mesh", tensors, meta, Path("one-file"), "")
    return {"weights": weights(learner), "optimizer": full_optimizer(learner), "version": learner.version}


def load_then_step(model_dir: str, batch: TrainBatch, layout: str, directory: str, meta: dict) -> dict:
    """One rank (or one process): load a checkpoint into ``layout``, report what was
    loaded, take a step."""
    torch.set_num_threads(1)
    learner = build(model_dir, layout)
    load_sharded(learner.model, learner.optimizer, Path(directory), meta)
    out = {"weights": weights(learner), "optimizer": full_optimizer(learner)}
    learner.step(rows_of(batch, learner))
    out["stepped"] = weights(learner)
    return out


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def batch(model_dir: str) -> TrainBatch:
    return make_batch(load_model(model_dir))


@pytest.fixture(scope="module")
def tp_run(model_dir: str, batch: TrainBatch, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A run's checkpoint written at tp=2 as a run writes one: the store's unfinished
    directory is handed to the group, whose ranks write their shards into it."""
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "config.yaml").write_text(f"model:\n  path: {model_dir}\n")
    ranks: list[dict] = []

    def shards(directory: Path) -> tuple[dict, dict]:
        ranks.extend(spawn_learner_group(2, save_then_resume, model_dir, batch, "tp", str(directory),
                                         backend="gloo", timeout_s=300))
        return {}, ranks[0]["meta"]

    path = save_checkpoint(run_dir / "checkpoints", 1, tensors={}, meta={"step": 1}, keep=1, shards=shards)
    return {"ranks": ranks, "dir": path / "learner", "meta": ranks[0]["meta"]["optimizer"],
            "checkpoint": path, "run_dir": run_dir}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in any bit."""
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


# ---------------------------------------------------------------- tests


def test_resume_at_tp2_is_the_uninterrupted_run_to_the_bit(tp_run: dict) -> None:
    for rank in tp_run["ranks"]:
        assert same(rank["resumed"], rank["uninterrupted"]) == []
        # the control: without the optimizer state the second step is another one
        assert max_abs_diff(rank["weights_only"], rank["uninterrupted"]) > 1e-4


def test_no_rank_writes_the_whole_model(tp_run: dict) -> None:
    directory = tp_run["dir"]
    assert len(shard_files(directory)) == 2
    chunks = chunk_counts(directory)
    # weights and Adam's moments of the split projections; Adam's step count is a scalar
    sharded = [name for name in chunks if (".self_attn.q_proj." in name or ".mlp.down_proj." in name)
               and not name.endswith(".step")]
    assert sharded and all(chunks[name] == 2 for name in sharded), {n: chunks[n] for n in sharded if chunks[n] != 2}
    # a replicated weight is written once, by one rank
    assert chunks["model.model.norm.weight"] == 1
    # the tied head is written once, as the embedding
    assert "model.lm_head.weight" not in chunks and tp_run["meta"]["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    sizes = [f.stat().st_size for f in shard_files(directory)]
    assert max(sizes) < 0.8 * sum(sizes)


def test_read_full_in_one_process_is_the_groups_weights(tp_run: dict) -> None:
    full = read_full(tp_run["dir"])
    saved = tp_run["ranks"][0]["saved"]["weights"]
    assert set(saved) - set(full) == {"lm_head.weight"}  # tied: the embedding's
    assert same(full, {k: saved[k] for k in full}) == []


# fsdp2 starts a second group (~20-50 s here); one process is the fast representative
@pytest.mark.parametrize("layout", [*(pytest.param(name, marks=pytest.mark.slow) for name in ("dp_shard", "pp", "fsdp2")),
                                    "none"])
def test_tp2_checkpoint_loads_into_another_layout(layout: str, model_dir: str, batch: TrainBatch,
                                                  tp_run: dict) -> None:
    args = (model_dir, batch, layout, str(tp_run["dir"]), tp_run["meta"])
    if layout == "none":
        ranks = [load_then_step(*args)]
    else:
        ranks = spawn_learner_group(2, load_then_step, *args, backend="gloo", timeout_s=300)
    saved, reference = tp_run["ranks"][0]["saved"], tp_run["ranks"][0]["uninterrupted"]
    tied = tp_run["meta"]["tied"]

    def saved_as(key: str) -> str:  # the last pipeline stage's own head: saved as the embedding
        fqn, entry = key.rsplit(".", 1)
        return f"{tied.get(fqn, fqn)}.{entry}"

    held: set[str] = set()
    for rank in ranks:
        assert same(rank["weights"], saved["weights"]) == []
        # a pipeline stage holds its own layers' optimizer state only
        assert same(rank["optimizer"], {k: saved["optimizer"][saved_as(k)] for k in rank["optimizer"]}) == []
        held |= {saved_as(k) for k in rank["optimizer"]}
        assert max_abs_diff(rank["stepped"], reference) < PARAM_ATOL
    assert held == set(saved["optimizer"])


def test_loading_another_models_checkpoint_names_what_differs(tp_run: dict, tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(CheckpointError, match="lacks .* weights entr"):
        load_sharded(model, optimizer, tp_run["dir"], tp_run["meta"])
    with pytest.raises(CheckpointError, match="not a sharded checkpoint"):
        read_full(tmp_path)


def test_run_checkpoint_lists_every_shard_and_resumes_in_one_process(tp_run: dict, model_dir: str) -> None:
    """The store checksums the ranks' files with the rest; the learner part of the
    checkpoint (weights, optimizer, schedule, counters) loads into one process."""
    tensors, meta = load_checkpoint(tp_run["checkpoint"])
    marker = (tp_run["checkpoint"] / "COMPLETE").read_text()
    assert all(f"learner/{f.name}" in marker for f in shard_files(tp_run["dir"]))
    assert meta["model"] == {"format": "dcp", "dir": "learner"} and tensors == {}
    learner = build(model_dir, "none")
    apply_learner_state(learner, tensors, meta, tp_run["checkpoint"], "")
    saved = tp_run["ranks"][0]["saved"]
    assert same(weights(learner), saved["weights"]) == []
    assert same(full_optimizer(learner), saved["optimizer"]) == []
    assert learner.version == 1 and learner.schedule.last_epoch == 1


def test_a_changed_shard_file_is_caught_by_the_store(tp_run: dict, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "step-1"
    shutil.copytree(tp_run["checkpoint"], copy)
    victim = shard_files(copy / "learner")[1]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="learner/shard-.*sha256"):
        load_checkpoint(copy)


def test_export_from_a_sharded_checkpoint_is_the_groups_model(tp_run: dict, tmp_path: Path) -> None:
    export_run(tp_run["run_dir"], tmp_path / "hf")
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    saved = tp_run["ranks"][0]["saved"]["weights"]
    # the tied head is written once by save_pretrained
    assert same({k: exported[k] for k in exported}, {k: saved[k] for k in exported}) == []
    assert set(saved) - set(exported) <= {"lm_head.weight"}


def test_weight_sync_gathers_one_tensor_at_a_time(tp_run: dict) -> None:
    """Rank 0 gets the full weights whether kept or broadcast in buckets; a send that
    fails after its first bucket leaves the group able to gather again; the mapping the
    channel plans its buckets from holds only each rank's shards."""
    rank0 = tp_run["ranks"][0]["sync"]
    full = tp_run["ranks"][0]["resumed"]
    assert same(rank0["kept"], full) == []
    assert same(rank0["after_failure"], full) == []
    assert len(rank0["buckets"]) > 1
    assert [len(f) for f in rank0["flats"]] == [sum(full[n].numel() for n in names) for names in rank0["buckets"]]
    for flat, names in zip(rank0["flats"], rank0["buckets"]):
        assert torch.equal(flat, torch.cat([full[n].reshape(-1) for n in names]))
    local = rank0["local_numel"]
    assert local["model.layers.0.self_attn.q_proj.weight"] * 2 == full["model.layers.0.self_attn.q_proj.weight"].numel()
    assert tp_run["ranks"][1]["sync"]["kept"] == {}


@pytest.mark.slow  # a group of its own (~20-60 s here)
def test_a_one_file_checkpoint_loads_into_a_tp_group(model_dir: str, batch: TrainBatch) -> None:
    local = build(model_dir, "none")
    local.step(batch)
    tensors, meta = learner_state(local, "")
    tensors = {k: {n: t.clone() for n, t in v.items()} for k, v in tensors.items()}
    ranks = spawn_learner_group(2, load_one_file, model_dir, "tp", tensors, meta, backend="gloo", timeout_s=300)
    for rank in ranks:
        assert same(rank["weights"], weights(local)) == []
        assert same(rank["optimizer"], full_optimizer(local)) == []
        assert rank["version"] == 1


RUN_REWARD = '''
def digit_share(prompt, completion, **meta):
    """Share of the completion's characters that are digits."""
    return sum(ch.isdigit() for ch in completion) / len(completion) if completion else 0.0
'''


RAY_RUNS = {
    "tp2": ("runtime.mode=ray", "runtime.placement.learners=2", "train.parallel.tp=2"),
    # the FSDP2 strategy writes the gathered one-file format; fp16 adds the loss scaler's state
    "fsdp2-fp16": ("runtime.mode=ray", "runtime.placement.learners=2", "runtime.placement.learner_strategy=fsdp2",
                   "train.precision=fp16"),
}


@pytest.mark.slow  # two `rltune train` runs on a local Ray, three actors each (minutes here)
@pytest.mark.parametrize("run", sorted(RAY_RUNS))
def test_a_ray_run_resumed_from_its_checkpoint_is_the_run_that_did_not_stop(tmp_path: Path, run: str) -> None:
    """``rltune train`` on Ray writes checkpoints (at tp=2 sharded, with the FSDP2
    strategy one gathered file); a second run resumed from the first one's step-2
    checkpoint takes step 3 as the first run did (loss, gradient norm, reward and, in
    fp16, the loss scale to the bit), and ``rltune export`` of each run's last checkpoint
    gives the same weights."""
    pytest.importorskip("ray", reason="the ray extra is not installed")
    import json

    import yaml

    from rltune.cli import main

    (tmp_path / "rewards.py").write_text(RUN_REWARD)
    config = {
        "name": "a", "model": {"path": "builtin:tiny"}, "algo": {"name": "grpo", "group_size": 4},
        "data": {"train": "builtin:arith_small/train"}, "reward": [{"fn": "rewards.py:digit_share"}],
        "rollout": {"max_new_tokens": 8},
        "train": {"steps": 3, "prompts_per_step": 4, "lr": 1e-3, "threads": 1},
        "log": {"dir": str(tmp_path / "runs"), "console": False},
        "checkpoint": {"every": 1, "keep": 5, "final": False},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    overrides = RAY_RUNS[run]
    runs = tmp_path / "runs"
    assert main(["train", str(path), "name=a", *overrides]) == 0
    step2 = runs / "a" / "checkpoints" / "step-2"
    if run == "tp2":
        assert len(shard_files(step2 / "learner")) == 2
    assert main(["train", str(path), "name=b", *overrides, f"checkpoint.resume={step2}"]) == 0

    def metrics(name: str) -> list[dict]:
        return [json.loads(line) for line in (runs / name / "metrics.jsonl").read_text().splitlines()]

    first, resumed = metrics("a")[-1], metrics("b")[-1]
    assert first["step"] == resumed["step"] == 3
    keys = ("loss", "grad_norm", "reward/mean", *(("train/loss_scale",) if "fp16" in run else ()))
    for key in keys:
        assert first[key] == resumed[key], key
    assert main(["export", str(runs / "a"), str(tmp_path / "a-hf")]) == 0
    assert main(["export", str(runs / "b"), str(tmp_path / "b-hf")]) == 0
    a, b = load_file(tmp_path / "a-hf" / "model.safetensors"), load_file(tmp_path / "b-hf" / "model.safetensors")
    assert same(a, b) == []


@pytest.mark.slow  # a group of its own on the MoE model (~1-2 min here)
def test_ep2_checkpoint_resumes_exactly_and_loads_into_one_process(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Experts split over ep=2 keep their names (``mlp.experts.gate_up_proj``), so each
    rank writes its block of experts and one process reads them whole."""
    moe_dir = resolve_model("builtin:tiny-moe", cache_dir=str(tmp_path_factory.mktemp("moe")))
    moe_batch = make_batch(load_model(moe_dir))
    directory = tmp_path_factory.mktemp("ep")
    ranks = spawn_learner_group(2, save_then_resume, moe_dir, moe_batch, "ep", str(directory),
                                backend="gloo", timeout_s=600)
    for rank in ranks:
        assert same(rank["resumed"], rank["uninterrupted"]) == []
    chunks = chunk_counts(directory / "learner")
    experts = [name for name in chunks if name.endswith("experts.gate_up_proj")]
    assert experts and all(chunks[name] == 2 for name in experts)
    one = load_then_step(moe_dir, moe_batch, "none", str(directory / "learner"), ranks[0]["meta"]["optimizer"])
    assert same(one["weights"], ranks[0]["saved"]["weights"]) == []
    assert same(one["optimizer"], ranks[0]["saved"]["optimizer"]) == []
