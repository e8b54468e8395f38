"""Activation checkpointing and offload (``rltune/learner/memory.py``).

Tolerances. A checkpointed block's backward reruns the block's forward on the same
inputs, with the same kernels, in the same order, on one thread; the gradients that
follow are then the same floating-point computation as without checkpointing, and on
CPU in fp32 they come out bitwise equal (measured: max difference 0.0). The tests
assert GRAD_ATOL = 1e-6 (the issue's bound) and report exactness separately where it
holds, so a mistake that changes the recompute (other inputs, other routes, a lost
dropout mask) fails: such mistakes move gradients by 1e-3 and more on this model.
The host-offloaded AdamW runs the same fused CPU kernel on the same values as the plain
one, so its weights and moments are compared bitwise.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from rltune.algos import ALGORITHMS
from rltune.checkpoint.state import optimizer_from_state, optimizer_to_state
from rltune.config.schema import AlgoConfig, Config, LoraConfig, TrainConfig
from rltune.learner.distributed import to_device
from rltune.learner.learner import LocalLearner
from rltune.learner.memory import (
    HostOffloadAdamW,
    MemorySettingError,
    apply_activation_checkpointing,
    checkpointed_indices,
    is_checkpointed,
)
from rltune.learner.objectives import build_objective
from rltune.learner.parallel import transformer_blocks
from rltune.metrics.types import scalars
from rltune.models.lora import apply_lora
from rltune.models.routing import install_routing
from test_learner_step import grpo_batch

GRAD_ATOL = 1e-6


def _learner(model: torch.nn.Module, **train) -> LocalLearner:
    cfg = TrainConfig(**{"lr": 1e-3, "grad_clip": None, "micro_batch_tokens": 60, **train})
    objective = build_objective(ALGORITHMS["grpo"], AlgoConfig(name="grpo", aggregation="token-mean"))
    return LocalLearner(model, objective, cfg)


@pytest.fixture
def count_block_forwards():
    """Count calls of the decoder-layer class forward (a recompute is one more)."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    original = Qwen2DecoderLayer.forward
    calls: list[int] = [0]

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    Qwen2DecoderLayer.forward = counted
    yield calls
    Qwen2DecoderLayer.forward = original


def step_and_capture(learner: LocalLearner, batch) -> tuple[dict, dict[str, torch.Tensor]]:
    """One step; the metrics and the trainable parameters' gradients the optimizer saw."""
    grads: dict[str, torch.Tensor] = {}

    def snapshot(*_args) -> None:
        grads.update({n: p.grad.clone() for n, p in learner.model.named_parameters() if p.requires_grad})

    handle = learner.optimizer.register_step_pre_hook(snapshot)
    metrics = scalars(learner.step(batch))
    handle.remove()
    return metrics, grads


def test_which_blocks_each_mode_checkpoints() -> None:
    assert checkpointed_indices(4, "none") == []
    assert checkpointed_indices(4, "full") == [0, 1, 2, 3]
    assert checkpointed_indices(4, "selective") == [1, 3]  # every 2nd by default
    assert checkpointed_indices(6, "selective", 3) == [2, 5]
    assert checkpointed_indices(4, "selective", 1) == [0, 1, 2, 3]


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("lora", [False, True], ids=["dense", "lora"])
def test_checkpointed_step_has_the_plain_gradients(tiny_model, mode: str, lora: bool, count_block_forwards) -> None:
    """One GRPO step over several micro-batches: the checkpointed learner's gradients
    equal the plain learner's (bitwise here; asserted at 1e-6), and the checkpointed
    blocks really ran twice (forward, then recompute in the backward). With LoRA the
    embeddings are frozen, so no input of a block requires grad: the non-reentrant
    checkpoint needs none, and the dropout mask of the adapters is replayed."""
    batch = grpo_batch(tiny_model)
    results = []
    for ac in ("none", mode):
        torch.manual_seed(0)  # the same adapter init and dropout draws in both
        model = copy.deepcopy(tiny_model)
        if lora:
            model = apply_lora(model, LoraConfig(r=4, dropout=0.1))
        learner = _learner(model, activation_checkpointing=ac)
        count_block_forwards[0] = 0
        torch.manual_seed(1)
        metrics, grads = step_and_capture(learner, batch)
        results.append((metrics, grads, count_block_forwards[0]))
    (plain_m, plain_g, plain_calls), (ck_m, ck_g, ck_calls) = results
    assert plain_g.keys() == ck_g.keys() and plain_g
    worst = max(float((plain_g[k] - ck_g[k]).abs().max()) for k in plain_g)
    assert worst <= GRAD_ATOL, f"{mode}: gradients differ by {worst}"
    assert worst == 0.0  # the same arithmetic: bitwise on CPU (see the module docstring)
    assert plain_m["loss"] == pytest.approx(ck_m["loss"], rel=1e-6)
    blocks = len(transformer_blocks(tiny_model))
    micro = plain_calls // blocks
    recomputed = len(checkpointed_indices(blocks, mode))
    assert ck_calls == plain_calls + micro * recomputed


