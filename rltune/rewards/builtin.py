"""Reward functions that ship with rltune. Name them in a config as
``rltune.rewards.builtin:NAME`` or, shorter, ``builtin:NAME``.

Each follows the reward contract ``fn(prompt, completion, **meta) -> float | None``:
``meta`` is the prompt's ``meta`` merged with the config's ``kwargs``. A wrong answer scores
0.0; a problem with the *data* (no reference answer) raises, so the sample is counted as an
error instead of being scored as if the model were wrong.
"""

from __future__ import annotations

import importlib
import numbers
import re
from decimal import Decimal, InvalidOperation
from typing import Any

import torch

from rltune.algos import overlong_penalty
from rltune.data.records import Prompt
from rltune.rewards.boxed import last_boxed
from rltune.rewards.contract import verifier
from rltune.rewards.math_verify import math_answer as math_answer  # `builtin:math_answer`

# Built-in rewards that load models, clients or the sandbox: imported on first use.
_LAZY = {
    "reward_model": "rltune.rewards.model_rewards",
    "llm_judge": "rltune.rewards.judge",
    "safety": "rltune.rewards.safety",
    "code_tests": "rltune.rewards.code",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])

# A number as a model writes it: optional sign, digits with optional thousands commas
# (`1,234`, but not `1,2345`), optional decimals, or a bare `.5`. A `-` directly after a word
# character or a closing bracket is a binary minus (`10-3`), not a sign.
_SIGN = r"(?:(?<![\w)\]}])-)?"
_NUMBER = re.compile(
    rf"{_SIGN}(?:(?:\d{{1,3}}(?:,\d{{3}})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)",
    re.ASCII,
)


@verifier
def exact_numeric(
    prompt: Prompt,
    completion: str,
    *,
    answer: str | int | float | None = None,
    **_: object,
) -> float | None:
    """1.0 if the completion's final number equals ``answer``, else 0.0.

    The final number is the last number inside the last closed ``\\boxed{...}`` when the
    completion has one (:func:`rltune.rewards.boxed.last_boxed`: a ``\\boxed{`` without its
    closing brace is skipped), otherwise the last number in the whole completion. Numbers may
    carry a sign, decimals and thousands commas: ``"1,234.50"`` reads as 1234.5. Fractions
    and scientific notation are not parsed.
    The comparison is exact in decimal: ``"3.0"`` equals ``3``, ``"0.30000001"`` does not
    equal ``0.3``.

    A completion with no number scores 0.0 (a wrong answer). A missing or unparsable
    ``answer`` raises ValueError (a data problem: the sample is not scored).
    """
    expected = _parse_answer(answer, prompt_id=prompt.id)
    boxed = last_boxed(completion)
    region = completion if boxed is None else boxed
    numbers_found = _NUMBER.findall(region)
    if not numbers_found:
        return 0.0
    return 1.0 if _to_decimal(numbers_found[-1]) == expected else 0.0


@verifier
def exact_text(
    prompt: Prompt,
    completion: str,
    *,
    answer: str | int | None = None,
    **_: object,
) -> float | None:
    """1.0 if the completion, normalised, equals ``answer``, normalised; else 0.0.

    Normalising strips the ends, lower-cases (``str.casefold``), joins runs of whitespace
    into one space and drops one final ``.``: ``" Blue."`` equals ``"blue"``, but
    ``"blue, I think"`` and ``"dark blue"`` do not. For short closed answers (a word, a
    yes/no, a count); use :func:`exact_numeric` where numbers may be written differently.

    A missing ``answer``, or one that is neither a string nor an integer, raises ValueError
    (a data problem: the sample is not scored).
    """
    if answer is None:
        raise ValueError(
            f"prompt {prompt.id!r}: exact_text needs an `answer` in the prompt's meta "
            "(the dataset row) or in the reward's kwargs"
        )
    if isinstance(answer, bool) or not isinstance(answer, (str, int)):
        raise ValueError(
            f"prompt {prompt.id!r}: exact_text's answer must be a string or an integer, "
            f"got {type(answer).__name__} {answer!r}"
        )
    return 1.0 if _normal_text(completion) == _normal_text(str(answer)) else 0.0


