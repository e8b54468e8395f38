"""Tiny local vision-language models: ``builtin:tiny-vl`` (Qwen2-VL) and ``builtin:tiny-llava``.

Like :mod:`rltune.models.tiny`, everything is built on the machine from code: the directory
holds the model (``config.json``, ``model.safetensors``, ``generation_config.json``), the
tokenizer and the processor's files (``preprocessor_config.json``,
``processor_config.json``, ``chat_template.jinja``), and loads through transformers' own
``AutoModelForImageTextToText`` and ``AutoProcessor`` (or :func:`rltune.models.load_processor`
where torchvision is not installed, see there).

The tokenizer is the byte-level one of :mod:`rltune.models.tiny` (ids 0-259 unchanged) with
the image tokens appended:

==============  ==========================================================================
``tiny-vl``     260 ``<|vision_start|>``, 261 ``<|vision_end|>``, 262 ``<|image_pad|>``,
                263 ``<|video_pad|>`` (never produced here; Qwen2-VL's config needs an id)
``tiny-llava``  260 ``<image>``
==============  ==========================================================================

The chat template is the tiny one (ChatML) for text content, byte for byte; a message whose
content is a list of parts renders an image part (``{"type": "image"}``, or a part with an
``image``/``image_url`` key) the way the family's own template does, then the text parts.
The processor expands each image's placeholder to the image's number of tokens.

Image sizes. ``tiny-vl``: 14-pixel patches merged 2×2, so one image token covers 28×28
pixels; a 112×112 image is 16 tokens (``min_pixels`` = 112·112) and a large one is scaled
to at most 64 tokens (``max_pixels`` = 64·28·28). ``tiny-llava``: a CLIP tower on 56×56
crops (shortest edge resized to 56, centre crop), 4×4 patches of 14 pixels: 16 tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForImageTextToText,
    GenerationConfig,
    LlavaConfig,
    LlavaProcessor,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2VLConfig,
)
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from rltune.models.tiny import IM_END, PAD, build_tokenizer

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
)
LLAVA_IMAGE = "<image>"
TINY_VL_FORMAT_VERSION = 1
"""Bump when a model or processor built here changes, so cached builtin models are rebuilt."""
# Qwen2-VL's patches: 14 pixels, 2x2 merged into one token of 28x28 pixels.
PATCH, MERGE = 14, 2
TOKEN_PIXELS = (PATCH * MERGE) ** 2
LLAVA_CROP = 56


def _chat_template(image_text: str) -> str:
    """ChatML (the tiny template) where list content renders ``image_text`` per image part."""
    return (
        "{%- for message in messages %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['content'] is string %}{{- message['content'] }}"
        "{%- else %}{%- for part in message['content'] %}"
        "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
        "{{- '" + image_text + "' }}"
        "{%- elif 'text' in part %}{{- part['text'] }}{%- endif %}"
        "{%- endfor %}{%- endif %}"
        "{{- '<|im_end|>' + '\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


QWEN2_VL_TEMPLATE = _chat_template(VISION_START + IMAGE_PAD + VISION_END)
LLAVA_TEMPLATE = _chat_template(LLAVA_IMAGE)

TINY_VL_SPECS: dict[str, dict[str, Any]] = {
    # ~1.1 M parameters: the builtin:tiny language model and a 2-block, 64-wide vision tower.
    "tiny-vl": dict(arch="qwen2_vl", hidden_size=128, layers=4, heads=4, kv_heads=2,
                    vision_width=64, vision_depth=2, vision_heads=4),
    # ~1.1 M parameters: the same language model behind a 2-layer, 64-wide CLIP tower.
    "tiny-llava": dict(arch="llava", hidden_size=128, layers=4, heads=4, kv_heads=2,
                       vision_width=64, vision_depth=2, vision_heads=4),
}
"""Build arguments of the vision-language ``builtin:NAME`` models (:func:`build_tiny_vl`)."""


def _text_config(tokenizer: PreTrainedTokenizerFast, *, hidden_size: int, layers: int,
                 heads: int, kv_heads: int, **extra: Any) -> dict[str, Any]:
    return dict(
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD),
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        bos_token_id=None,
        tie_word_embeddings=True,
        **extra,
    )


def _qwen2_vl(tokenizer: PreTrainedTokenizerFast, *, vision_width: int, vision_depth: int,
              vision_heads: int, **text: Any) -> tuple[PretrainedConfig, Any]:
    head_dim = text["hidden_size"] // text["heads"]
    # M-RoPE splits each head's rotary half (head_dim / 2 frequencies) between the temporal,
    # height and width positions in Qwen2-VL's proportions 16:24:24 (of 64).
    third = head_dim // 2 * 3 // 8
    rope = {"rope_type": "default", "rope_theta": 10000.0,
            "mrope_section": [head_dim // 2 - 2 * third, third, third]}
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)}
    config = Qwen2VLConfig(
        text_config=_text_config(tokenizer, rope_parameters=rope, **text),
        vision_config=dict(depth=vision_depth, embed_dim=vision_width, num_heads=vision_heads,
                           hidden_size=text["hidden_size"], mlp_ratio=2, patch_size=PATCH,
                           spatial_merge_size=MERGE, temporal_patch_size=2),
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True,
    )
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=16 * TOKEN_PIXELS, max_pixels=64 * TOKEN_PIXELS,
        patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2,
    )
    return config, image_processor


def _llava(tokenizer: PreTrainedTokenizerFast, *, vision_width: int, vision_depth: int,
           vision_heads: int, **text: Any) -> tuple[PretrainedConfig, Any]:
    tokens = (LLAVA_CROP // PATCH) ** 2
    config = LlavaConfig(
        text_config=dict(model_type="qwen2", **_text_config(tokenizer, **text)),
        vision_config=dict(model_type="clip_vision_model", hidden_size=vision_width,
                           intermediate_size=2 * vision_width, num_hidden_layers=vision_depth,
                           num_attention_heads=vision_heads, image_size=LLAVA_CROP,
                           patch_size=PATCH, projection_dim=vision_width),
        image_token_id=tokenizer.convert_tokens_to_ids(LLAVA_IMAGE),
        image_seq_length=tokens,
        vision_feature_select_strategy="default",  # the CLS token is dropped
        vision_feature_layer=-1,
        tie_word_embeddings=True,
    )
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": LLAVA_CROP}, crop_size={"height": LLAVA_CROP, "width": LLAVA_CROP}
    )
    return config, image_processor


_FAMILIES = {
    "qwen2_vl": (_qwen2_vl, (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD), QWEN2_VL_TEMPLATE,
                 "Qwen2VLProcessor"),
    "llava": (_llava, (LLAVA_IMAGE,), LLAVA_TEMPLATE, "LlavaProcessor"),
}


def build_vl_tokenizer(arch: str) -> PreTrainedTokenizerFast:
    """The tiny byte-level tokenizer with ``arch``'s image tokens appended and its template."""
    _, tokens, template, _ = _FAMILIES[arch]
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(list(tokens), special_tokens=True)
    tokenizer.chat_template = template
    return tokenizer


