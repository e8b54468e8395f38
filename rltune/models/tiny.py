"""The tiny local model factory: a real tokenizer and a small random causal LM.

Everything is built on the machine, from code, with no download: tests and laptop runs
get a genuine Hugging Face model directory (``config.json``, ``generation_config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json`` and the chat template)
that every other part of the toolchain loads exactly as it would load a hub checkpoint.

The tokenizer is Qwen2's byte-level BPE pipeline (NFC, Qwen2's split regex, byte-level
mapping) with an *empty merge list*: every UTF-8 byte is one token, so ASCII text is one
token per character, nothing is ever unknown, and the ByteLevel decoder gives back the text
exactly. It is deliberately identical to what transformers' ``Qwen2Tokenizer`` rebuilds
from ``tokenizer.json`` (transformers 5 does that for every ``model_type: qwen2``
directory, whatever ``tokenizer_config.json`` says), so every loading route tokenises the
same. Ids: the special tokens 0-3, then byte ``b`` at id ``4 + b``.

=================  ======================================================================
``<|pad|>``        padding (never attended to)
``<|endoftext|>``  document separator for raw text; *not* the generation stop token
``<|im_start|>``   opens a chat turn (ChatML)
``<|im_end|>``     closes a chat turn; it is the EOS: generation stops when the model
                   ends its turn, so ``tokenizer.eos_token``, ``config.eos_token_id`` and
                   ``generation_config.eos_token_id`` all name it
=================  ======================================================================
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
)

TINY_FORMAT_VERSION = 1
"""Bump when the tokenizer or the model construction here changes, so cached builtin
models (keyed by a hash that includes this number) are rebuilt."""

PAD, EOT, IM_START, IM_END = "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, EOT, IM_START, IM_END)
# Qwen2's pre-tokenizer split (transformers.models.qwen2.tokenization_qwen2).
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML: ``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`` per message, then
``<|im_start|>assistant\\n`` when a generation prompt is asked for."""

TINY_SPECS: dict[str, dict[str, Any]] = {
    # ~1.0 M parameters (tied embeddings): fast enough for CPU end-to-end RL tests.
    "tiny": dict(arch="qwen2", hidden_size=128, layers=4, heads=4, kv_heads=2),
    # ~1.1 M parameters: 4 experts, top-2 routing, plus Qwen2-MoE's shared expert.
    "tiny-moe": dict(
        arch="qwen2_moe",
        hidden_size=128,
        layers=2,
        heads=4,
        kv_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
    ),
}
"""Build arguments of the ``builtin:NAME`` models (passed to :func:`build_tiny`)."""


def byte_symbols() -> list[str]:
    """The byte-level BPE symbol of each byte 0..255 (GPT-2's ``bytes_to_unicode``).

    Printable bytes stand for themselves; the others (space, newline, control and
    non-ASCII bytes) are shifted to code points from 256 up, e.g. space is ``Ġ``.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level, merge-free tokenizer described in the module docstring (260 ids)."""
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *byte_symbols()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False,
                                   byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD,
        additional_special_tokens=[EOT, IM_START],
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        model_max_length=512,
    )


def _qwen2_config(*, hidden_size: int, layers: int, heads: int, kv_heads: int,
                  **overrides: Any) -> PretrainedConfig:
    args: dict[str, Any] = dict(
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    return Qwen2Config(**{**args, **overrides})


def _qwen2_moe_config(*, hidden_size: int, layers: int, heads: int, kv_heads: int,
                      **overrides: Any) -> PretrainedConfig:
    args: dict[str, Any] = dict(
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        moe_intermediate_size=2 * hidden_size,
        shared_expert_intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    return Qwen2MoeConfig(**{**args, **overrides})


ARCH_CONFIGS: dict[str, Callable[..., PretrainedConfig]] = {
    "qwen2": _qwen2_config,
    "qwen2_moe": _qwen2_moe_config,
}


def build_tiny(
    directory: str | Path,
    *,
    arch: str = "qwen2",
    hidden_size: int = 128,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Write a small randomly initialised causal LM and its tokenizer to ``directory``.

    ``arch`` is a key of :data:`ARCH_CONFIGS`; ``overrides`` are passed to the HF config
    (e.g. ``num_experts=8``). The vocabulary is the tokenizer's (260 tokens); embeddings
    are tied. Weights are drawn from torch's generator seeded with ``seed`` inside a forked
    RNG state (the caller's RNG is untouched), so the same arguments give bitwise identical
    ``model.safetensors``. Returns ``directory``.
    """
    if arch not in ARCH_CONFIGS:
        raise ValueError(
            f"unknown tiny architecture {arch!r}; choose one of {sorted(ARCH_CONFIGS)}"
        )
    directory = Path(directory)
    tokenizer = build_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (PAD, IM_END)}
    config = ARCH_CONFIGS[arch](
        hidden_size=hidden_size,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        vocab_size=len(tokenizer),
        pad_token_id=ids[PAD],
        eos_token_id=ids[IM_END],
        bos_token_id=None,
        **overrides,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=ids[IM_END], pad_token_id=ids[PAD], bos_token_id=None
    )
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())
