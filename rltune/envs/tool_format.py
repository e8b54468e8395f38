"""Tool calls and tool results in the model's chat-template convention.

Calls are written the way Qwen2/Qwen2.5/Qwen3 and Hermes-style chat templates write
them, a JSON object between tags inside the assistant's turn::

    <tool_call>
    {"name": "search", "arguments": {"query": "code of kav"}}
    </tool_call>

The whitespace around the JSON is free. Generation of a turn stops at ``</tool_call>``
(the runner adds it to the stop strings), so one turn holds at most one call.

Results are rendered by the tokenizer's own chat template as a ``tool`` message: the
tokens between the model's turn and the next assistant turn are whatever the template
writes for ``[..., assistant, tool]`` with the generation prompt, found by rendering a
probe conversation with and without the tool message and taking the difference. A
tokenizer without a chat template gets the plain format of :mod:`rltune.data.chat`
(``"\\ntool: RESULT\\nassistant: "``).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from rltune.data.chat import has_chat_template

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
_PROBE_USER, _PROBE_ASSISTANT, _PROBE_RESULT = "U", "A", "\x00RESULT\x00"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


class ToolCallError(ValueError):
    """A call the model wrote that cannot be run; its message is shown to the model."""


def parse_tool_call(text: str) -> ToolCall | None:
    """The last complete ``<tool_call>...</tool_call>`` of ``text``, or None when the turn
    has none (the model answered). Raises :class:`ToolCallError` for a call that is not a
    JSON object with a string ``name`` and an object ``arguments`` (and no other error)."""
    calls = _CALL.findall(text)
    if not calls:
        return None
    try:
        data = _json(calls[-1].strip())
    except json.JSONDecodeError as exc:
        raise ToolCallError(f"the tool call is not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        raise ToolCallError('a tool call is a JSON object {"name": ..., "arguments": {...}}')
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = _json(arguments)
        except json.JSONDecodeError:
            raise ToolCallError("the tool call's arguments are not a JSON object") from None
    if not isinstance(arguments, dict):
        raise ToolCallError("the tool call's arguments are not a JSON object")
    return ToolCall(data["name"], arguments)


def _json(text: str) -> Any:
    """``json.loads(text)``, with what the parser refuses beyond bad syntax (nesting deeper
    than Python's recursion allows, an integer past its digit limit) as a
    :class:`ToolCallError` too: both are the model's writing, to be shown to it."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise ToolCallError("the tool call is nested too deeply to read") from None
    except ValueError:  # int("9" * 5000): past sys.get_int_max_str_digits()
        raise ToolCallError(f"the tool call holds an integer of more than "
                            f"{sys.get_int_max_str_digits()} digits") from None


def format_tool_call(call: ToolCall) -> str:
    """The text of ``call`` as a model writes it (for demonstrations and tests)."""
    body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


@dataclass(frozen=True)
class TurnGlue:
    """The text an environment's turn adds between two assistant turns.

    ``after_eos``: what the template writes after the end-of-turn token of an assistant
    message (``"\\n"`` in ChatML). ``end_of_turn``: the end-of-turn text itself, added when
    the model's turn stopped at a stop string instead. ``before``/``after``: around the
    tool result, up to and including the next assistant turn's header.
    """

    end_of_turn: str
    after_eos: str
    before: str
    after: str

    def observation_text(self, result: str, *, ended_turn: bool) -> str:
        return ("" if ended_turn else self.end_of_turn) + self.after_eos + self.before + result + self.after


def turn_glue(tokenizer: Any, *, use_chat_template: bool = True) -> TurnGlue:
    """The :class:`TurnGlue` of ``tokenizer``'s chat template (see the module docstring);
    the plain format when it has none or ``use_chat_template`` is off."""
    eos = tokenizer.eos_token or ""
    if not (use_chat_template and has_chat_template(tokenizer)):
        return TurnGlue(end_of_turn=eos, after_eos="", before="\ntool: ", after="\nassistant: ")
    base = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}]
    render = lambda messages, gen: tokenizer.apply_chat_template(  # noqa: E731
        messages, tokenize=False, add_generation_prompt=gen
    )
    without = render(base, False)
    with_tool = render([*base, {"role": "tool", "content": _PROBE_RESULT}], True)
    if not with_tool.startswith(without) or _PROBE_RESULT not in with_tool:
        raise ValueError(
            "the tokenizer's chat template does not render a `tool` message after an "
            "assistant turn as an addition to the conversation; multi-turn environments need "
            "one that does (or set data.chat_template: false for the plain format)"
        )
    added = with_tool[len(without):]
    before, after = added.split(_PROBE_RESULT, 1)
    tail = without[without.rindex(_PROBE_ASSISTANT) + len(_PROBE_ASSISTANT):]
    if eos and tail.startswith(eos):
        end_of_turn, after_eos = eos, tail[len(eos):]
    else:  # a template that does not close the turn with the EOS token
        end_of_turn, after_eos = tail, ""
    return TurnGlue(end_of_turn=end_of_turn, after_eos=after_eos, before=before, after=after)