def test_eval_and_no_grad_forwards_do_not_recompute(tiny_model, count_block_forwards) -> None:
    """The generator and the no-grad log-probs share the module: without gradient or in
    eval mode a checkpointed block runs its plain forward once, with the same output."""
    model = copy.deepcopy(tiny_model)
    ids = torch.randint(4, 260, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    assert apply_activation_checkpointing(model, "full") == 4
    assert all(is_checkpointed(b) for b in transformer_blocks(model))
    count_block_forwards[0] = 0
    model.train()
    with torch.no_grad():
        got = model(ids).logits
    model.eval()
    out = model(ids).logits  # grad enabled, eval mode
    out.sum().backward()
    assert count_block_forwards[0] == 8  # 4 blocks x 2 forwards, no recompute in either
    assert torch.equal(got, want) and torch.equal(out.detach(), want)
    generated = model.generate(ids, max_new_tokens=4, do_sample=False)
    plain = copy.deepcopy(tiny_model).generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(generated, plain)


def test_checkpointing_cuts_the_tensors_saved_for_backward(tiny_model) -> None:
    """The bytes autograd keeps for the backward of a 512-token forward (distinct
    storages, counted by a saved-tensor hook outside the checkpointed regions) fall with
    each mode: full < selective < none."""
    ids = torch.randint(4, 260, (2, 512), generator=torch.Generator().manual_seed(0))
    saved = {}
    for mode in ("none", "selective", "full"):
        model = copy.deepcopy(tiny_model).train()
        apply_activation_checkpointing(model, mode)
        saved[mode] = saved_bytes(lambda: model(ids, use_cache=False).logits.logsumexp(-1).sum())
    assert saved["full"] < saved["selective"] < saved["none"]


def saved_bytes(forward) -> int:
    """Bytes of the distinct storages autograd saves during ``forward()`` (kept until
    the backward), seen through ``saved_tensors_hooks``."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    out.backward()
    return sum(storages.values())


def _moe_batch(model: torch.nn.Module):
    """A GRPO batch with recorded routes: each token's top-2 of 4 experts drawn at random."""
    batch = grpo_batch(model)
    g = torch.Generator().manual_seed(3)
    routes = torch.rand(*batch.input_ids.shape, 2, 4, generator=g).argsort(-1)[..., :2].to(torch.int16)
    return dataclasses.replace(batch, routes=routes)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_moe_routing_replay_recomputes_the_replayed_routes_and_counts_once(tiny_moe_model, mode: str) -> None:
    """Routing replay under checkpointing: the recompute routes through the replayed
    experts (gradients equal the plain step's) and counts nothing a second time (the
    router agreement and the expert load are the plain step's)."""
    batch = _moe_batch(tiny_moe_model)
    runs = []
    for ac in ("none", mode):
        model = copy.deepcopy(tiny_moe_model)
        install_routing(model, replay=True)
        learner = _learner(model, activation_checkpointing=ac, **({"checkpoint_every": 1} if ac == "selective" else {}))
        runs.append(step_and_capture(learner, batch))
    (plain_m, plain_g), (ck_m, ck_g) = runs
    worst = max(float((plain_g[k] - ck_g[k]).abs().max()) for k in plain_g)
    assert worst <= GRAD_ATOL, worst
    assert "moe/router_agreement" in plain_m and any(k.startswith("moe/load") for k in plain_m)
    for key in plain_m:
        if key.startswith("moe/"):
            assert ck_m[key] == pytest.approx(plain_m[key], rel=1e-6), key


# ----------------------------------------------------------------------------- offload


def test_host_offload_adamw_steps_and_resumes_as_adamw(tiny_model) -> None:
    """On CPU parameters (``require_device=False``) the offloading optimizer takes the
    plain fused AdamW's steps bitwise, its state_dict is a plain AdamW's, and a resume
    from it continues bitwise."""
    plain_model, host_model = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    kwargs = {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1}
    plain = torch.optim.AdamW(list(plain_model.parameters()), fused=True, **kwargs)
    host = HostOffloadAdamW(host_model.parameters(), require_device=False, **kwargs)
    g = torch.Generator().manual_seed(0)
    grads = [[torch.randn(p.shape, generator=g) for p in plain_model.parameters()] for _ in range(3)]

    def step(model, opt, i):
        for p, grad in zip(model.parameters(), grads[i]):
            p.grad = grad.clone()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(2):
        step(plain_model, plain, i)
        step(host_model, host, i)
    tensors, meta = optimizer_to_state(host)
    plain_tensors, plain_meta = optimizer_to_state(plain)
    assert meta == plain_meta and tensors.keys() == plain_tensors.keys()
    assert all(torch.equal(tensors[k], plain_tensors[k]) for k in tensors)
    resumed_model = copy.deepcopy(host_model)
    resumed = HostOffloadAdamW(resumed_model.parameters(), require_device=False, **kwargs)
    optimizer_from_state(resumed, {k: v.clone() for k, v in tensors.items()}, meta)
    for model, opt in ((plain_model, plain), (host_model, host), (resumed_model, resumed)):
        step(model, opt, 2)
    for a, b, c in zip(plain_model.parameters(), host_model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert all(v.device.type == "cpu" for s in host.state.values() for v in s.values())


def test_offload_refusals(tiny_model) -> None:
    """Each setting that could not take effect is refused with the key and the fix: in
    the config where the run's layout and devices say so, else when the learner is built
    (a :class:`MemorySettingError`, which the CLI prints as one line)."""
    with pytest.raises(MemorySettingError, match="parameters are on the CPU already"):
        _learner(copy.deepcopy(tiny_model), offload="optimizer")
    with pytest.raises(MemorySettingError, match="needs train.parallel dp_shard > 1"):
        _learner(copy.deepcopy(tiny_model), offload="params")
    with pytest.raises(ValueError, match="runtime.device: cpu trains on the CPU"):
        Config(train={"offload": "optimizer"}, runtime={"device": "cpu"})
    Config(train={"offload": "optimizer"})  # runtime.device: auto: the local runtime decides on the machine
    with pytest.raises(ValueError, match="leave runtime.device at auto"):
        Config(runtime={"mode": "ray", "device": "cuda"})
    gpu_learners = {"learners": 2, "learner": {"gpus": 1}}
    with pytest.raises(ValueError, match=r"reserve no GPU \(runtime.placement.learner.gpus: 0\)"):
        Config(train={"offload": "optimizer"}, runtime={"mode": "ray", "placement": {"learners": 2}})
    with pytest.raises(ValueError, match="the parameters are sharded: use train.offload: params"):
        Config(train={"offload": "optimizer"},
               runtime={"mode": "ray", "placement": {**gpu_learners, "learner_strategy": "fsdp2"}})
    with pytest.raises(ValueError, match="the parameters are sharded: use train.offload: params"):
        Config(train={"offload": "optimizer", "parallel": {"dp_shard": 2}},
               runtime={"mode": "ray", "placement": gpu_learners})
    Config(train={"offload": "optimizer"}, runtime={"mode": "ray", "placement": gpu_learners})  # DDP on GPUs
    with pytest.raises(ValueError, match="checkpoint_every is for activation_checkpointing: selective"):
        TrainConfig(activation_checkpointing="full", checkpoint_every=2)
    with pytest.raises(ValueError, match="loss scaler"):
        TrainConfig(offload="optimizer", precision="fp16")
    with pytest.raises(ValueError, match="runtime.mode: ray"):
        Config(train={"offload": "params"})
    with pytest.raises(ValueError, match="data-parallel layout"):
        Config(train={"offload": "params", "parallel": {"tp": 2}},
               runtime={"mode": "ray", "placement": {"learners": 2}})
    fsdp2 = {"learners": 2, "learner_strategy": "fsdp2"}
    with pytest.raises(ValueError, match=r"the learners reserve no GPU \(runtime.placement.learner.gpus: 0\)"):
        Config(train={"offload": "params"}, runtime={"mode": "ray", "placement": fsdp2})
    Config(train={"offload": "params"}, runtime={"mode": "ray", "placement": {**fsdp2, "learner": {"gpus": 1}}})


def test_a_model_without_transformer_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="checkpoints transformer blocks, but Linear names none"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2), "full")


