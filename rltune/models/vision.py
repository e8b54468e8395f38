"""Vision-language models: which they are, their vision parts, and their pixel inputs.

A vision-language model (VLM) here is one of transformers' image-text-to-text classes
(Qwen2-VL, Qwen2.5-VL, LLaVA, Gemma 3, ...): a vision tower, a projector into the language
model's embedding space, and the language model. Their parts are found by the attribute
names transformers gives them, never by the class:

=========================  ===============================================================
``visual``                 Qwen2-VL / Qwen2.5-VL / Qwen3-VL tower (its ``merger`` is the
                           projector)
``vision_tower``           LLaVA, Gemma 3, ...
``vision_model``           Idefics / SmolVLM, Mllama
``multi_modal_projector``  LLaVA, Gemma 3, Mllama (the projector beside the tower)
``connector``              Idefics / SmolVLM
``language_model``         the decoder the image features are fed into
=========================  ===============================================================

They sit on the inner model (``model.model`` of a ``...ForConditionalGeneration``) or on the
model itself.
"""

from __future__ import annotations

import torch
from torch import nn

VisionInputs = dict[str, torch.Tensor]
"""The processor's output for one prompt besides ``input_ids``/``attention_mask``, with
images along dim 0 (Qwen2-VL: ``pixel_values [patches, D]``, ``image_grid_thw [n, 3]``;
LLaVA: ``pixel_values [n, 3, H, W]``). Same as :data:`rltune.data.records.VisionInputs`."""

VISION_TOWERS = ("visual", "vision_tower", "vision_model")
PROJECTORS = ("multi_modal_projector", "connector")
LANGUAGE_MODEL = "language_model"


class VisionLayoutError(ValueError):
    """A vision-language model whose vision parts are not where transformers puts them."""


def is_vision_language(model: nn.Module) -> bool:
    """Whether ``model`` takes images: its config has a vision config and it computes image
    features (any transformers image-text-to-text model; a PEFT wrapper counts as its model)."""
    config = getattr(model, "config", None)
    return getattr(config, "vision_config", None) is not None and hasattr(model, "get_image_features")


def batch_vision_inputs(per_row: list[VisionInputs | None]) -> VisionInputs | None:
    """One model call's pixel inputs: each key's tensors of the rows that have images,
    concatenated along dim 0 in row order (rows with ``None`` are text-only and skipped);
    ``None`` when no row has images. Every row with images must hold the same keys."""
    present = [row for row in per_row if row is not None]
    if not present:
        return None
    keys = set(present[0])
    for row in present[1:]:
        if set(row) != keys:
            raise ValueError(
                f"rows' vision inputs have different keys ({sorted(keys)} and {sorted(row)}); "
                f"every prompt of a batch must come from the same processor"
            )
    return {key: torch.cat([row[key] for row in present], dim=0) for key in present[0]}


def vision_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The vision tower and projector of a vision-language ``model``, by attribute name.

    Raises :class:`VisionLayoutError` when ``model`` has no vision tower under a known name:
    a new layout is reported rather than left training (or frozen) by accident.
    """
    owner = _inner(model)
    found = {
        name: getattr(owner, name)
        for name in (*VISION_TOWERS, *PROJECTORS)
        if isinstance(getattr(owner, name, None), nn.Module)
    }
    if not any(name in found for name in VISION_TOWERS):
        children = [name for name, _ in owner.named_children()]
        raise VisionLayoutError(
            f"{type(model).__name__} has no vision tower under a known name ({', '.join(VISION_TOWERS)}; "
            f"its parts are {children}), so rltune cannot tell its vision parameters from its "
            f"language model's; set `model.freeze_vision: false` to train every parameter"
        )
    return found


def freeze_vision(model: nn.Module) -> int:
    """Stop gradients to the vision tower and projector of ``model``; the number of
    parameters frozen. Only the language model (and its head) then trains."""
    frozen = 0
    for module in vision_modules(model).values():
        for param in module.parameters():
            if param.requires_grad:
                param.requires_grad_(False)
                frozen += param.numel()
    return frozen


def language_model_prefix(model: nn.Module) -> str:
    """The qualified name of ``model``'s language model, e.g. ``model.language_model``:
    the module whose linear layers LoRA targets on a vision-language model."""
    owner = _inner(model)
    target = getattr(owner, LANGUAGE_MODEL, None)
    if not isinstance(target, nn.Module):
        raise VisionLayoutError(
            f"{type(model).__name__} has no `{LANGUAGE_MODEL}` module, so rltune cannot tell "
            f"its language model's layers from its vision parts; list `model.lora.target_modules` "
            f"explicitly"
        )
    for name, module in model.named_modules():
        if module is target:
            return name
    raise AssertionError("the language model is a submodule of the model")


def image_token_ids(model: nn.Module) -> list[int]:
    """The ids the processor puts in place of images and videos (``image_token_id``,
    LLaVA's ``image_token_index``, ``video_token_id``), which the model replaces with image
    features. A generator must never sample them (the model would look for an image)."""
    config = model.config
    names = ("image_token_id", "image_token_index", "video_token_id")
    return sorted({int(v) for v in (getattr(config, n, None) for n in names) if v is not None})


def _unwrapped(model: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper (``base_model.model``), or ``model``."""
    base = getattr(model, "base_model", None)
    inner = getattr(base, "model", None)
    return inner if isinstance(inner, nn.Module) and base is not model else model


def _inner(model: nn.Module) -> nn.Module:
    """The module holding the vision tower and language model: ``model.model`` for a
    ``...ForConditionalGeneration`` (transformers 5), else the model itself."""
    model = _unwrapped(model)
    inner = getattr(model, "model", None)
    return inner if isinstance(inner, nn.Module) and hasattr(inner, LANGUAGE_MODEL) else model
