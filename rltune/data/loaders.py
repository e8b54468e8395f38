"""Loading prompt datasets into validated, tokenised :class:`Prompt` records.

Sources (``data.train`` / ``data.eval``):

- ``*.jsonl``: one JSON object per line; blank lines are ignored; row numbers are line
  numbers.
- ``*.parquet``: read with pyarrow (the ``data`` extra).
- a directory written by ``datasets.Dataset.save_to_disk`` (the ``data`` extra).
- ``builtin:TASK/SPLIT``: a task from :mod:`rltune.data.tasks`.

Every source yields rows (dicts) that go through the same checks. The prompt field
(``data.prompt_field``) holds a string or a list of ``{"role", "content"}`` messages; the
other fields go into ``Prompt.meta`` unchanged, except the completion field
(``data.completion_field``), which is the SFT target: reward functions are called as
``fn(prompt, completion, **meta)``, so a ``completion`` in meta would collide with the
generated text. With ``with_completion=True`` (SFT) ``meta["completion"]`` is the target
text and ``meta["completion_ids"]`` its tokens followed by EOS.

With ``with_pairs=True`` (DPO, SimPO, reward-model training) every row is a preference
pair: besides the prompt, ``data.chosen_field`` and ``data.rejected_field`` each hold the
response as a string, or as a list of messages that ends with the one ``assistant``
message of the response, optionally preceded by the prompt's own messages (the
conversational format that repeats the prompt; with a string prompt, that prefix is
``[{"role": "user", "content": PROMPT}]``; an assistant content may also be a list of
text parts, joined, and a copy of an image prompt has its image parts). A response
renders as an SFT target does, its content's tokens followed by EOS, right after the
rendered prompt, which the two responses share token for token; this is also exactly
what the policy emits when it generates that response. ``meta["chosen"]`` / ``meta["rejected"]`` are the response
texts and ``meta["chosen_ids"]`` / ``meta["rejected_ids"]`` their tokens; the two raw
fields are not kept in meta. A pair whose two responses have the same tokens is a bad
row: it states no preference, and every preference loss gets no gradient from it.

Rows with images (vision-language models, :mod:`rltune.data.images`): the prompt's
messages may hold image parts, or the images field (``data.images_field``) a list of
images, which go before the text of the first user turn (a string prompt becomes that
user turn), as TRL places them. ``Prompt.messages`` then keeps each image as the
placeholder ``{"type": "image"}`` and ``Prompt.images`` the images in that order; the
images field is not kept in meta. Such a prompt is rendered once, with its images, by the
model's processor (``processor`` below; :func:`rltune.data.chat.encode_vl_prompt`), which
fills ``Prompt.vision``; ``data.max_prompt_tokens`` counts its image tokens. With a
processor, rows without images render through it too (no vision inputs). Rows with images
and no processor (a text-only model) stop loading whatever ``data.on_bad_row`` says, as
does ``data.chat_template: false``, which has no way to place image tokens; an image that
is missing, unreadable or too large is a bad row. Images that would be ignored stop
loading too: a row without images that holds some in another field named like an images
field (``image``, ``img``, ...; :func:`rltune.data.images.stray_images`), or a
``data.images_field`` other than the default that no row of the source has.

Ids are the ``data.id_field`` value as a string, or ``NAME:ROW`` (NAME the file's base
name, or ``TASK/SPLIT`` for built-ins; ROW 1-based). A bad row stops loading with a
:class:`DataError` that names the source, the row and the config key to change, or, with
``data.on_bad_row: skip``, is counted in ``PromptSet.skipped``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from jinja2 import TemplateError

from rltune.data.chat import encode_completion, encode_prompt, encode_vl_prompt, unencodable, with_system_prompt
from rltune.data.images import ImageError, decode_image, read_image, split_parts, stray_images
from rltune.data.records import Prompt, PromptImage, VisionInputs
from rltune.data.sources import BadRow as _BadRow
from rltune.data.sources import DataError, RawRow, image_dir, open_source

__all__ = ["DataError", "PromptSet", "load_prompts"]

if TYPE_CHECKING:  # only its fields are read; the data layer needs no config at run time
    from rltune.config.schema import DataConfig

MAX_SKIP_EXAMPLES = 5
_SKIP_HINT = "or set data.on_bad_row=skip to skip such rows"


@dataclass
class PromptSet:
    """The prompts of one source, in source order.

    ``skipped`` counts bad rows dropped under ``data.on_bad_row: skip``;
    ``skip_examples`` holds the messages of the first few of them.
    """

    prompts: list[Prompt]
    skipped: int
    source: str
    skip_examples: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompts)


# A prompt's other fields are given to reward functions as keywords beside these.
_REWARD_ARGS = frozenset({"prompt", "completion"})


@dataclass(frozen=True)
class _Render:
    """What turns a source's rows into ids: the tokenizer, a vision-language model's
    processor (None for a text model, named ``model`` in errors) and the directory that
    relative image paths start from. ``seen`` holds one copy of the pixel inputs of each
    distinct list of images, shared by every prompt that has those images."""

    cfg: DataConfig
    tokenizer: Any
    processor: Any
    model: str | None
    base_dir: Path | None
    source: str
    seen: dict[tuple[str, ...], VisionInputs] = field(default_factory=dict)


def load_prompts(
    source: str,
    cfg: DataConfig,
    tokenizer: Any,
    *,
    with_completion: bool = False,
    with_pairs: bool = False,
    processor: Any = None,
    model: str | None = None,
    fields_are_keywords: bool = False,
) -> PromptSet:
    """Read, check and tokenise every row of ``source`` (see the module docstring).

    ``with_completion``: rows carry an SFT target; ``with_pairs``: rows are preference
    pairs. At most one of them. ``processor``: a vision-language model's processor (None
    for a text model); ``model`` names the model in the error for images without one.
    ``fields_are_keywords``: the rows' other fields are passed to reward functions as
    keywords (a per-sample reward is configured), so a field named ``prompt`` or
    ``completion`` is a bad row."""
    if with_completion and with_pairs:
        raise ValueError("load_prompts: with_completion and with_pairs exclude each other")
    if (with_completion or with_pairs) and getattr(tokenizer, "eos_token_id", None) is None:
        raise DataError(
            f"{source}: the model's tokenizer has no eos_token, and "
            f"{'SFT targets' if with_completion else 'preference responses'} end with EOS so the model learns "
            "where a response stops; set `eos_token` in the model's tokenizer_config.json"
        )
    if problem := unencodable(cfg.system_prompt or "", "data.system_prompt"):
        raise DataError(f"{problem}; fix the text's encoding")
    name, rows = open_source(source)
    render = _Render(cfg, tokenizer, processor, model, image_dir(source), source)
    prompts: list[Prompt] = []
    skip_examples: list[str] = []
    skipped = 0
    seen_ids: dict[str, int] = {}
    fields: set[str] = set()  # every field name of the source
    for raw in rows:
        fields.update(raw.fields or ())
        try:
            prompt = _row_to_prompt(
                raw, name, render, with_completion=with_completion, with_pairs=with_pairs,
                fields_are_keywords=fields_are_keywords,
            )
            _check_unique_id(prompt.id, raw.number, seen_ids)
        except _BadRow as bad:
            message = f"{source}: row {raw.number}: {bad.problem}; {bad.hint}"
            if cfg.on_bad_row == "error":
                raise DataError(f"{message}, {_SKIP_HINT}") from None
            skipped += 1
            if len(skip_examples) < MAX_SKIP_EXAMPLES:
                skip_examples.append(message)
            continue
        prompts.append(prompt)
    _check_images_field(source, cfg, fields)
    if not prompts:
        detail = f"all {skipped} rows were bad, e.g. {skip_examples[0]}" if skipped else None
        raise DataError(f"{source}: no usable prompts ({detail or 'it has no rows'})")
    return PromptSet(prompts=prompts, skipped=skipped, source=source, skip_examples=skip_examples)


# --- rows ----------------------------------------------------------------------------


def _row_to_prompt(
    raw: RawRow,
    name: str,
    render: _Render,
    *,
    with_completion: bool,
    with_pairs: bool = False,
    fields_are_keywords: bool = False,
) -> Prompt:
    if raw.fields is None:
        raise _BadRow(str(raw.problem), "fix or remove the line")
    row, cfg, tokenizer = raw.fields, render.cfg, render.tokenizer
    messages, text, refs = _parse_prompt_field(row, cfg.prompt_field)
    # the prompt as messages, to recognise it at the head of a conversational response
    asked = messages if messages is not None else [{"role": "user", "content": text}]
    messages, text, refs = _with_field_images(messages, text, refs, row.get(cfg.images_field))
    not_meta = {cfg.prompt_field, cfg.completion_field, cfg.images_field}
    if with_pairs:
        not_meta |= {cfg.chosen_field, cfg.rejected_field}
    meta = {k: v for k, v in row.items() if k not in not_meta}
    if not refs and (stray := stray_images(meta, cfg.images_field)):
        raise DataError(f"{render.source}: row {raw.number}: {stray}")
    if fields_are_keywords:
        _check_reward_args(meta)
    if with_pairs:
        meta["chosen"] = _response_text(row, cfg.chosen_field, asked, "data.chosen_field")
        meta["rejected"] = _response_text(row, cfg.rejected_field, asked, "data.rejected_field")
    if with_completion:
        meta["completion"] = _completion_text(row, cfg.completion_field)
    prompt = Prompt(
        id=_prompt_id(row, raw.number, name, cfg.id_field), messages=messages, text=text, meta=meta
    )
    try:
        ids = _encode(render, prompt, refs, raw.number)
    except TemplateError as err:  # the template's own raise_exception, or a template that does not parse
        raise _BadRow(
            f"the model's chat template fails on this prompt ({type(err).__name__}: {err})",
            "check the prompt's roles and data.system_prompt against the template, or its chat_template file",
        ) from None
    if len(ids) > cfg.max_prompt_tokens:
        raise _BadRow(
            f"the prompt is {len(ids)} tokens, more than data.max_prompt_tokens="
            f"{cfg.max_prompt_tokens}",
            "raise data.max_prompt_tokens or shorten the prompt",
        )
    prompt.input_ids = ids
    if with_completion:
        meta["completion_ids"] = encode_completion(tokenizer, meta["completion"])
    if with_pairs:
        meta["chosen_ids"] = encode_completion(tokenizer, meta["chosen"])
        meta["rejected_ids"] = encode_completion(tokenizer, meta["rejected"])
        if meta["chosen_ids"] == meta["rejected_ids"]:
            raise _BadRow(
                f"the chosen and rejected responses are the same ({len(meta['chosen_ids'])} "
                f"tokens); a tie states no preference",
                "remove the row or check data.chosen_field / data.rejected_field",
            )
    return prompt


def _check_reward_args(meta: dict[str, Any]) -> None:
    if taken := sorted(_REWARD_ARGS & meta.keys()):
        raise _BadRow(
            f"the field {taken[0]!r} would reach the reward functions as a keyword, but "
            f"`{taken[0]}` is already their argument (fn(prompt, completion, **fields))",
            f"rename the field, or make it the prompt with data.prompt_field: {taken[0]}",
        )


def _check_images_field(source: str, cfg: DataConfig, fields: set[str]) -> None:
    """Refuse an images field, set to other than the default, that no row has: every prompt
    would be text-only. ``fields``: the field names of the rows."""
    default = type(cfg).model_fields["images_field"].default
    if fields and cfg.images_field != default and cfg.images_field not in fields:
        raise DataError(
            f"{source}: no row has the images field {cfg.images_field!r} (data.images_field), so "
            f"no prompt would have images; the rows have fields {sorted(fields)}: set "
            f"data.images_field to the one with the images, or remove it for text-only data"
        )


def _parse_prompt_field(
    row: dict[str, Any], key: str
) -> tuple[list[dict[str, Any]] | None, str | None, list[Any]]:
    """``(messages, text, image refs)`` from the prompt field, exactly one of messages and
    text set; the refs are those of the messages' image parts, in order."""
    hint = "check data.prompt_field"
    if row.get(key) is None:
        raise _BadRow(
            f"no field {key!r} (or it is null); the row has fields {sorted(row)}", hint
        )
    value = row[key]
    if isinstance(value, str):
        if not value.strip():
            raise _BadRow(f"the prompt field {key!r} is empty", hint)
        return None, _encodable(value, f"the prompt field {key!r}"), []
    if isinstance(value, list):
        refs: list[Any] = []
        return _parse_messages(value, key, image_refs=refs), None, refs
    raise _BadRow(
        f"the prompt field {key!r} must be a string or a list of {{role, content}} messages, "
        f"got {type(value).__name__}",
        hint,
    )