def _normal_text(text: str) -> str:
    text = " ".join(text.split()).casefold()
    return text[:-1].rstrip() if text.endswith(".") else text


def format_regex(prompt: Prompt, completion: str, *, pattern: str, **_: object) -> float:
    """1.0 if the whole stripped completion matches ``pattern``, else 0.0.

    Uses ``re.fullmatch(pattern, completion.strip(), re.DOTALL)``: the pattern must cover the
    entire completion (no implicit ``.*`` at either end), and ``.`` also matches newlines.
    Example: ``"<think>.*</think>\\s*<answer>.*</answer>"``.
    """
    return 1.0 if re.fullmatch(pattern, completion.strip(), re.DOTALL) else 0.0


def _check_format_regex(kwargs: dict[str, Any]) -> None:
    if "pattern" in kwargs:
        try:
            re.compile(kwargs["pattern"])
        except (re.error, TypeError) as err:
            raise ValueError(f"kwargs.pattern {kwargs['pattern']!r} is not a regular expression ({err})") from None


format_regex.check_kwargs = _check_format_regex  # type: ignore[attr-defined]


def length_penalty(
    prompt: Prompt, completion: str, *, max_chars: int, per_char: float = 0.01, cap: float = 1.0,
    **_: object,
) -> float:
    """A linear penalty on characters beyond ``max_chars``:
    ``-min(cap, per_char * max(0, len(completion) - max_chars))``. 0.0 within the limit.
    Add it next to a task reward to keep answers short."""
    if max_chars < 0 or per_char < 0 or cap < 0:
        raise ValueError(f"length_penalty: max_chars, per_char and cap must be >= 0 (got {max_chars}, {per_char}, {cap})")
    return -min(cap, per_char * max(0, len(completion) - max_chars))


def overlong(
    prompt: Prompt, completion: str, *, max_chars: int, buffer_chars: int, penalty: float = 1.0,
    **_: object,
) -> float:
    """DAPO's soft overlong punishment measured in characters (see
    :func:`rltune.algos.overlong_penalty`): 0 up to ``max_chars - buffer_chars``, then
    falling linearly to ``-penalty`` at ``max_chars``, and ``-penalty`` beyond. The
    token-level form is ``algo.overlong_buffer``, which counts the policy's own tokens."""
    lengths = torch.tensor([len(completion)], dtype=torch.float64)
    return float(overlong_penalty(lengths, max_len=max_chars, buffer=buffer_chars, penalty=penalty)[0])


def _parse_answer(answer: object, *, prompt_id: str) -> Decimal:
    if answer is None:
        raise ValueError(
            f"prompt {prompt_id!r}: exact_numeric needs an `answer` in the prompt's meta "
            "(the dataset row) or in the reward's kwargs"
        )
    if isinstance(answer, bool):
        raise ValueError(f"prompt {prompt_id!r}: answer {answer!r} is a bool, not a number")
    if isinstance(answer, numbers.Integral):
        value = Decimal(int(answer))
    elif isinstance(answer, numbers.Real):
        # repr gives the shortest string that round-trips: 0.1 -> Decimal("0.1"), not the
        # binary expansion 0.1000000000000000055...
        value = Decimal(repr(float(answer)))
    elif isinstance(answer, str) and _NUMBER.fullmatch(answer.strip()):
        value = _to_decimal(answer.strip())
    else:
        raise ValueError(
            f"prompt {prompt_id!r}: answer {answer!r} is not a number "
            "(expected e.g. 42, -3.5 or '1,234')"
        )
    if not value.is_finite():
        raise ValueError(f"prompt {prompt_id!r}: answer {answer!r} is not finite")
    return value


def _to_decimal(text: str) -> Decimal:
    try:
        return Decimal(text.replace(",", ""))
    except InvalidOperation as exc:  # unreachable for strings _NUMBER matched
        raise ValueError(f"cannot read {text!r} as a number") from exc
