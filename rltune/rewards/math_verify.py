"""Maths answers: find the final answer in a completion and decide whether two answers are
the same value, not the same string. LaTeX is read, and sets, intervals, equations and
expressions are compared, by the field's library, math-verify (Hugging Face,
https://github.com/huggingface/Math-Verify); this module finds the answer, bounds what the
library is given, and compares plain numbers with a relative tolerance.

``answers_equal(pred, gold)`` prepares both sides (:func:`prepare`), then, cheapest first:

1. both are plain numbers (``-1,234.5``, ``.5``, ``3/4``, ``1e-3``): compared as exact
   fractions, equal when ``|a - b| <= rel_tol * max(|a|, |b|)``;
2. the prepared strings are equal (spaces ignored);
3. both are read by math-verify's LaTeX parser (``\\frac``, ``\\sqrt``, ``\\pi``, units,
   ``\\text{}``, ``x = 5``, tuples, intervals, sets, ...). Two numbers (``2\\sqrt{2}``,
   ``\\frac{\\pi}{2}``, ``10^{500}``) are evaluated to 30 digits and compared with the same
   relative tolerance; expressions with variables are first probed at a few fixed points
   (so a slow ``simplify`` only runs on answers that agree there); everything else is
   math-verify's ``verify(gold, pred)``.

What :func:`prepare` changes before the library sees an answer (both sides alike), and why:

- dollar signs (math delimiters or currency) are dropped, and percent signs *without*
  rescaling: ``50\\%`` equals ``50`` and ``50%`` but not ``0.5`` (math-verify would also
  make ``0.5`` right: a question asking "what percent" is answered as ``50`` as often as
  ``50%``, and ``0.5`` is not that answer);
- ``\\left`` and ``\\right`` are dropped, so the brackets below are seen;
- LaTeX spacing between digits is dropped (``1\\,234`` is ``1234``; the parser reads ``235``),
  ``{,}`` becomes a comma, and a number grouped in threes loses its commas (``1,234``;
  ``1,2`` stays the pair);
- names written as sympy writes them get their backslash (``pi``, ``oo``, ``exp``,
  ``sin``, ...), and a lone ``i`` is the imaginary unit, as in ``3+2i``.

Answers with top-level commas keep their brackets: ``(1, 2)`` is neither ``[1, 2)`` nor
the bare list ``1, 2``. Inside a tuple, set or interval, numbers are compared by
math-verify's own rule (equal after rounding to 6 decimals when one is a decimal), not by
``rel_tol``.

Bounds (math-verify's own timeout uses ``signal.alarm``, which works only in a process's
main thread, and rewards run in worker threads and processes; it is turned off here): an
answer longer than 2000 characters is compared as a string; one longer than 200, or nested
more than 6 brackets deep (the parser's time grows with nesting: ~0.25 s at 6 levels, ~5 s
at 25, measured), or holding a power too large to evaluate (``10^{10^{10}}``), is equal only
to the same prepared string. The scorer's per-call timeout (the reward entry's
``timeout_s``) bounds the rest. :func:`answers_equal` never raises; anything it cannot read
is "not equal".
"""

from __future__ import annotations

import logging
import math
import re
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from rltune.data.records import Prompt
from rltune.rewards.boxed import last_boxed
from rltune.rewards.contract import verifier

if TYPE_CHECKING:
    import sympy

# Longest raw input looked at beyond a string comparison, and longest prepared text (and
# deepest bracket nesting) handed to the parser: parsing and simplifying are not bounded
# in time otherwise.
_MAX_INPUT_CHARS = 2000
_MAX_PARSE_CHARS = 200
_MAX_DEPTH = 6
# Bounds on a power a**b before anything is evaluated: |b| for any base, and the number of
# digits of a**b (|b| * log10|a|) for a numeric base.
_MAX_EXPONENT = 10_000
_MAX_SYMBOLIC_EXPONENT = 1_000
_MAX_POWER_DIGITS = 100_000

