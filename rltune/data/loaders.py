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
``[{"role": "user", "content": PROMPT}]``). A response renders as an SFT target does, its
content's tokens followed by EOS, right after the rendered prompt, which the two
responses share token for token; this is also exactly what the policy emits when it
generates that response. ``meta["chosen"]`` / ``meta["rejected"]`` are the response
texts and ``meta["chosen_ids"]`` / ``meta["rejected_ids"]`` their tokens; the two raw
fields are not kept in meta. A pair whose two responses have the same tokens is a bad
row: it states no preference, and every preference loss gets no gradient from it.

Ids are the ``data.id_field`` value as a string, or ``NAME:ROW`` (NAME the file's base
name, or ``TASK/SPLIT`` for built-ins; ROW 1-based). A bad row stops loading with a
:class:`DataError` that names the source, the row and the config key to change, or, with
``data.on_bad_row: skip``, is counted in ``PromptSet.skipped``.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from rltune.data.chat import encode_completion, encode_prompt
from rltune.data.records import Prompt
from rltune.data.tasks import TASKS

if TYPE_CHECKING:  # only its fields are read; the data layer needs no config at run time
    from rltune.config.schema import DataConfig

BUILTIN_PREFIX = "builtin:"
MAX_SKIP_EXAMPLES = 5
_SKIP_HINT = "or set data.on_bad_row=skip to skip such rows"


class DataError(ValueError):
    """A dataset cannot be used as configured; the message says where and what to change."""


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


@dataclass(frozen=True)
class _RawRow:
    number: int  # 1-based
    fields: dict[str, Any] | None
    problem: str | None = None  # why the row could not be parsed at all


class _BadRow(Exception):
    """A row that fails a check: what is wrong and which setting or fix addresses it."""

    def __init__(self, problem: str, hint: str) -> None:
        super().__init__(problem)
        self.problem, self.hint = problem, hint


