"""Activation checkpointing and host offload for the learner (``train.activation_checkpointing``,
``train.checkpoint_every``, ``train.offload``).

**Activation checkpointing.** A checkpointed transformer block keeps only its input for the
backward; the backward runs the block's forward again to rebuild what its own backward
needs (``torch.utils.checkpoint``, non-reentrant). ``full`` checkpoints every block,
``selective`` every k-th (``train.checkpoint_every``, the k-th, 2k-th, ... block, as
torchtitan counts): the activation memory of the blocks falls to about ``1/k`` of them
plus one block's worth during its recompute, at the price of one more forward of those
blocks. The recompute is the same arithmetic on the same inputs, so gradients equal the
plain ones (bitwise on CPU in fp32).

The block keeps its class, its module path and its parameter names: :func:`apply_activation_checkpointing`
replaces ``forward`` on the block instance (as :mod:`rltune.models.routing` does on
routers), so the order against tensor, pipeline, expert and FSDP2 sharding does not
matter, and FSDP2's hooks (which run around ``__call__``) stay outside the recomputed
region, where they gather the block's parameters for the backward anyway. Forwards
without gradient or in eval mode (generation, the old and reference log-probs) run the
plain forward: checkpointing changes nothing but the training forward's memory.

A non-reentrant checkpoint needs no input that requires grad, so LoRA's frozen
embeddings need no ``enable_input_require_grads``; the RNG state is replayed, so a LoRA
dropout mask is the same in the recompute. With ``train.compile`` the checkpoint runs the
block's compiled forward (:data:`COMPILED_FORWARD`), in the forward and the recompute
(dense models; MoE with both is refused).

MoE routers installed by :func:`rltune.models.routing.install_routing` run again in the
recompute: the block's routers then see the forward's recorded routes (replay) but count
nothing (agreement, load), so the recompute routes the tokens as the forward did and the
metrics count each token once.

**Offload.** ``params``: FSDP2's ``CPUOffloadPolicy`` (sharded parameters, gradients and
optimizer state in host memory, gathered to the device per block): set on the learner
group's strategy by :func:`prepare_memory`. ``optimizer``: :class:`HostOffloadAdamW`,
AdamW whose moments live in host memory and whose step runs on the host, for a learner
whose whole model sits on one GPU (one process or DDP).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

CACHE_KWARGS: tuple[str, ...] = ("past_key_values", "cache", "layer_past")
"""Keyword arguments through which a block would write a KV cache."""
COMPILED_FORWARD = "_rltune_compiled"
"""Where ``train.compile`` (:func:`rltune.learner.compiled.compile_blocks`) keeps a block's
compiled forward; a checkpointed block's checkpoint calls it (dynamo does not trace into
``torch.utils.checkpoint`` around a transformers block: it would run the block eagerly)."""


class MemorySettingError(ValueError):
    """A ``train.activation_checkpointing`` or ``train.offload`` setting that cannot take
    effect for this model or learner; the message names the key and the fix."""


# ----------------------------------------------------------------------- checkpointing


def checkpointed_indices(blocks: int, mode: str, every: int | None = None) -> list[int]:
    """The indices (0-based, in module order) of the ``blocks`` transformer blocks that
    ``mode`` checkpoints: none, all (``full``) or every ``every``-th (``selective``; the
    ``every``-th, 2x``every``-th, ...; None: 2)."""
    if mode == "none":
        return []
    if mode == "full":
        return list(range(blocks))
    if mode == "selective":
        k = 2 if every is None else every
        if k < 1:
            raise ValueError(f"train.checkpoint_every must be >= 1, got {k}")
        return [i for i in range(blocks) if (i + 1) % k == 0]
    raise ValueError(f"train.activation_checkpointing={mode!r}; expected none, full or selective")


def apply_activation_checkpointing(model: torch.nn.Module, mode: str, every: int | None = None) -> int:
    """Checkpoint ``model``'s transformer blocks as ``mode`` says (:func:`checkpointed_indices`);
    returns how many. Idempotent: a block already checkpointed is left as it is.

    Raises :class:`MemorySettingError` when ``mode`` is not ``none`` and ``model`` has no
    transformer block (no module class named in a Hugging Face ``_no_split_modules``)."""
    if mode == "none":
        return 0
    from rltune.learner.parallel import transformer_blocks

    blocks = transformer_blocks(model)
    if not blocks:
        raise MemorySettingError(
            f"train.activation_checkpointing={mode!r} checkpoints transformer blocks, but "
            f"{type(model).__name__} names none (no Hugging Face `_no_split_modules` in it); "
            "set train.activation_checkpointing: none for this model"
        )
    chosen = checkpointed_indices(len(blocks), mode, every)
    if not chosen:  # selective, every past the block count: the setting would do nothing
        raise MemorySettingError(
            f"train.activation_checkpointing=selective with train.checkpoint_every={every} checkpoints none of "
            f"{type(model).__name__}'s {len(blocks)} blocks; set checkpoint_every to at most {len(blocks)}"
        )
    for index in chosen:
        block = blocks[index]
        if "_rltune_checkpointed" not in block.__dict__:
            block.__dict__["_rltune_checkpointed"] = True
            block.forward = types.MethodType(_checkpointed_forward, block)
    return len(chosen)


def is_checkpointed(module: torch.nn.Module) -> bool:
    """Whether :func:`apply_activation_checkpointing` checkpoints ``module``."""
    return bool(module.__dict__.get("_rltune_checkpointed"))


def _checkpointed_forward(block: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The block's class forward, under ``torch.utils.checkpoint`` when it trains."""
    plain = type(block).forward
    if not (block.training and torch.is_grad_enabled()):
        return plain(block, *args, **kwargs)
    for name in CACHE_KWARGS:
        if kwargs.get(name) is not None:
            raise RuntimeError(
                f"activation checkpointing: {type(block).__name__} was given a KV cache "
                f"(`{name}`) in a training forward; its recompute in the backward would write "
                "the cache a second time. Training forwards pass use_cache=False"
            )
    options: dict[str, Any] = {}
    # only MoE blocks need a context (train.compile with checkpointing is refused for MoE
    # models, prepare_memory)
    routers = [m for m in block.modules() if "_rltune_layer" in m.__dict__]
    if routers:
        options["context_fn"] = functools.partial(_routing_contexts, routers)
    compiled = block.__dict__.get(COMPILED_FORWARD)
    if compiled is not None:  # the checkpoint runs, and recomputes, train.compile's graph
        return checkpoint(compiled, *args, use_reentrant=False, **options, **kwargs)
    return checkpoint(plain, block, *args, use_reentrant=False, **options, **kwargs)