_NUMBER_TEXT = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d{1,3})?"
_PLAIN_NUMBER = re.compile(rf"({_NUMBER_TEXT})(?:/({_NUMBER_TEXT}))?")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
# The last number in free text: thousands commas only in groups of three, an optional
# `/denominator`; a `-` right after a word character or a bracket is a binary minus.
_LAST_NUMBER = re.compile(
    r"(?<![\w)\]}])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+(?!\.\d))?|(?<!\d)\.\d+"
)
_ANSWER_MARKER = re.compile(r"answer\s*(?:is\s*:?|:)", re.IGNORECASE)
# A marker followed by a number and words only ("18 dollars.") keeps just the number.
_NUMBER_THEN_WORDS = re.compile(rf"({_LAST_NUMBER.pattern})\s*%?\s+[A-Za-z][A-Za-z\s]*")

# Unicode minus, a braced comma, percent and dollar signs (see the module docstring).
_REPLACED = (("\u2212", "-"), ("{,}", ","), ("\\%", " "), ("%", " "), ("\\$", " "), ("$", " "))
_DIGIT_SPACING = re.compile(r"(?<=\d)(?:\\[,;:! ]|~)+(?=\d)")
_SIZED_DELIMITER = re.compile(r"\\(?:left|right)(?![A-Za-z])")
# A sympy-style name not already a LaTeX command; `oo` is infinity.
_PLAIN_NAMES = re.compile(
    r"(?<![\\A-Za-z])(pi|oo|exp|ln|log|sin|cos|tan|cot|sec|csc|a(?:rc)?(?:sin|cos|tan))"
    r"(?![A-Za-z])"
)
_LATEX_NAMES = {"oo": "\\infty", "asin": "\\arcsin", "acos": "\\arccos", "atan": "\\arctan"}
_LONE_I = re.compile(r"(?<![\\A-Za-z])i(?![A-Za-z])")
# Points at which expressions with variables are compared before simplify is tried.
_PROBES = (0.5772156649, 1.6180339887, 2.7182818284)


@verifier
def math_answer(
    prompt: Prompt,
    completion: str,
    *,
    answer: object = None,
    rel_tol: float = 1e-9,
    **_: object,
) -> float | None:
    """1.0 if the completion's final answer equals the reference answer, else 0.0.

    The reference is ``answer`` (the scorer passes the prompt's ``meta`` as keyword
    arguments; a direct call without it reads ``prompt.meta["answer"]``). The final answer is
    :func:`extract_answer`'s; equality is :func:`answers_equal`'s.

    A completion with no answer in it scores 0.0 (a wrong answer). A prompt without a
    reference answer returns None: the sample is masked out and counted as an error, since
    the data, not the model, is at fault.
    """
    gold = answer if answer is not None else prompt.meta.get("answer")
    if gold is None or isinstance(gold, bool) or str(gold).strip() == "":
        return None
    predicted = extract_answer(completion)
    if predicted is None:
        return 0.0
    return 1.0 if answers_equal(predicted, str(gold), rel_tol=rel_tol) else 0.0


def extract_answer(completion: str) -> str | None:
    """The final answer written in ``completion``, or None when there is none.

    In order of preference: the content of the last closed ``\\boxed{...}``
    (:func:`rltune.rewards.boxed.last_boxed`); the rest of the line after the last
    "answer is" / "Answer:" (a trailing full stop and markdown bold dropped; ``18 dollars``
    gives ``18``); the last number in the text (``-3``, ``1,234.5``, ``3/4``).
    """
    boxed = last_boxed(completion)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    markers = list(_ANSWER_MARKER.finditer(completion))
    if markers:
        line = completion[markers[-1].end():].split("\n", 1)[0]
        line = line.replace("**", "").strip().rstrip(".").strip()
        words = _NUMBER_THEN_WORDS.fullmatch(line.replace("$", "").strip())
        if words:
            return words.group(1)
        if line:
            return line
    numbers = _LAST_NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def answers_equal(pred: str, gold: str, *, rel_tol: float = 1e-9) -> bool:
    """True when ``pred`` and ``gold`` are the same answer (see the module docstring for
    what is prepared and how values are compared). Never raises: an answer that cannot be
    read, or is too large to read safely, is not equal to anything but itself."""
    try:
        if len(pred) > _MAX_INPUT_CHARS or len(gold) > _MAX_INPUT_CHARS:
            return pred.strip() == gold.strip()
        return _equal(prepare(pred), prepare(gold), rel_tol)
    # Model output is arbitrary text: any failure to read it (the parser and sympy raise
    # TypeError, RecursionError, ... on odd input) means the answer does not match.
    except Exception:
        return False