def test_selective_checkpointing_that_selects_no_block_is_refused(tiny_model) -> None:
    model = copy.deepcopy(tiny_model)
    blocks = model.config.num_hidden_layers
    with pytest.raises(ValueError, match=rf"checkpoint_every={blocks + 1} checkpoints none of .* {blocks} blocks; "
                                         rf"set checkpoint_every to at most {blocks}"):
        apply_activation_checkpointing(model, "selective", blocks + 1)
    assert apply_activation_checkpointing(model, "selective", blocks) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_offloaded_optimizer_on_a_gpu_equals_plain_adamw_and_resumes(tiny_model) -> None:
    """On a GPU: three learner steps with ``offload: optimizer`` take the plain learner's
    updates (the same AdamW arithmetic, on the host instead of the device: fused CPU and
    CUDA kernels round alike to within a few ulp, so 1e-6 on weights moving ~1e-3), the
    moments stay in host memory, and a resume from its optimizer state continues as the
    run that did not stop."""
    batch = to_device(grpo_batch(tiny_model), torch.device("cuda"))
    runs = {}
    for offload in ("none", "optimizer"):
        learner = _learner(copy.deepcopy(tiny_model).cuda(), offload=offload)
        for _ in range(2):
            learner.step(batch)
        runs[offload] = learner
    off = runs["optimizer"]
    assert all(v.device.type == "cpu" for s in off.optimizer.state.values() for v in s.values())
    tensors, meta = optimizer_to_state(off.optimizer)
    resumed = _learner(copy.deepcopy(off.model), offload="optimizer")
    optimizer_from_state(resumed.optimizer, {k: v.clone() for k, v in tensors.items()}, meta)
    for learner in (*runs.values(), resumed):
        learner.step(batch)
    for a, b, c in zip(runs["none"].model.parameters(), off.model.parameters(), resumed.model.parameters()):
        assert float((a - b).abs().max()) <= 1e-6
        assert float((b - c).abs().max()) <= 1e-6
    assert scalars(runs["none"].step(batch))["loss"] == pytest.approx(scalars(off.step(batch))["loss"], rel=1e-5)


