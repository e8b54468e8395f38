"""The model's part of a checkpoint: which tensors are saved, and loading them back exactly.

A plain model saves its whole ``state_dict()``. A model with LoRA adapters saves only its
trainable entries, the adapter matrices and the ``modules_to_save`` copies, under their
``state_dict()`` names, plus a fingerprint of the frozen rest. Why that is exact: the
frozen weights never change in training (the optimizer holds only parameters with
``requires_grad``), so loading ``model.path`` again and wrapping it the same way gives
them back bitwise; the fingerprint turns a resume onto other base weights (``model.path``
overwritten, another ``model.dtype``) into an error instead of a silent change. Why it is
worth it: the adapters of a 70B model are tens of megabytes, the whole model 140 GB per
checkpoint.

``meta`` (JSON) says which it is: ``{"format": "full"}`` or
``{"format": "lora-adapters", "frozen": SHA256}``. A checkpoint written without it
(``meta`` None) holds a full ``state_dict()``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch

from rltune.checkpoint.store import CheckpointError
from rltune.models.lora import is_lora

FULL = "full"
ADAPTERS = "lora-adapters"
FINGERPRINT_SAMPLES = 64
"""Elements of each frozen tensor that enter its fingerprint, evenly spaced."""


def model_to_state(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, meta)`` to checkpoint ``model``; the tensors alias the live ones."""
    state = model.state_dict()
    if not is_lora(model):
        return state, {"format": FULL}
    trainable = trainable_keys(model)
    tensors = {key: state[key] for key in state if key in trainable}
    return tensors, {"format": ADAPTERS, "frozen": frozen_fingerprint(model)}


def model_from_state(
    model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any] | None,
    *, where: str,
) -> None:
    """Copy what :func:`model_to_state` saved into ``model``, built as the saved one was.

    ``where`` (the checkpoint's path) starts every error message. Raises CheckpointError
    when names, shapes or dtypes differ from ``model``'s, when adapters are saved but
    ``model`` has none (or the reverse), or when the frozen weights are not those the
    adapters were trained on; ``model`` is then left as it was.
    """
    kind = FULL if meta is None else meta.get("format")
    live = model.state_dict()
    if kind == FULL:
        missing = sorted(set(live) - set(tensors) - tied_keys(model))
        expected = set(live)
    elif kind == ADAPTERS:
        if not is_lora(model):
            raise CheckpointError(
                f"{where}: the checkpoint holds LoRA adapters but the model has none; set "
                f"`model.lora` as in the run that saved it"
            )
        expected = trainable_keys(model)
        missing = sorted(expected - set(tensors))
    else:
        raise CheckpointError(f"{where}: unknown model checkpoint format {kind!r} (known: {FULL}, {ADAPTERS})")
    unexpected = sorted(set(tensors) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: the saved model weights do not fit the model (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}){_lora_hint(model, missing, unexpected)}"
        )
    _check_shapes(live, tensors, where)
    if kind == ADAPTERS and meta["frozen"] != frozen_fingerprint(model):
        raise CheckpointError(
            f"{where}: the frozen base weights differ from those the adapters were trained on; "
            f"`model.path` and `model.dtype` must name the same weights as in the run that saved it"
        )
    model.load_state_dict(dict(tensors), strict=False)


def trainable_keys(model: torch.nn.Module) -> set[str]:
    """``state_dict()`` names of the parameters with ``requires_grad``."""
    return {name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}


def tied_keys(model: torch.nn.Module) -> set[str]:
    """``state_dict()`` names that share storage with an earlier name (a tied ``lm_head``)."""
    seen: set[int] = set()
    tied = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        ptr = tensor.data_ptr()
        if ptr in seen and tensor.numel():
            tied.add(name)
        seen.add(ptr)
    return tied


@torch.no_grad()
def frozen_fingerprint(model: torch.nn.Module) -> str:
    """sha256 over name, dtype, shape and :data:`FINGERPRINT_SAMPLES` evenly spaced
    elements (their bytes) of every ``state_dict()`` entry that does not train.

    A sample, not every byte: reading a 140 GB base at each save would cost minutes. It
    catches other weights at ``model.path`` (another model, another fine-tune, another
    dtype), in which nearly every element differs; not a handful of edited elements.
    """
    digest = hashlib.sha256()
    trainable = trainable_keys(model)
    for name, tensor in model.state_dict().items():
        if name in trainable:
            continue
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        flat = tensor.reshape(-1)
        if flat.numel():
            # the positions on the CPU wherever the weights are: a GPU's linspace may round
            # them differently, and a run saved on one device resumes on another
            at = torch.linspace(0, flat.numel() - 1, min(FINGERPRINT_SAMPLES, flat.numel())).round().long()
            # float32 positions: past 2**24 elements the last one may round up to numel
            # (a 151936 x 896 embedding); clamped, every position that fit stays as it was
            at.clamp_(max=flat.numel() - 1)
            sample = flat[at.to(flat.device)].to("cpu").contiguous()
            digest.update(sample.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _check_shapes(live: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor], where: str) -> None:
    """Every saved tensor has its live tensor's shape (else the checkpoint is of another
    model, or of other LoRA adapters) and dtype (else another ``model.dtype``)."""
    for key, saved in tensors.items():
        if saved.shape != live[key].shape:
            fix = ("`model.lora` (its rank) as in the run that saved it" if ".lora_" in key else
                   "`model.path` to the model the run that saved it trained: this one is of another size")
            raise CheckpointError(
                f"{where}: {key} has shape {tuple(saved.shape)} in the checkpoint but {tuple(live[key].shape)} in "
                f"the model built from the config; set {fix}"
            )
        if saved.dtype != live[key].dtype:
            raise CheckpointError(
                f"{where}: {key} is saved as {saved.dtype} but the model has {live[key].dtype}; set "
                f"`model.dtype` as in the run that saved it"
            )


def _lora_hint(model: torch.nn.Module, missing: list[str], unexpected: list[str]) -> str:
    if not is_lora(model) and any(".lora_" in key for key in unexpected):
        return "; the checkpoint holds LoRA adapters: set `model.lora` as in the run that saved it"
    if is_lora(model) and any(".lora_" in key for key in missing):
        return "; the model has LoRA adapters the checkpoint lacks: unset `model.lora` as in the run that saved it"
    return ""
