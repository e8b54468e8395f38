"""``train.compile``: the learner's training forward and backward through ``torch.compile``.

**What is compiled.** Each transformer block (the classes a Hugging Face model names in
``_no_split_modules``, :func:`rltune.learner.parallel.transformer_blocks`), one at a time,
as torchtitan does: the blocks share their code, so one compiled graph serves them all
(parameters are graph inputs, not constants), and a block is small enough to compile
without graph breaks. The embeddings, the final norm and the log-prob head stay eager:
they run once per forward, and the head already avoids the full logits.

**Only the training forward.** The compiled function runs when the block trains with
gradients on; a forward in eval mode or without gradient (generation on the learner's
module, old and reference log-probs) takes the block's plain forward. Generation feeds a
growing KV cache one token at a time: under the compiled function every new shape or
cache would be a new graph, up to dynamo's recompile limit.

**Shapes.** ``dynamic=None`` (dynamo's default): the first micro-batch compiles for its
shape; the first different shape compiles one graph with symbolic batch and sequence
sizes, and every later shape reuses it (two graphs per run, measured: see
``docs/performance.md``), without padding to buckets.

**With the rest of the learner.** The block's ``forward`` is replaced on the instance (its
class, module path and parameter names stay, so checkpoints and weight exports are
unchanged), after activation checkpointing and before DDP or FSDP2 wrap the model, so
FSDP2's per-block hooks, which run around the block's ``__call__``, stay outside the
compiled region. A checkpointed block (:mod:`rltune.learner.memory`) keeps its
checkpointed forward, and the checkpoint runs the compiled class forward, in the forward
and again in the backward's recompute: dynamo cannot trace into ``torch.utils.checkpoint``
around a transformers block (it ran such a block eagerly, compiling nothing). LoRA's
adapters sit inside the blocks and are compiled with them.
Tensor, pipeline and expert parallelism are refused at config time
(``rltune/config/train.py``): their DTensor layers and stage schedules are not compiled.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch

from rltune.learner.memory import COMPILED_FORWARD, is_checkpointed


def compile_blocks(model: torch.nn.Module, *, dynamic: bool | None = None,
                   backend: str | Callable[..., Any] = "inductor") -> int:
    """Route the training forward of each of ``model``'s transformer blocks through one
    ``torch.compile``-d function (module docstring); returns how many blocks. Idempotent.
    ``backend``: torch.compile's (``eager`` traces without generating code: for tests).

    Raises ValueError when ``model`` names no transformer block, and a ``ConfigError``
    when inductor would compile C++ for a model on the CPU and this machine has no C++
    compiler (:func:`rltune.rollout.compiled.require_cpp_compiler`, looked up once per
    process)."""
    from rltune.learner.parallel import transformer_blocks
    from rltune.rollout.compiled import require_cpp_compiler

    blocks = transformer_blocks(model)
    if not blocks:
        raise ValueError(
            f"train.compile compiles transformer blocks, but {type(model).__name__} names none "
            "(no Hugging Face `_no_split_modules` in it); set train.compile: false for this model"
        )
    first = next(model.parameters(), None)
    if backend == "inductor" and first is not None:
        require_cpp_compiler("train.compile", first.device)
    for block in blocks:
        if COMPILED_FORWARD in block.__dict__:
            continue
        if is_checkpointed(block):  # its checkpoint runs and recomputes the compiled class forward
            bound = types.MethodType(type(block).forward, block)
            block.__dict__[COMPILED_FORWARD] = torch.compile(bound, dynamic=dynamic, backend=backend)
            continue
        plain = block.forward  # the class's
        block.__dict__[COMPILED_FORWARD] = torch.compile(plain, dynamic=dynamic, backend=backend)
        block.forward = types.MethodType(_forward, block)
        block.__dict__["_rltune_plain"] = plain
    return len(blocks)


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether :func:`compile_blocks` routed ``module``'s training forward through compile."""
    return COMPILED_FORWARD in module.__dict__


def _forward(block: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The compiled forward while the block trains with gradients, else the plain one."""
    run: Callable[..., Any] = block.__dict__["_rltune_plain"]
    if block.training and torch.is_grad_enabled():
        run = block.__dict__[COMPILED_FORWARD]
    return run(*args, **kwargs)


def compiled_graphs() -> int:
    """How many graphs dynamo has compiled in this process so far (all functions): what a
    test or benchmark reads to see that varying shapes do not recompile every step."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
