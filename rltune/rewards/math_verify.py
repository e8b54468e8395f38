"""Maths answers: find the final answer in a completion and decide whether two answers are
the same value, not the same string.

``answers_equal`` runs three tests, cheapest first, on both sides after :func:`normalize`:

1. the normalised strings are equal;
2. both are plain numbers (``-1,234.5``, ``.5``, ``3/4``, ``1e-3``): compared as exact
   fractions, equal when ``|a - b| <= rel_tol * max(|a|, |b|)``;
3. both parse as sympy expressions: numbers (``2\\sqrt{2}``, ``\\frac{\\pi}{2}``) are
   evaluated to 30 digits and compared with the same relative tolerance; expressions with
   variables are first probed at a few fixed points and then checked with
   ``simplify(a - b) == 0``.

What normalising strips or rewrites (both sides alike):

- math delimiters and dollar signs: ``$...$``, ``\\(...\\)``, ``\\[...\\]``, ``\\$``;
  a ``\\boxed{...}`` around the whole answer;
- ``\\left`` / ``\\right``, ``\\displaystyle``, LaTeX spacing (``\\,`` ``\\;`` ``\\!`` ``~``
  ``\\quad``), so ``1\\,234`` reads as ``1234``;
- degree marks (``^\\circ``, ``^{\\circ}``, ``°``): ``90^\\circ`` equals ``90``;
- percent signs (``%``, ``\\%``), *without* rescaling: ``50\\%`` equals ``50`` and ``50%``
  but not ``0.5``. A percent answer is compared as the number that was written, because a
  question asking "what percent" is answered as ``50`` as often as ``50%``, while turning
  ``50%`` into ``0.5`` would also make ``0.5`` a right answer to it;
- trailing units in a text command (``5\\text{ cm}``, ``\\mbox{}``, ``\\mathrm{}``) when
  something is left before them; a whole answer in ``\\text{...}`` is unwrapped;
- a leading ``x =`` (one name and an equals sign);
- thousands commas, only when the whole answer is one number grouped in threes
  (``1,234``, ``-12,345.6``): ``1,2`` is the pair ``(1, 2)``, not twelve.

Answers with top-level commas are tuples, intervals or lists, compared element by element in
order; the brackets must match (``(1, 2)`` is not ``[1, 2)`` nor the bare list ``1, 2``).

In sympy expressions ``e`` is Euler's number and ``i`` the imaginary unit; other single
letters are variables. A name of several letters that is not a known function or constant
(``sqrt``, ``pi``, ``log``, ``sin``, ...) stops the sympy test, as does anything longer than
200 characters, a character outside digits, letters, ``+-*/^().`` and spaces, or a power
whose size is out of bounds (``10^10^10``): the answers are then equal only if their
normalised strings are. :func:`answers_equal` never raises; anything it cannot read is
"not equal".
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from rltune.data.records import Prompt
from rltune.rewards.contract import verifier

if TYPE_CHECKING:
    import sympy

_BOXED = "\\boxed"
# Longest normalised text handed to sympy, and longest raw input looked at beyond a
# string comparison: parsing and simplifying are not bounded in time otherwise.
_MAX_SYMPY_CHARS = 200
_MAX_INPUT_CHARS = 2000
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
_LEADING_ASSIGNMENT = re.compile(r"^[A-Za-z]\w*\s*=(?!=)\s*")

_DROPPED = (
    "\\left", "\\right", "\\displaystyle", "\\qquad", "\\quad", "\\,", "\\;", "\\:", "\\!",
    "\\ ", "~", "^{\\circ}", "^\\circ", "\\circ", "\\degree", "°", "\\%", "%", "\\$", "$",
)
_TEXT_COMMANDS = (
    "\\text", "\\textbf", "\\textrm", "\\mathrm", "\\mathbf", "\\mbox", "\\operatorname",
)
_SYMBOL_COMMANDS = {
    "pi": " pi ", "infty": " oo ", "cdot": "*", "times": "*", "div": "/",
    "ln": " ln ", "log": " log ", "exp": " exp ", "sin": " sin ", "cos": " cos ",
    "tan": " tan ", "cot": " cot ", "sec": " sec ", "csc": " csc ",
    "arcsin": " asin ", "arccos": " acos ", "arctan": " atan ",
}
_SYMPY_NAMES = frozenset(
    {"sqrt", "pi", "oo", "ln", "log", "exp", "sin", "cos", "tan", "cot", "sec", "csc",
     "asin", "acos", "atan"}
)
_COMMAND = re.compile(r"\\([A-Za-z]+)")
_SYMPY_CHARS = re.compile(r"[0-9A-Za-z+\-*/^(). ]*")
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

    In order of preference: the content of the last closed ``\\boxed{...}`` (nested braces
    kept whole); the rest of the line after the last "answer is" / "Answer:" (a trailing
    full stop and markdown bold dropped; ``18 dollars`` gives ``18``); the last number in
    the text (``-3``, ``1,234.5``, ``3/4``).
    """
    boxed = _last_boxed(completion)
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
    what is normalised and how values are compared). Never raises: an answer that cannot
    be read, or is too large to read safely, is not equal to anything but itself."""
    try:
        if len(pred) > _MAX_INPUT_CHARS or len(gold) > _MAX_INPUT_CHARS:
            return pred.strip() == gold.strip()
        return _equal(normalize(pred), normalize(gold), rel_tol)
    # Model output is arbitrary text: any failure to read it (sympy raises TypeError,
    # SyntaxError, RecursionError, ... on odd input) means the answer does not match.
    except Exception:
        return False


def normalize(answer: str) -> str:
    """``answer`` as plain text: LaTeX wrappers, units and marks removed, ``\\frac``,
    ``\\sqrt`` and named constants rewritten (``\\frac{1}{2}`` -> ``((1)/(2))``), spaces
    collapsed."""
    text = answer.strip()
    for opener, closer in (("\\(", "\\)"), ("\\[", "\\]")):
        if text.startswith(opener) and text.endswith(closer):
            text = text[len(opener) : -len(closer)]
    boxed = _last_boxed(text)
    if boxed is not None:
        text = boxed
    text = text.replace("\u2212", "-").replace("{,}", ",")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for token in _DROPPED:
        text = text.replace(token, " ")
    text = _strip_text_commands(text.strip())
    text = _LEADING_ASSIGNMENT.sub("", text.strip())
    text = _latex_to_plain(text)
    text = " ".join(text.split()).rstrip(".").strip()
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    return text


def _equal(a: str, b: str, rel_tol: float) -> bool:
    if not a or not b:
        return False
    parts_a, parts_b = _split_tuple(a), _split_tuple(b)
    if parts_a is None and parts_b is None:
        return _scalar_equal(a, b, rel_tol)
    if parts_a is None or parts_b is None:
        return False
    (open_a, items_a, close_a), (open_b, items_b, close_b) = parts_a, parts_b
    return (
        (open_a, close_a) == (open_b, close_b)
        and len(items_a) == len(items_b)
        and all(_scalar_equal(x, y, rel_tol) for x, y in zip(items_a, items_b))
    )


def _scalar_equal(a: str, b: str, rel_tol: float) -> bool:
    if a.replace(" ", "") == b.replace(" ", ""):
        return True
    num_a, num_b = _plain_number(a), _plain_number(b)
    if num_a is not None and num_b is not None:
        return _close(num_a, num_b, rel_tol)
    expr_a, expr_b = _to_sympy(a), _to_sympy(b)
    if expr_a is None or expr_b is None:
        return False
    return _sympy_equal(expr_a, expr_b, rel_tol)


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


def _split_tuple(text: str) -> tuple[str, list[str], str] | None:
    """``(opening bracket, elements, closing bracket)`` when ``text`` has a comma outside
    brackets once its outer pair (if any) is removed; brackets are "" for a bare list."""
    opener = closer = ""
    inner = text
    if text[0] in "([" and text[-1] in ")]" and _closing_index(text) == len(text) - 1:
        opener, inner, closer = text[0], text[1:-1], text[-1]
    items, depth, start = [], 0, 0
    for index, char in enumerate(inner):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(inner[start:index].strip())
            start = index + 1
    if not items:
        return None
    items.append(inner[start:].strip())
    return opener, items, closer


def _closing_index(text: str) -> int:
    """Index of the bracket that closes ``text[0]`` (any of ``)]``), or -1."""
    depth = 0
    for index, char in enumerate(text):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 0:
                return index
    return -1


def _last_boxed(text: str) -> str | None:
    """Content of the last closed ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind(_BOXED)
    while start >= 0:
        group = _read_group(text, start + len(_BOXED))
        if group is not None and text[start + len(_BOXED) :].lstrip().startswith("{"):
            return group[0]
        start = text.rfind(_BOXED, 0, start)
    return None