def _routing_contexts(routers: list[torch.nn.Module]) -> tuple[Any, Any]:
    """``(forward, recompute)`` contexts for a checkpointed block with MoE ``routers``
    (called at the forward): nothing around the forward; around the recompute, the
    routers get a pass that replays what the forward's pass replayed and counts nothing."""
    active = [m.__dict__.get("_rltune_pass") for m in routers]
    if not any(p is not None for p in active):
        return contextlib.nullcontext(), contextlib.nullcontext()
    return contextlib.nullcontext(), _replaying(routers, active)


@contextlib.contextmanager
def _replaying(routers: list[torch.nn.Module], passes: list[Any]) -> Iterator[None]:
    from rltune.models.routing import RoutingPass

    saved = [m.__dict__.get("_rltune_pass") for m in routers]
    for gate, state in zip(routers, passes):
        if state is None:
            gate.__dict__.pop("_rltune_pass", None)
        else:  # the same routes, nothing counted or recorded
            gate.__dict__["_rltune_pass"] = RoutingPass(rows=state.rows, routes=state.routes)
    try:
        yield
    finally:
        for gate, state in zip(routers, saved):
            if state is None:
                gate.__dict__.pop("_rltune_pass", None)
            else:
                gate.__dict__["_rltune_pass"] = state


# ----------------------------------------------------------------------------- offload