def prepare(answer: str) -> str:
    """``answer`` as handed to math-verify: the changes listed in the module docstring,
    math delimiters around the whole answer removed, spaces collapsed."""
    text = answer.strip()
    for opener, closer in (("\\(", "\\)"), ("\\[", "\\]")):
        if text.startswith(opener) and text.endswith(closer):
            text = text[len(opener) : -len(closer)]
    boxed = last_boxed(text)
    if boxed is not None:
        text = boxed
    for mark, replacement in _REPLACED:
        text = text.replace(mark, replacement)
    text = _DIGIT_SPACING.sub("", _SIZED_DELIMITER.sub("", text))
    text = _PLAIN_NAMES.sub(lambda m: _LATEX_NAMES.get(m[1], "\\" + m[1]), text)
    # The parser's imaginary unit is `I`; braced, or it drops an exponent (`I^2` reads `I`).
    text = _LONE_I.sub("{I}", text)
    text = " ".join(text.split()).rstrip(".").strip()
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    return text


def _equal(pred: str, gold: str, rel_tol: float) -> bool:
    if not pred or not gold:
        return False
    num_pred, num_gold = _plain_number(pred), _plain_number(gold)
    if num_pred is not None and num_gold is not None:
        return _close(num_pred, num_gold, rel_tol)
    if pred.replace(" ", "") == gold.replace(" ", ""):
        return True
    if _list_brackets(pred) != _list_brackets(gold):
        return False
    expr_pred = _read(pred)
    expr_gold = None if expr_pred is None else _read(gold)
    if expr_pred is None or expr_gold is None:
        return False
    return _values_equal(expr_gold, expr_pred, rel_tol)


def _close(x: Any, y: Any, rel_tol: float) -> bool:
    """|x - y| <= rel_tol * max(|x|, |y|): exact for Fractions, and for sympy numbers (real
    or complex) at their precision."""
    return x == y or abs(x - y) <= rel_tol * max(abs(x), abs(y))


def _plain_number(text: str) -> Fraction | None:
    match = _PLAIN_NUMBER.fullmatch(text.replace(" ", ""))
    if match is None:
        return None
    numerator, denominator = match.groups()
    value = Fraction(numerator)
    if denominator is not None:
        if Fraction(denominator) == 0:
            return None
        value /= Fraction(denominator)
    return value


def _list_brackets(text: str) -> str | None:
    """The outer brackets of a list of answers (``"()"``, ``"[)"``, ``""`` for a bare
    list), or None when ``text`` has no comma outside brackets."""
    brackets = ""
    inner = text
    if text[0] in "([" and text[-1] in ")]" and _depths(text)[:-1].count(0) == 0:
        brackets, inner = text[0] + text[-1], text[1:-1]
    depths = _depths(inner)
    if not any(char == "," and depth == 0 for char, depth in zip(inner, depths)):
        return None
    return brackets


def _depths(text: str) -> list[int]:
    """The bracket depth after each character of ``text`` (``([{`` open, ``)]}`` close)."""
    depth, out = 0, []
    for char in text:
        depth += (char in "([{") - (char in ")]}")
        out.append(depth)
    return out