def _parse_messages(
    value: list[Any], key: str, *, image_refs: list[Any] | None = None
) -> list[dict[str, Any]]:
    """The messages of ``value``. With ``image_refs`` (a prompt's messages), a content may
    also be a list of text and image parts (:func:`rltune.data.images.split_parts`), whose
    image references are appended to ``image_refs``."""
    hint = "each message must be {\"role\": str, \"content\": str}"
    if image_refs is not None:
        hint = hint[:-1] + " or a list of text and image parts}"
    if not value:
        raise _BadRow(f"the field {key!r} is an empty list of messages", hint)
    messages = []
    for i, m in enumerate(value, 1):
        if not isinstance(m, dict):
            raise _BadRow(f"message {i} of {key!r} is a {type(m).__name__}, not an object", hint)
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise _BadRow(f"message {i} of {key!r} has unexpected keys {extra}", hint)
        role, content = m.get("role"), m.get("content")
        if image_refs is not None and isinstance(content, list) and isinstance(role, str) and role:
            content = _content_parts(content, f"message {i} of {key!r}", image_refs)
        elif not isinstance(role, str) or not role or not isinstance(content, str):
            raise _BadRow(
                f"message {i} of {key!r} needs a non-empty string 'role' and a string "
                f"'content', got role={role!r}, content={content!r}",
                hint,
            )
        where = f"message {i} of {key!r}"
        messages.append({"role": _encodable(role, f"the role of {where}"), "content": _encodable(content, where)})
    if not any(_has_content(m["content"]) for m in messages):
        raise _BadRow(f"every message of the field {key!r} is empty", hint)
    return messages


