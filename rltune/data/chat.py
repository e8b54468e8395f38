"""Rendering prompts and SFT targets into token ids.

Three ways a prompt becomes text, picked by what the prompt and the tokenizer offer:

========================  ==========================================================
prompt form               rendering
========================  ==========================================================
messages, chat template   ``tokenizer.apply_chat_template(messages,
                          add_generation_prompt=True)``
text, chat template       wrapped as ``[{"role": "user", "content": text}]``, then as
                          above
messages, no template     the plain format below
text, no template         the text as-is
========================  ==========================================================

"No template" means the tokenizer has no ``chat_template`` or the caller passed
``use_chat_template=False`` (``data.chat_template: false``).

The plain format joins the messages one per line and ends with the assistant's turn, so
the model continues as the assistant::

    system: You are terse.\\n
    user: 2+2=\\n
    assistant: 

that is ``"".join(f"{role}: {content}\\n" for each message) + "assistant: "``.

``system_prompt`` is put first as a ``system`` message, unless the messages already start
with one (the row's own system message wins). For text used as-is, it is prepended as
``system_prompt + "\\n" + text``.

Text rendered without a template is tokenised with the tokenizer's special tokens (a BOS
for tokenizers that use one); a chat template writes its own special tokens.

A vision-language model renders through its processor instead (:func:`encode_vl_prompt`):
``processor.apply_chat_template`` with the images in the messages' image parts, which
writes the image tokens (expanded to the number each image takes) and computes the pixel
inputs in the same call. Every content string is given as one text part, the form the
processors' templates expect (LLaVA's reads only parts); Qwen2-VL's renders both alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rltune.data.records import Prompt, VisionInputs

PLAIN_ASSISTANT_CUE = "assistant: "


def unencodable(value: str | Sequence[Mapping[str, Any]], what: str) -> str | None:
    """Why no tokenizer can encode ``value`` (a text, or a content's text and image parts),
    with ``what`` naming it: ``"WHAT holds a lone surrogate \\ud800 at character N, which no
    tokenizer encodes"`` (N counted from 1; a part's text named ``part K of WHAT``); None
    when it can. A lone surrogate (a code point U+D800 to U+DFFF, as a JSON ``\\ud800``
    escape or text decoded with ``surrogateescape`` gives) has no UTF-8 form."""
    if not isinstance(value, str):
        for k, part in enumerate(value, 1):
            if part.get("type") == "text" and (problem := unencodable(part["text"], f"part {k} of {what}")):
                return problem
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        return (f"{what} holds a lone surrogate \\u{ord(value[err.start]):04x} at character {err.start + 1}, "
                "which no tokenizer encodes")
    return None


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def with_system_prompt(
    messages: Sequence[Mapping[str, str]], system_prompt: str | None
) -> list[dict[str, str]]:
    """``messages`` with ``system_prompt`` first, unless it is None or the messages
    already open with a system message."""
    out = [dict(m) for m in messages]
    if system_prompt is None or (out and out[0].get("role") == "system"):
        return out
    return [{"role": "system", "content": system_prompt}, *out]


def render_plain(messages: Sequence[Mapping[str, str]]) -> str:
    """The plain chat format: ``"role: content\\n"`` per message, then ``"assistant: "``."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + PLAIN_ASSISTANT_CUE


def encode_prompt(
    tokenizer: Any,
    prompt: Prompt,
    *,
    system_prompt: str | None = None,
    use_chat_template: bool = True,
) -> list[int]:
    """Token ids of ``prompt`` ready for generation (see the module docstring for the
    rendering rules)."""
    if use_chat_template and has_chat_template(tokenizer):
        messages = prompt.messages
        if messages is None:
            messages = [{"role": "user", "content": prompt.text}]
        return _chat_template_ids(tokenizer, with_system_prompt(messages, system_prompt))
    if prompt.messages is not None:
        text = render_plain(with_system_prompt(prompt.messages, system_prompt))
    elif system_prompt is not None:
        text = f"{system_prompt}\n{prompt.text}"
    else:
        text = prompt.text
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def encode_completion(tokenizer: Any, text: str) -> list[int]:
    """SFT target ids: the tokens of ``text`` (no special tokens added) followed by the
    tokenizer's EOS, so the model learns where to stop."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError(
            "the tokenizer has no eos_token_id; SFT targets end with EOS so the model "
            "learns to stop. Set `eos_token` in the tokenizer's tokenizer_config.json"
        )
    return [*tokenizer(text, add_special_tokens=False)["input_ids"], int(eos)]


def _chat_template_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """``apply_chat_template(tokenize=True)`` as a flat list of ints.

    transformers 5 returns a ``BatchEncoding`` (a mapping with ``input_ids``) by default,
    older versions a plain list; both are accepted.
    """
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, Mapping):
        out = out["input_ids"]
    ids = list(out)
    if ids and isinstance(ids[0], (list, tuple)):  # a batch of one conversation
        if len(ids) != 1:
            raise ValueError(f"apply_chat_template returned {len(ids)} sequences for one prompt")
        ids = list(ids[0])
    return [int(i) for i in ids]


def encode_vl_prompt(
    processor: Any, messages: Sequence[Mapping[str, Any]], images: Sequence[Any]
) -> tuple[list[int], VisionInputs | None]:
    """``(input_ids, vision)`` of ``messages`` (the system prompt already in them) rendered by
    a vision-language model's processor, each ``{"type": "image"}`` part taking the next of
    ``images`` (decoded ``PIL.Image`` objects, in order).

    ``vision`` is the processor's output besides the ids: its per-image tensors, each with
    the images along dim 0 (a leading batch dim of one, which some processors add, is
    removed); tensors aligned with the tokens (``attention_mask``, Qwen2-VL's
    ``mm_token_type_ids``) are left out, being functions of the ids that the model's
    caller rebuilds for the whole sequence. None without images."""
    pending = iter(images)
    conversation = [
        {"role": m["role"], "content": [_with_image(part, pending) for part in _parts(m["content"])]}
        for m in messages
    ]
    if next(pending, None) is not None:
        raise ValueError("encode_vl_prompt: more images than image parts in the messages")
    out = processor.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, return_dict=True,
        return_tensors="pt",
    )
    ids_1L = out["input_ids"]
    if ids_1L.dim() != 2 or ids_1L.shape[0] != 1:
        raise ValueError(f"the processor returned input_ids of shape {tuple(ids_1L.shape)} for one prompt")
    if not images:
        return [int(i) for i in ids_1L[0]], None
    vision = {
        key: _images_first(value, len(images))
        for key, value in out.items()
        if key != "input_ids" and tuple(value.shape) != tuple(ids_1L.shape)
    }
    return [int(i) for i in ids_1L[0]], vision


def _parts(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def _with_image(part: dict[str, Any], pending: Any) -> dict[str, Any]:
    if part["type"] != "image":
        return dict(part)
    image = next(pending, None)
    if image is None:
        raise ValueError("encode_vl_prompt: more image parts in the messages than images")
    return {"type": "image", "image": image}


def _images_first(value: Any, n_images: int) -> Any:
    """``value`` with its leading batch dim of one dropped when the processor added one
    (``[1, n_images, ...]``); Qwen2-VL's ``[patches, D]`` and LLaVA's ``[n, 3, H, W]``
    already hold the images along dim 0 and are kept as they are."""
    if value.dim() >= 3 and value.shape[0] == 1 and value.shape[1] == n_images:
        return value[0]
    return value