def _read(text: str) -> Any:
    """``text`` as math-verify's parser reads it (a sympy object), or None when it is out of
    bounds or does not parse. The library's signal timeout is off (``parsing_timeout=None``):
    it would fail in worker threads."""
    if len(text) > _MAX_PARSE_CHARS or max(_depths(text), default=0) > _MAX_DEPTH:
        return None
    from math_verify import LatexExtractionConfig, parse

    _quiet_timeout_notice()
    found = parse(
        "\\boxed{" + text + "}",
        extraction_config=[LatexExtractionConfig(boxed_match_priority=0)],
        fallback_mode="no_fallback",
        parsing_timeout=None,  # type: ignore[arg-type]  # None turns the alarm off
    )
    if not found or not _powers_in_bounds(found[0]):
        return None
    return found[0]


def _values_equal(gold: Any, pred: Any, rel_tol: float) -> bool:
    import sympy
    from math_verify import verify

    numbers = [isinstance(x, sympy.Expr) and x.is_number for x in (gold, pred)]
    if all(numbers):
        return _numbers_close(gold, pred, rel_tol)
    if _probes_differ(gold, pred, rel_tol):
        return False
    return bool(verify(gold, pred, timeout_seconds=None))


def _probes_differ(gold: Any, pred: Any, rel_tol: float) -> bool:
    """True when two expressions with variables take different values at a probe point.
    Not tried on a lone symbol (math-verify reads ``\\text{yes}`` as ``y*e*s``)."""
    import sympy

    expressions = [isinstance(x, sympy.Expr) and not isinstance(x, sympy.Symbol) for x in (gold, pred)]
    if not all(expressions):
        return False
    variables = sorted(gold.free_symbols | pred.free_symbols, key=str)
    if not variables:
        return False
    # Each probe gives every variable a different value, so `x - y` is not probed at x == y.
    for offset in range(len(_PROBES)):
        point = {v: _PROBES[(offset + k) % len(_PROBES)] + k for k, v in enumerate(variables)}
        if not _numbers_close(gold.subs(point), pred.subs(point), max(rel_tol, 1e-9)):
            return True
    return False


def _powers_in_bounds(expr: Any) -> bool:
    """False when a power is too large to evaluate: ``a**b`` (or ``exp(b)``) with
    ``|b| > 10^4``, or ``> 1000`` for a base with variables (which simplify may expand), or
    with more than 10^5 digits for a numeric base. Inner powers are checked before outer
    ones, so the numeric values taken here are of bounded size."""
    import sympy

    for node in sympy.postorder_traversal(expr):
        if isinstance(node, sympy.exp):
            base, exponent_expr = sympy.E, node.args[0]
        elif isinstance(node, sympy.Pow):
            base, exponent_expr = node.base, node.exp
        else:
            continue
        if exponent_expr.free_symbols:
            continue
        exponent = abs(complex(sympy.N(exponent_expr, 15)))
        limit = _MAX_SYMBOLIC_EXPONENT if base.free_symbols else _MAX_EXPONENT
        if not math.isfinite(exponent) or exponent > limit:
            return False
        if base.free_symbols:
            continue
        magnitude = abs(complex(sympy.N(base, 15)))
        if magnitude != 0 and exponent * abs(math.log10(magnitude)) > _MAX_POWER_DIGITS:
            return False
    return True


def _numbers_close(a: sympy.Expr, b: sympy.Expr, rel_tol: float) -> bool:
    import sympy

    value_a, value_b = sympy.N(a, 30), sympy.N(b, 30)
    if not (value_a.is_number and value_b.is_number):
        return False
    if value_a.has(sympy.zoo, sympy.nan) or value_b.has(sympy.zoo, sympy.nan):
        return False
    if value_a.has(sympy.oo, -sympy.oo) or value_b.has(sympy.oo, -sympy.oo):
        return bool(value_a == value_b)
    # Compared as 30-digit sympy numbers, not Python floats: 10^500 would overflow to inf,
    # and inf would then be "close" to any other overflowing value.
    return bool(_close(value_a, value_b, rel_tol))


class _DropTimeoutNotice(logging.Filter):
    """math-verify warns once that its timeout is off and the caller must bound time; here
    the input bounds and the scorer's per-call timeout do, so the notice is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


def _quiet_timeout_notice() -> None:
    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTimeoutNotice) for f in logger.filters):
            logger.addFilter(_DropTimeoutNotice())