def test_checkpointed_blocks_compile_with_train_compile(tiny_model) -> None:
    """``train.compile`` with checkpointing (rltune/learner/compiled.py): the checkpoint
    runs the block's compiled forward, and the gradients are the plain ones (aot_eager
    runs the traced ops as eager does: 1e-6, measured 0)."""
    from rltune.learner.compiled import compile_blocks

    ids = torch.randint(4, 260, (2, 24), generator=torch.Generator().manual_seed(0))

    def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        model.train()
        model(ids, use_cache=False).logits.logsumexp(-1).sum().backward()
        return {n: p.grad for n, p in model.named_parameters()}

    want = grads(copy.deepcopy(tiny_model))
    model = copy.deepcopy(tiny_model)
    apply_activation_checkpointing(model, "full")
    compile_blocks(model, backend="aot_eager")
    got = grads(model)
    assert max(float((got[k] - want[k]).abs().max()) for k in want) <= GRAD_ATOL


def test_critic_blocks_are_checkpointed_with_the_plain_gradients(tiny_path: str) -> None:
    """The PPO critic (an LM body and a value head) is a LocalLearner too: its body's
    blocks are found and checkpointed, and its gradients are the plain ones."""
    from rltune.models.value import load_critic

    ids = torch.randint(4, 260, (2, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    grads = []
    for mode in ("none", "full"):
        critic = load_critic(tiny_path).train()
        torch.nn.init.normal_(critic.head.weight, std=0.1, generator=torch.Generator().manual_seed(1))
        assert apply_activation_checkpointing(critic, mode) == (4 if mode == "full" else 0)
        (critic(ids, mask, 8) ** 2).sum().backward()
        grads.append({n: p.grad for n, p in critic.named_parameters()})
    assert max(float((grads[0][k] - grads[1][k]).abs().max()) for k in grads[0]) <= GRAD_ATOL


def test_learner_with_offloaded_optimizer_steps_as_the_plain_learner(tiny_model, monkeypatch) -> None:
    """The learner's path with ``offload: optimizer`` (schedule with warm-up, clip on the
    device gradients, zero_grad), run on CPU parameters by letting the optimizer take
    them: two steps give the plain learner's weights bitwise and the same learning rates."""
    import functools

    import rltune.learner.optim as optim

    monkeypatch.setattr(optim, "HostOffloadAdamW", functools.partial(HostOffloadAdamW, require_device=False))
    batch = grpo_batch(tiny_model)
    learners = [_learner(copy.deepcopy(tiny_model), offload=o, warmup_steps=2, grad_clip=0.5)
                for o in ("none", "optimizer")]
    assert isinstance(learners[1].optimizer, HostOffloadAdamW)
    for _ in range(2):
        plain, offloaded = (scalars(learner.step(batch)) for learner in learners)
        assert plain["lr"] == offloaded["lr"] and plain["grad_norm"] == offloaded["grad_norm"]
    for a, b in zip(learners[0].model.parameters(), learners[1].model.parameters()):
        assert torch.equal(a, b)
    assert all(p.grad is None for p in learners[1].model.parameters())


def test_checkpointing_with_compile_is_refused_for_moe(tiny_moe_model) -> None:
    """The recompute swaps the routers' per-pass state (replay, counts), which a compiled
    block is not shown to follow (when the checkpoint itself was compiled it took no
    routing context and routed the tokens anew: gradients off by ~1.8), so the pair is
    refused."""
    with pytest.raises(ValueError, match="with train.compile on a mixture-of-experts model"):
        _learner(copy.deepcopy(tiny_moe_model), activation_checkpointing="full", compile=True)