def _read_group(text: str, index: int) -> tuple[str, int] | None:
    """A LaTeX argument at ``text[index:]``: a ``{...}`` group (balanced), else one
    character or one ``\\command``. Returns ``(content, index after it)``, None at the end
    of the text or on an unclosed group."""
    while index < len(text) and text[index] == " ":
        index += 1
    if index >= len(text):
        return None
    if text[index] == "\\":
        match = _COMMAND.match(text, index)
        end = match.end() if match else index + 2
        return text[index:end], end
    if text[index] != "{":
        return text[index], index + 1
    depth = 0
    for end in range(index, len(text)):
        if text[end] == "{":
            depth += 1
        elif text[end] == "}":
            depth -= 1
            if depth == 0:
                return text[index + 1 : end], end + 1
    return None


def _strip_text_commands(text: str) -> str:
    """Drop text commands (units) that end the answer after something else; unwrap an
    answer that is wholly one text command."""
    while True:
        found = _trailing_text_command(text)
        if found is None:
            return text
        position, content = found
        before = text[:position].strip()
        if not before:
            return content.strip()
        text = before


def _trailing_text_command(text: str) -> tuple[int, str] | None:
    """``(start, content)`` of a ``\\text{...}``-like command that ends ``text``, or None."""
    for command in _TEXT_COMMANDS:
        position = text.rfind(command + "{")
        if position < 0:
            continue
        group = _read_group(text, position + len(command))
        if group is not None and not text[group[1] :].strip():
            return position, group[0]
    return None


