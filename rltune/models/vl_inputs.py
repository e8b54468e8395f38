"""A vision-language model's inputs as the generator and the learner alike give them.

Placeholders. The image (and video) placeholder tokens stand for the vision tower's
features; a completion that held one could not be trained (the forward would look for an
image to put there). The policy of a vision-language model therefore never produces them:
their logits are set to :data:`SUPPRESSED` (:func:`suppress_placeholders`) before sampling
and in every log-prob the learner computes, so both see the same distribution, whose
probability on them is 0 (``exp(-1e4)`` underflows) and whose entropy stays finite.

Positions. Qwen2-VL and Qwen2.5-VL rotate with M-RoPE: each token has a (temporal, height, width)
position, an image's tokens laid out on its grid and the text after an image continuing
from the image's largest position, so a prompt's last position is not its length minus
one. The model's own ``get_rope_index`` computes them (``[3, B, T]``, and per row the
offset ``delta`` between the next position and the count of real tokens). rltune passes
them explicitly, to the prefill, to every decode step (``count + delta`` in all three
components, as transformers' generation does) and to the learner's forward, rather than
letting the model compute them: the model would keep the offsets of its last call on
itself (``rope_deltas``), which a learner's forward between two generations would overwrite.

Other vision-language models (LLaVA) use ordinary 1-D positions: :func:`mrope_owner` is None.
"""

from __future__ import annotations

import torch
from torch import nn

from rltune.data.records import VisionInputs
from rltune.models.vision import image_token_ids, is_vision_language

SUPPRESSED = -1.0e4
"""The logit of a placeholder token (finite, so that ``p * z`` in the entropy is 0, not NaN)."""


def placeholder_ids(model: nn.Module | None) -> list[int]:
    """The image and video placeholder ids a vision-language ``model`` never samples
    (:func:`rltune.models.vision.image_token_ids`); [] for a text model or None."""
    return image_token_ids(model) if model is not None and is_vision_language(model) else []


def suppress_placeholders(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """``logits`` ``[..., V]`` with the columns ``ids`` set to :data:`SUPPRESSED` (itself when
    ``ids`` is empty)."""
    if not ids:
        return logits
    return logits.index_fill(-1, torch.tensor(ids, device=logits.device), SUPPRESSED)


def mrope_owner(model: nn.Module) -> nn.Module | None:
    """The module of ``model`` (found through any wrapper) whose ``get_rope_index`` gives
    M-RoPE positions; None for a model with ordinary positions."""
    for module in model.modules():
        if callable(getattr(module, "get_rope_index", None)):
            return module
    return None


def token_types(owner: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` int: 1 on image tokens, 2 on video tokens, 0 on text, from the model's
    config ids (what the processor returns as ``mm_token_type_ids`` for one prompt;
    computed here because a batch's rows are padded and concatenated by rltune)."""
    config = owner.config
    types = (input_ids == config.image_token_id).int()
    video = getattr(config, "video_token_id", None)
    if video is not None:
        types = types + 2 * (input_ids == video).int()
    return types


def mrope_positions(
    owner: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, vision: VisionInputs | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions [3, B, T], deltas [B, 1])`` from the model's ``get_rope_index`` for
    left-padded ``input_ids`` ``[B, T]`` whose images' grids are ``vision["image_grid_thw"]``
    (rows' images in order; a row without images is plain text). Padding gets position 0.
    The next token of row ``b`` after its ``n`` real tokens sits at ``n + deltas[b]``."""
    grids = {k: vision[k] for k in ("image_grid_thw", "video_grid_thw") if vision and k in vision}
    if not grids:
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return positions.unsqueeze(0).expand(3, -1, -1), torch.zeros_like(positions[:, :1])
    return owner.get_rope_index(
        input_ids, mm_token_type_ids=token_types(owner, input_ids), attention_mask=attention_mask, **grids,
    )


def model_vision_inputs(vision: VisionInputs, device: torch.device) -> VisionInputs:
    """The pixel inputs as the model's forward takes them, on ``device``."""
    return {name: value.to(device) for name, value in vision.items()}