def _content_parts(content: list[Any], where: str, image_refs: list[Any]) -> list[dict[str, str]]:
    try:
        parts, refs = split_parts(content, where)
    except ImageError as err:
        raise _BadRow(err.problem, err.hint) from None
    image_refs.extend(refs)
    return parts


def _has_content(content: str | list[dict[str, str]]) -> bool:
    if isinstance(content, str):
        return bool(content.strip())
    return any(p["type"] == "image" or p["text"].strip() for p in content)


def _with_field_images(
    messages: list[dict[str, Any]] | None, text: str | None, refs: list[Any], field: Any
) -> tuple[list[dict[str, Any]] | None, str | None, list[Any]]:
    """The prompt with the images of the images field placed before the text of its first
    user turn (a string prompt becomes that turn); unchanged when the field is empty."""
    if field is None or (isinstance(field, list) and not field):
        return messages, text, refs
    hint = "check data.images_field"
    if not isinstance(field, list):
        raise _BadRow(f"the images field must be a list of images, got {type(field).__name__}", hint)
    if refs:
        raise _BadRow("the row has both image parts in its messages and an images field",
                      f"{hint}; give each image once")
    if messages is None:
        messages = [{"role": "user", "content": str(text)}]
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        raise _BadRow("the row has images but no user message to place them in", hint)
    placed = [dict(m) for m in messages]
    content = placed[first_user]["content"]
    text_parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    placed[first_user]["content"] = [*({"type": "image"} for _ in field), *text_parts]
    return placed, None, list(field)