def _latex_to_plain(text: str) -> str:
    """Rewrite ``\\frac``, ``\\sqrt``, text commands, named constants and functions, and
    braces into the plain syntax sympy reads. Unknown commands are kept as written."""
    out: list[str] = []
    index = 0
    while index < len(text):
        char = text[index]
        if char != "\\":
            out.append({"{": "(", "}": ")"}.get(char, char))
            index += 1
            continue
        match = _COMMAND.match(text, index)
        if match is None:  # an escaped symbol such as `\{`
            out.append(text[index + 1 : index + 2])
            index += 2
            continue
        name, index = match.group(1), match.end()
        if name == "frac":
            numerator = _read_group(text, index)
            denominator = _read_group(text, numerator[1]) if numerator else None
            if numerator is None or denominator is None:
                raise ValueError(f"\\frac without two arguments in {text!r}")
            out.append(
                f"(({_latex_to_plain(numerator[0])})/({_latex_to_plain(denominator[0])}))"
            )
            index = denominator[1]
        elif name == "sqrt":
            degree = None
            if text.startswith("[", index) and "]" in text[index:]:
                close = text.index("]", index)
                degree, index = _latex_to_plain(text[index + 1 : close]), close + 1
            radicand = _read_group(text, index)
            if radicand is None:
                raise ValueError(f"\\sqrt without an argument in {text!r}")
            inner, index = _latex_to_plain(radicand[0]), radicand[1]
            out.append(f" sqrt({inner})" if degree is None else f"(({inner})^(1/({degree})))")
        elif "\\" + name in _TEXT_COMMANDS:
            group = _read_group(text, index)
            if group is not None:
                out.append(_latex_to_plain(group[0]))
                index = group[1]
        else:
            out.append(_SYMBOL_COMMANDS.get(name, "\\" + name))
    return "".join(out)


def _to_sympy(text: str) -> sympy.Expr | None:
    """``text`` parsed by sympy without evaluating, or None when it is out of bounds or
    does not parse. ``text`` is restricted to arithmetic, known names and single letters
    before sympy (which evaluates the parsed text as Python) sees it."""
    if len(text) > _MAX_SYMPY_CHARS or not _SYMPY_CHARS.fullmatch(text):
        return None
    # `2x`, `x2`, `sqrt2`: digits and letters are separate tokens (implicit products).
    text = re.sub(r"(?<=[A-Za-z])(?=\d)|(?<=\d)(?=[A-Za-z])", " ", text)
    names = set(re.findall(r"[A-Za-z]+", text))
    if any(len(name) > 1 and name not in _SYMPY_NAMES for name in names):
        return None

    import sympy
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication,
        parse_expr,
        standard_transformations,
    )

    local = {name: sympy.Symbol(name) for name in names if len(name) == 1}
    local.update(
        {"e": sympy.E, "i": sympy.I, "pi": sympy.pi, "oo": sympy.oo, "sqrt": sympy.sqrt,
         "ln": sympy.log, "log": sympy.log, "exp": sympy.exp, "sin": sympy.sin,
         "cos": sympy.cos, "tan": sympy.tan, "cot": sympy.cot, "sec": sympy.sec,
         "csc": sympy.csc, "asin": sympy.asin, "acos": sympy.acos, "atan": sympy.atan}
    )
    transformations = standard_transformations + (implicit_multiplication, convert_xor)
    expr = parse_expr(text, local_dict=local, transformations=transformations, evaluate=False)
    if not isinstance(expr, sympy.Expr) or not _powers_in_bounds(expr):
        return None
    return expr


def _powers_in_bounds(expr: sympy.Expr) -> bool:
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


def _sympy_equal(a: sympy.Expr, b: sympy.Expr, rel_tol: float) -> bool:
    import sympy

    variables = sorted(a.free_symbols | b.free_symbols, key=str)
    if not variables:
        return _numbers_close(a, b, rel_tol)
    # Each probe gives every variable a different value, so `x - y` is not probed at x == y.
    for offset in range(len(_PROBES)):
        point = {v: _PROBES[(offset + k) % len(_PROBES)] + k for k, v in enumerate(variables)}
        value_a, value_b = a.subs(point), b.subs(point)
        if not _numbers_close(value_a, value_b, max(rel_tol, 1e-9)):
            return False
    return sympy.simplify(a - b) == 0


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