def tiny_vl_config(arch: str, **spec: Any) -> PretrainedConfig:
    """The model config :func:`build_tiny_vl` writes for these arguments (no weights)."""
    return _FAMILIES[arch][0](build_vl_tokenizer(arch), **spec)[0]


def build_tiny_vl(directory: str | Path, *, arch: str, seed: int = 0, **spec: Any) -> Path:
    """Write a small random vision-language model, its tokenizer and processor to ``directory``.

    ``arch`` is ``qwen2_vl`` or ``llava``; ``spec`` holds the sizes of
    :data:`TINY_VL_SPECS`. Weights are drawn from torch's generator seeded with ``seed``
    inside a forked RNG state, so the same arguments give identical weights. The processor
    is LLaVA's ``save_pretrained``; Qwen2-VL's is written as its parts (tokenizer,
    ``preprocessor_config.json``, ``processor_config.json`` naming the class), the layout
    of a hub Qwen2-VL directory, because that processor needs torchvision to be built.
    Returns ``directory``.
    """
    if arch not in _FAMILIES:
        raise ValueError(f"unknown tiny vision-language architecture {arch!r}; choose one of {sorted(_FAMILIES)}")
    family, _, _, processor_class = _FAMILIES[arch]
    tokenizer = build_vl_tokenizer(arch)
    config, image_processor = family(tokenizer, **spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (PAD, IM_END)}
    model.generation_config = GenerationConfig(
        eos_token_id=ids[IM_END], pad_token_id=ids[PAD], bos_token_id=None
    )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    if arch == "llava":
        LlavaProcessor(
            image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH,
            vision_feature_select_strategy="default", num_additional_image_tokens=1,
            chat_template=tokenizer.chat_template,
        ).save_pretrained(directory)
    else:
        # Qwen2VLProcessor cannot be built without torchvision (its video processor), so
        # its parts are saved as a hub Qwen2-VL directory holds them.
        tokenizer.save_pretrained(directory)
        image_processor.save_pretrained(directory)
        (directory / "processor_config.json").write_text(
            json.dumps({"processor_class": processor_class}, indent=2) + "\n"
        )
    return directory