def _encode(render: _Render, prompt: Prompt, refs: list[Any], number: int) -> list[int]:
    """The prompt's ids; with images (or any row, given a processor) rendered by the
    processor, filling ``prompt.images`` and ``prompt.vision``."""
    cfg = render.cfg
    if refs and render.processor is None:
        model = f"model.path={render.model}" if render.model else "model.path"
        raise DataError(
            f"{render.source}: row {number} has images, but {model} is a text-only model; "
            f"rows with images need a vision-language model (one with a processor)"
        )
    if refs and not (cfg.chat_template and getattr(render.processor, "chat_template", None)):
        raise DataError(
            f"{render.source}: row {number} has images, which only the processor's chat "
            f"template places: set data.chat_template=true (and use a model whose processor "
            f"has a chat template)"
        )
    if render.processor is None or not cfg.chat_template:
        return encode_prompt(render.tokenizer, prompt, system_prompt=cfg.system_prompt,
                             use_chat_template=cfg.chat_template)
    images, decoded = _read_images(render, refs, number)
    messages = prompt.messages or [{"role": "user", "content": str(prompt.text)}]
    ids, vision = encode_vl_prompt(
        render.processor, with_system_prompt(messages, cfg.system_prompt), decoded
    )
    if vision is not None:
        vision = _shared(render.seen, tuple(image.digest for image in images), vision)
    prompt.images, prompt.vision = images or None, vision
    return ids