class HostOffloadAdamW(torch.optim.AdamW):
    """AdamW whose state (and step) lives in host memory for parameters on a GPU.

    The optimizer's own parameters are host copies of the device parameters: each step
    copies the weights and gradients to the host, runs the fused CPU AdamW there, and
    copies the weights back; the device holds no moment (``exp_avg``, ``exp_avg_sq``:
    twice the trainable parameters in fp32 saved). Copying the weights down every step
    (rather than keeping a host master copy) keeps the device weights the truth, so a
    checkpoint load or any other change to them is picked up. ``state_dict`` is that of
    a plain AdamW over the same parameters in the same order, so checkpoints move between
    offloaded and plain runs.

    ``require_device``: refuse parameters already in host memory, where offloading saves
    nothing (``False`` runs the same copies on CPU parameters, so that the arithmetic and
    the checkpoint format can be checked on a machine without a GPU).
    """

    def __init__(self, params: Iterable[torch.Tensor], *, lr: float, betas: tuple[float, float],
                 weight_decay: float, require_device: bool = True) -> None:
        device_params = [p for p in params if p.requires_grad]
        _check_offloadable(device_params, require_device)
        self._pin = torch.cuda.is_available() and any(p.device.type == "cuda" for p in device_params)
        host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=self._pin).copy_(p.detach())
                for p in device_params]
        super().__init__(host, lr=lr, betas=betas, weight_decay=weight_decay, fused=True)
        self._device_params = device_params
        self._host = host

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Weights and gradients down, AdamW on the host, weights up."""
        if closure is not None:
            raise ValueError("HostOffloadAdamW.step takes no closure")
        for p, h in zip(self._device_params, self._host):
            if p.grad is None:
                h.grad = None
                continue
            h.copy_(p.detach(), non_blocking=True)
            if h.grad is None:
                h.grad = torch.empty(h.shape, dtype=h.dtype, pin_memory=self._pin)
            h.grad.copy_(p.grad, non_blocking=True)
        self._wait()  # the host step reads what the copies write
        super().step()
        for p, h in zip(self._device_params, self._host):
            if p.grad is not None:
                p.copy_(h, non_blocking=True)
        self._wait()  # the next host step must not write h while it is still being read

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for p in self._device_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def _wait(self) -> None:
        if self._pin:
            torch.cuda.synchronize()


def _check_offloadable(params: list[torch.Tensor], require_device: bool) -> None:
    if not params:
        raise MemorySettingError("the model has no trainable parameters")
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in params):
        raise MemorySettingError(
            "train.offload: optimizer keeps a single learner's AdamW state on the host; these parameters "
            "are sharded (FSDP2 or a train.parallel layout): use train.offload: params there"
        )
    if require_device and all(p.device.type == "cpu" for p in params):
        raise MemorySettingError(
            "train.offload: optimizer moves AdamW's state from the accelerator to host memory, but this "
            "learner's parameters are on the CPU already (nothing to offload); set train.offload: none"
        )


def offload_policy_kwargs(offload: str, device: torch.device) -> dict[str, Any]:
    """``fully_shard``'s keyword arguments for ``train.offload`` (``params``: a
    ``CPUOffloadPolicy``, pinned host memory only with CUDA)."""
    if offload != "params":
        return {}
    from torch.distributed.fsdp import CPUOffloadPolicy

    return {"offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda")}


# --------------------------------------------------------------------------- the learner


def prepare_memory(model: torch.nn.Module, cfg: Any, parallelism: Any) -> None:
    """Before the learner's parallelism wraps ``model``: checkpoint its blocks
    (``cfg.activation_checkpointing``) and, for ``cfg.offload: params``, have the
    strategy shard with CPU offload; refuse a combination that cannot take effect."""
    if cfg.activation_checkpointing != "none" and getattr(cfg, "compile", False):
        from rltune.models.routing import find_routers

        if find_routers(model):
            raise MemorySettingError(
                f"train.activation_checkpointing={cfg.activation_checkpointing!r} with train.compile on a "
                f"mixture-of-experts model ({type(model).__name__}): the recompute swaps the routers' per-pass "
                "state (routing replay, counts), which a compiled block is not shown to follow; turn one of the "
                "two off"
            )
    apply_activation_checkpointing(model, cfg.activation_checkpointing, getattr(cfg, "checkpoint_every", None))
    strategy = type(parallelism).__name__
    if cfg.offload == "params":
        if not hasattr(parallelism, "offload"):
            raise MemorySettingError(
                f"train.offload: params is FSDP2's CPU offload of sharded parameters; this learner's "
                f"strategy {strategy} does not shard them: it needs train.parallel dp_shard > 1 or "
                "runtime.placement.learner_strategy: fsdp2 with more than one learner"
            )
        parallelism.offload = "params"  # the strategy checks its layout when it wraps
    elif cfg.offload == "optimizer" and hasattr(parallelism, "offload"):
        raise MemorySettingError(
            f"train.offload: optimizer is for a learner that holds the whole model (one process or DDP); "
            f"under {strategy} the parameters are sharded: use train.offload: params"
        )


__all__ = [
    "HostOffloadAdamW",
    "MemorySettingError",
    "apply_activation_checkpointing",
    "checkpointed_indices",
    "is_checkpointed",
    "offload_policy_kwargs",
    "prepare_memory",
]