def load_prompts(
    source: str,
    cfg: DataConfig,
    tokenizer: Any,
    *,
    with_completion: bool = False,
    with_pairs: bool = False,
) -> PromptSet:
    """Read, check and tokenise every row of ``source`` (see the module docstring).

    ``with_completion``: rows carry an SFT target; ``with_pairs``: rows are preference
    pairs. At most one of them."""
    if with_completion and with_pairs:
        raise ValueError("load_prompts: with_completion and with_pairs exclude each other")
    name, rows = _open_source(source)
    prompts: list[Prompt] = []
    skip_examples: list[str] = []
    skipped = 0
    seen_ids: dict[str, int] = {}
    for raw in rows:
        try:
            prompt = _row_to_prompt(
                raw, name, cfg, tokenizer, with_completion=with_completion, with_pairs=with_pairs
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
    if not prompts:
        detail = f"all {skipped} rows were bad, e.g. {skip_examples[0]}" if skipped else None
        raise DataError(f"{source}: no usable prompts ({detail or 'it has no rows'})")
    return PromptSet(prompts=prompts, skipped=skipped, source=source, skip_examples=skip_examples)


# --- sources -------------------------------------------------------------------------


def _open_source(source: str) -> tuple[str, Iterable[_RawRow]]:
    """``(name used in ids, rows)`` of ``source``."""
    if source.startswith(BUILTIN_PREFIX):
        return _builtin_rows(source)
    path = Path(source)
    if not path.exists():
        raise DataError(f"data source {source!r} does not exist; check data.train / data.eval")
    if path.is_dir():
        return path.name, _read_datasets_dir(path)
    reader = _FILE_READERS.get(path.suffix)
    if reader is None:
        raise DataError(
            f"data source {source!r}: unsupported file type {path.suffix!r}; use .jsonl, "
            f".parquet, a `datasets` directory (save_to_disk) or {BUILTIN_PREFIX}TASK/SPLIT"
        )
    return path.name, reader(path)


def _builtin_rows(source: str) -> tuple[str, Iterable[_RawRow]]:
    spec = source[len(BUILTIN_PREFIX) :]
    task, _, split = spec.partition("/")
    if task not in TASKS or not split:
        raise DataError(
            f"data source {source!r}: expected {BUILTIN_PREFIX}TASK/SPLIT with TASK one of "
            f"{sorted(TASKS)}"
        )
    try:
        rows = TASKS[task](split)
    except ValueError as err:
        raise DataError(f"data source {source!r}: {err}") from err
    return spec, [_RawRow(i, row) for i, row in enumerate(rows, 1)]


def _read_jsonl(path: Path) -> Iterator[_RawRow]:
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as err:
                yield _RawRow(number, None, f"not valid UTF-8 ({err.reason} at byte {err.start})")
                continue
            except json.JSONDecodeError as err:
                # some of json's messages end in "at" (`Unterminated string starting at`)
                where = "" if err.msg.endswith(" at") else " at"
                yield _RawRow(number, None, f"invalid JSON ({err.msg}{where} column {err.colno})")
                continue
            if not isinstance(obj, dict):
                yield _RawRow(number, None, f"expected a JSON object, got {type(obj).__name__}")
                continue
            yield _RawRow(number, obj)


def _read_parquet(path: Path) -> list[_RawRow]:
    pa = _import_extra("pyarrow", what="parquet files")
    parquet = _import_extra("pyarrow.parquet", what="parquet files")
    try:
        table = parquet.read_table(path)
    except pa.ArrowException as err:
        raise DataError(f"cannot read parquet file {str(path)!r}: {err}") from err
    return [_RawRow(i, row) for i, row in enumerate(table.to_pylist(), 1)]


def _read_datasets_dir(path: Path) -> list[_RawRow]:
    datasets = _import_extra("datasets", what="`datasets` directories")
    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as err:
        raise DataError(
            f"data source {str(path)!r} is a directory but not one written by "
            f"datasets' save_to_disk: {err}"
        ) from err
    if isinstance(loaded, datasets.DatasetDict):
        raise DataError(
            f"data source {str(path)!r} holds several splits {sorted(loaded)}; point "
            f"data.train / data.eval at one of them, e.g. {str(path / next(iter(loaded)))!r}"
        )
    return [_RawRow(i, dict(row)) for i, row in enumerate(loaded, 1)]


_FILE_READERS = {".jsonl": _read_jsonl, ".parquet": _read_parquet}


def _import_extra(module: str, *, what: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise DataError(f"reading {what} needs `{module}`: pip install 'rltune[data]'") from err


# --- rows ----------------------------------------------------------------------------


def _row_to_prompt(
    raw: _RawRow,
    name: str,
    cfg: DataConfig,
    tokenizer: Any,
    *,
    with_completion: bool,
    with_pairs: bool = False,
) -> Prompt:
    if raw.fields is None:
        raise _BadRow(str(raw.problem), "fix or remove the line")
    row = raw.fields
    messages, text = _parse_prompt_field(row, cfg.prompt_field)
    not_meta = {cfg.prompt_field, cfg.completion_field}
    if with_pairs:
        not_meta |= {cfg.chosen_field, cfg.rejected_field}
    meta = {k: v for k, v in row.items() if k not in not_meta}
    if with_pairs:
        # the prompt as messages, to recognise it at the head of a conversational response
        asked = messages if messages is not None else [{"role": "user", "content": text}]
        meta["chosen"] = _response_text(row, cfg.chosen_field, asked, "data.chosen_field")
        meta["rejected"] = _response_text(row, cfg.rejected_field, asked, "data.rejected_field")
    if with_completion:
        meta["completion"] = _completion_text(row, cfg.completion_field)
    prompt = Prompt(
        id=_prompt_id(row, raw.number, name, cfg.id_field), messages=messages, text=text, meta=meta
    )
    ids = encode_prompt(
        tokenizer, prompt, system_prompt=cfg.system_prompt, use_chat_template=cfg.chat_template
    )
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


def _parse_prompt_field(
    row: dict[str, Any], key: str
) -> tuple[list[dict[str, str]] | None, str | None]:
    """``(messages, text)`` from the prompt field, exactly one of them set."""
    hint = "check data.prompt_field"
    if row.get(key) is None:
        raise _BadRow(
            f"no field {key!r} (or it is null); the row has fields {sorted(row)}", hint
        )
    value = row[key]
    if isinstance(value, str):
        if not value.strip():
            raise _BadRow(f"the prompt field {key!r} is empty", hint)
        return None, value
    if isinstance(value, list):
        return _parse_messages(value, key), None
    raise _BadRow(
        f"the prompt field {key!r} must be a string or a list of {{role, content}} messages, "
        f"got {type(value).__name__}",
        hint,
    )


def _parse_messages(value: list[Any], key: str) -> list[dict[str, str]]:
    hint = "each message must be {\"role\": str, \"content\": str}"
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
        if not isinstance(role, str) or not role or not isinstance(content, str):
            raise _BadRow(
                f"message {i} of {key!r} needs a non-empty string 'role' and a string "
                f"'content', got role={role!r}, content={content!r}",
                hint,
            )
        messages.append({"role": role, "content": content})
    if not any(m["content"].strip() for m in messages):
        raise _BadRow(f"every message of the field {key!r} is empty", hint)
    return messages


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
    return value


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
        return value
    if not isinstance(value, list):
        raise _BadRow(
            f"the response field {key!r} must be a string or a list of {{role, content}} "
            f"messages, got {type(value).__name__}",
            hint,
        )
    messages = _parse_messages(value, key)
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
    if not messages[0]["content"]:
        raise _BadRow(f"the assistant message of {key!r} is empty", hint)
    return messages[0]["content"]


def _check_unique_id(prompt_id: str, number: int, seen: dict[str, int]) -> None:
    if prompt_id in seen:
        raise _BadRow(
            f"prompt id {prompt_id!r} already used by row {seen[prompt_id]}",
            "make data.id_field unique per row (null numbers rows instead)",
        )
    seen[prompt_id] = number