def _shared(seen: dict[tuple[str, ...], VisionInputs], digests: tuple[str, ...],
            vision: VisionInputs) -> VisionInputs:
    """The first copy of equal pixel inputs of the images ``digests`` (several questions
    about one image keep its pixels once); checked equal, not assumed, since a processor
    could make them depend on the text."""
    kept = seen.setdefault(digests, vision)
    same = kept.keys() == vision.keys() and all(
        kept[k].shape == v.shape and torch.equal(kept[k], v) for k, v in vision.items()
    )
    return kept if same else vision


def _read_images(render: _Render, refs: list[Any], number: int) -> tuple[list[PromptImage], list[Any]]:
    images, decoded = [], []
    try:
        for k, ref in enumerate(refs, 1):
            image = read_image(ref, base_dir=render.base_dir, row=number, index=k,
                               max_bytes=render.cfg.max_image_bytes)
            decoded.append(decode_image(image, index=k, max_pixels=render.cfg.max_image_pixels))
            images.append(image)
    except ImageError as err:
        raise _BadRow(err.problem, err.hint) from None
    return images, decoded


def _prompt_id(row: dict[str, Any], number: int, name: str, id_field: str | None) -> str:
    if id_field is None:
        return f"{name}:{number}"
    value = row.get(id_field)
    if value is None or str(value) == "":
        raise _BadRow(
            f"no id in field {id_field!r}; the row has fields {sorted(row)}",
            "check data.id_field (null numbers rows instead)",
        )
    return str(value)


def _completion_text(row: dict[str, Any], key: str) -> str:
    hint = "check data.completion_field"
    value = row.get(key)
    if value is None:
        raise _BadRow(f"no completion field {key!r} (or it is null); the row has fields "
                      f"{sorted(row)}", hint)
    if not isinstance(value, str) or not value:
        raise _BadRow(f"the completion field {key!r} must be a non-empty string, got {value!r}",
                      hint)
    return _encodable(value, f"the completion field {key!r}")


def _response_text(
    row: dict[str, Any], key: str, prompt_messages: list[dict[str, str]], setting: str
) -> str:
    """The text of the response in ``row[key]``: a string, or a list of messages that is
    one assistant message, optionally after a copy of ``prompt_messages``."""
    hint = f"check {setting}"
    value = row.get(key)
    if value is None:
        raise _BadRow(
            f"no response field {key!r} (or it is null); the row has fields {sorted(row)}", hint
        )
    if isinstance(value, str):
        if not value:
            raise _BadRow(f"the response field {key!r} is an empty string", hint)
        return _encodable(value, f"the response field {key!r}")
    if not isinstance(value, list):
        raise _BadRow(
            f"the response field {key!r} must be a string or a list of {{role, content}} "
            f"messages, got {type(value).__name__}",
            hint,
        )
    # parts allowed: a copy of an image prompt has image parts, and TRL's conversational
    # vision datasets give the response as text parts
    messages = _parse_messages(value, key, image_refs=[])
    n = len(prompt_messages)
    if len(messages) > 1 and messages[:n] == prompt_messages:
        messages = messages[n:]
    if len(messages) != 1 or messages[0]["role"] != "assistant":
        roles = [m["role"] for m in messages]
        raise _BadRow(
            f"the response field {key!r} must end with the one assistant message of the "
            f"response, after nothing or after exactly the prompt's messages; after "
            f"removing a leading copy of the prompt its roles are {roles}",
            f"{hint}; the conversation before the response belongs in data.prompt_field",
        )
    content = messages[0]["content"]
    if not isinstance(content, str):
        if any(part["type"] == "image" for part in content):
            raise _BadRow(f"the assistant message of {key!r} has an image part; a response is text", hint)
        content = "".join(part["text"] for part in content)
    if not content:
        raise _BadRow(f"the assistant message of {key!r} is empty", hint)
    return content


def _encodable(value: Any, what: str) -> Any:
    """``value`` (a text or a content's parts), or a bad row if no tokenizer can encode it."""
    if problem := unencodable(value, what):
        raise _BadRow(problem, "fix the text's encoding")
    return value


def _check_unique_id(prompt_id: str, number: int, seen: dict[str, int]) -> None:
    if prompt_id in seen:
        raise _BadRow(
            f"prompt id {prompt_id!r} already used by row {seen[prompt_id]}",
            "make data.id_field unique per row (null numbers rows instead)",
        )
    seen[prompt_id] = number
