"""Maths-answer extraction and equivalence against hand-worked cases."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import math_verify.grader as math_verify_grader
import pytest
import sympy

from rltune.data.records import Prompt
from rltune.rewards import builtin, math_verify
from rltune.rewards.loading import load_reward_fn
from rltune.rewards.math_verify import answers_equal, extract_answer, math_answer

EQUIVALENCE_CASES = [
    # integers, decimals, signs
    ("42", "42", True),
    ("42", "43", False),
    ("0.5", ".50", True),
    ("3.0", "3", True),
    ("3.0001", "3", False),
    ("-3", "-3.0", True),
    ("+3", "3", True),
    ("-3", "3", False),
    ("\u22123", "-3", True),  # unicode minus
    ("1e3", "1000", True),
    # thousands separators: groups of three only
    ("1,234", "1234", True),
    ("1,234.5", "1234.5", True),
    ("-12,345", "-12345", True),
    ("1{,}234", "1234", True),
    ("1\\,234", "1234", True),
    ("1,2", "12", False),
    ("12,34", "1234", False),
    ("1,234", "1235", False),
    # fractions vs decimals
    ("0.5", "1/2", True),
    ("0.51", "1/2", False),
    ("\\frac{1}{2}", "0.5", True),
    ("\\dfrac12", "1/2", True),
    ("\\tfrac{1}{2}", "0.5", True),
    ("\\frac{1}{2}", "\\frac{2}{4}", True),
    ("\\frac{1}{3}", "0.333", False),
    ("\\frac{1}{3}", "0.3333333333", True),  # within rel_tol 1e-9
    ("3/4", "0.75", True),
    ("-\\frac{3}{4}", "-0.75", True),
    ("\\frac{3}{4}", "-0.75", False),
    ("1/0", "1", False),
    # percentages: the % is dropped, the number is not rescaled
    ("50\\%", "50", True),
    ("50%", "50\\%", True),
    ("50%", "0.5", False),
    ("0.5", "50\\%", False),
    # LaTeX wrappers, degrees, units
    ("$\\frac{3}{4}$", "0.75", True),
    ("\\(7\\)", "7", True),
    ("\\[7\\]", "7", True),
    ("\\$18", "18", True),
    ("\\boxed{5}", "5", True),
    ("90^\\circ", "90", True),
    ("90^{\\circ}", "90", True),
    ("90^\\circ", "45", False),
    ("5\\text{ cm}", "5", True),
    # math-verify drops a known unit with its power: "5 square centimetres" is the answer 5
    # (the sympy reader kept `cm^2`, since it was not the trailing text command)
    ("5 \\text{cm}^2", "5", True),
    ("12\\mbox{ apples}", "12", True),
    ("\\text{yes}", "yes", True),
    ("\\text{yes}", "no", False),
    ("x = 5", "5", True),
    ("x = 5", "6", False),
    # roots, pi, constants
    ("\\sqrt{2}", "sqrt(2)", True),
    ("\\sqrt2", "sqrt(2)", True),
    ("\\sqrt{2}", "1.41421356237", True),
    ("\\sqrt{2}", "1.414", False),
    ("\\sqrt{3}", "sqrt(2)", False),
    ("\\sqrt[3]{8}", "2", True),
    ("2\\sqrt{2}", "sqrt(8)", True),
    ("\\frac{1}{\\sqrt{2}}", "sqrt(2)/2", True),
    ("2\\pi", "2*pi", True),
    ("2\\pi", "2 pi", True),
    ("2\\pi", "6.28318530718", True),
    ("2\\pi", "3*pi", False),
    ("\\frac{\\pi}{2}", "pi/2", True),
    ("\\infty", "oo", True),
    ("3+2i", "3+2*i", True),
    ("e^2", "exp(2)", True),
    ("2^{10}", "1024", True),
    ("10^{500}", "10^{500}+1", True),  # relative tolerance, no float overflow
    ("10^{500}", "2*10^{500}", False),
    # symbolic equality
    ("2x+2", "2(x+1)", True),
    ("x^2-1", "(x-1)(x+1)", True),
    ("x^2", "x^3", False),
    ("\\sin^2 x", "1", False),
    ("a+b", "b+a", True),
    ("a-b", "b-a", False),
    # tuples and intervals, element by element, in order
    ("(1, 2)", "(1,2)", True),
    ("\\left( 1, 2 \\right)", "(1,2)", True),
    ("(\\frac{1}{2}, 3)", "(0.5, 3)", True),
    ("(1, 2)", "(2, 1)", False),
    ("(1, 2)", "[1, 2)", False),
    ("[1, 2)", "[1, 2)", True),
    ("(1, 2)", "(1, 2, 3)", False),
    ("1, 2", "1,2", True),
    ("(1, 2)", "1, 2", False),
    # unreadable or empty answers
    ("", "", False),
    ("", "0", False),
    ("__import__('os').getcwd()", "1", False),
    ("\\frac{1}", "1", False),
    # read by math-verify (the sympy reader before it refused all of these)
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix} 1.0 \\\\ 2 \\end{pmatrix}", True),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix} 2 \\\\ 1 \\end{pmatrix}", False),
    ("(-\\infty, 1) \\cup (2, \\infty)", "(2, \\infty) \\cup (-\\infty, 1)", True),
    ("(-\\infty, 1) \\cup (2, \\infty)", "(-\\infty, 1] \\cup (2, \\infty)", False),
    ("\\binom{5}{2}", "10", True),
    ("5!", "120", True),
    ("\\log_2 8", "3", True),
    ("x \\le 3", "3 \\ge x", True),
    ("x \\le 3", "x < 3", False),
    ("3:4", "0.75", True),  # a ratio is a quotient
    ("\\{3\\}", "3", True),  # a one-element set is its element
    ("\\{1, 2\\}", "\\{2, 1\\}", True),
    ("x = 3", "y = 3", False),  # two assignments keep their variables
    ("i^2", "-1", True),  # `i` is the imaginary unit, and keeps its exponent
    ("\\$1,234.50", "1234.5", True),
]


@pytest.mark.parametrize(("pred", "gold", "expected"), EQUIVALENCE_CASES)
def test_answers_equal_hand_cases(pred: str, gold: str, expected: bool) -> None:
    assert answers_equal(pred, gold) is expected
    assert answers_equal(gold, pred) is expected  # symmetric


def test_rel_tol_is_respected() -> None:
    assert answers_equal("1.000001", "1", rel_tol=1e-5)
    assert not answers_equal("1.000001", "1", rel_tol=1e-7)
    assert not answers_equal("\\frac{1}{3}", "0.3333333333", rel_tol=0.0)
    assert answers_equal("\\frac{1}{3}", "2/6", rel_tol=0.0)  # exact fractions


@pytest.mark.parametrize(
    "pathological",
    [
        "10^10^10",
        "10^{10^{10}}",
        "(10^{200})^{10000}",
        "exp(exp(exp(9)))",
        "(x+1)^{9999}",
        "(x+1)^{999}",  # within bounds: the probes reject it before simplify (~7 s) runs
        "9" * 5000,
        "(" * 150 + "1" + ")" * 150,
        "\\frac{" * 60 + "1" + "}{2}" * 60,
        "x" + "+x" * 150,
        # short, but nested deeper than the parser is allowed: math-verify's ANTLR parser
        # takes ~5 s on 25 parentheses and ~8 s on 99 (measured), so these must not reach it
        "(" * 25 + "1" + ")" * 25,
        "(" * 99 + "1" + ")" * 99,
        "x^{" * 30 + "2" + "}" * 30,
    ],
)
def test_pathological_inputs_are_refused_quickly(pathological: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Not timed: the first call's imports (~0.4 s), and the parser's first reading of
    # powers and functions (its ANTLR parser builds its lookahead tables as it meets new
    # shapes: up to 0.6 s cold, measured)
    assert answers_equal("\\exp(\\exp(x)) + (10^{2})^{3}", "\\exp(\\exp(x)) + 10^6")
    simplified = []
    record = lambda *args, **kwargs: simplified.append(args)  # noqa: E731
    monkeypatch.setattr(sympy, "simplify", record)
    monkeypatch.setattr(math_verify_grader, "simplify", record)  # the name verify() calls
    start = time.perf_counter()
    assert not answers_equal(pathological, "x^{999} + 1")
    elapsed = time.perf_counter() - start
    # refused by the bounds before anything unbounded runs: never simplify (~7 s for
    # (x+1)^{999}), never an exact power like 10^(10^10) (which would not finish), never
    # the parser on deep nesting (5..8 s); these take at most 0.15 s once warm (0.1 ms
    # ..140 ms measured), seven times under 1 s
    assert simplified == []
    assert elapsed < 1.0



def test_deep_nesting_never_reaches_the_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    import math_verify as library

    parsed: list[str] = []
    real_parse = library.parse
    monkeypatch.setattr(library, "parse", lambda text, **kw: parsed.append(text) or real_parse(text, **kw))
    six_deep = "(" * 6 + "1" + ")" * 6  # the deepest the parser is given (~0.25 s warm)
    assert answers_equal(six_deep, "1.0")
    assert parsed == ["\\boxed{" + six_deep + "}", "\\boxed{1.0}"]
    parsed.clear()
    assert not answers_equal("(" * 7 + "1" + ")" * 7, "1.0")
    assert not answers_equal("\\sqrt{" * 7 + "2" + "}" * 7, "2^{1/128}")  # equal values
    assert parsed == []  # the answer is refused first, so the reference is not read either

@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("so \\boxed{\\frac{3}{4}}.", "\\frac{3}{4}"),
        ("\\boxed{1} then \\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),  # nested
        ("\\boxed{7} ... 9", "7"),  # the box wins over a later number
        ("\\boxed{(1, 2)} ok", "(1, 2)"),
        ("\\boxed{3} and an unclosed \\boxed{4", "3"),  # the last *closed* box
        ("unclosed \\boxed{4 and 5", "5"),
        ("The answer is 18 dollars.", "18"),
        ("Answer: $\\frac{1}{2}$.", "$\\frac{1}{2}$"),
        ("the answer is: **-4**\nchecked 3 times", "-4"),
        ("First 82, then 81", "81"),
        ("Total 1,234.5", "1,234.5"),
        ("so 3/4", "3/4"),
        ("x=3 and y=-4", "-4"),
        ("10-3", "3"),  # binary minus
        ("value .5", ".5"),
        ("I don't know", None),
        ("", None),
    ],
)
def test_extract_answer(completion: str, expected: str | None) -> None:
    assert extract_answer(completion) == expected


def _prompt(**meta: object) -> Prompt:
    return Prompt(id="row-3", text="Compute 3/4.", meta=dict(meta))


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("so \\boxed{\\frac{3}{4}}", "0.75", 1.0),
        ("so \\boxed{\\frac{3}{4}}", "3/4", 1.0),
        ("so \\boxed{\\frac{3}{5}}", "3/4", 0.0),
        ("The answer is 0.75", 0.75, 1.0),  # a numeric reference answer
        ("The answer is 1,234", 1234, 1.0),
        ("The answer is 7", "\\boxed{7}", 1.0),
        ("no answer here", "3/4", 0.0),  # nothing answer-like: wrong, not an error
        ("", "3/4", 0.0),
    ],
)
def test_math_answer_scores(completion: str, answer: object, expected: float) -> None:
    assert math_answer(_prompt(), completion, answer=answer) == expected
    # A direct call without the keyword reads the prompt's meta.
    assert math_answer(_prompt(answer=answer), completion) == expected


@pytest.mark.parametrize("answer", [None, "", "  ", True])
def test_math_answer_without_reference_is_not_scored(answer: object) -> None:
    assert math_answer(_prompt(), "\\boxed{1}", answer=answer) is None
    assert math_answer(_prompt(), "\\boxed{1}") is None


def test_math_answer_keyword_overrides_meta_and_passes_rel_tol() -> None:
    prompt = _prompt(answer="5")
    assert math_answer(prompt, "\\boxed{6}", answer="6") == 1.0
    assert math_answer(prompt, "\\boxed{1.0001}", answer="1", rel_tol=1e-3) == 1.0
    assert math_answer(prompt, "\\boxed{1.0001}", answer="1") == 0.0


def test_builtin_math_answer_loads_through_the_loader() -> None:
    fn = load_reward_fn("builtin:math_answer")
    assert fn is math_verify.math_answer is builtin.math_answer
    assert load_reward_fn("rltune.rewards.builtin:math_answer") is fn
    # As the scorer calls it: the prompt's meta merged with the config's kwargs.
    prompt = _prompt(answer="\\frac{1}{2}", source="math")
    assert fn(prompt, "thus \\boxed{0.5}", **prompt.meta) == 1.0
    assert fn(prompt, "thus \\boxed{0.6}", **prompt.meta) == 0.0


def test_math_answer_scores_in_worker_threads() -> None:
    # Rewards run in worker threads. math-verify's own timeout calls signal.alarm, which
    # raises outside the main thread: were it on, every answer read by the library would
    # fail to parse and score 0.0 here.
    # The parser reads every case here; the last two are compared by math-verify's verify().
    cases = [
        ("\\boxed{0.75}", "\\frac{3}{4}", 1.0),
        ("\\boxed{\\dfrac{6}{8}}", "\\frac{3}{4}", 1.0),
        ("\\boxed{0.7}", "\\frac{3}{4}", 0.0),
        ("so \\boxed{(\\frac{1}{2}, 3)}", "(0.5, 3)", 1.0),
        ("so \\boxed{x \\le 3}", "3 \\ge x", 1.0),
    ] * 3
    with ThreadPoolExecutor(max_workers=4) as pool:
        scores = list(pool.map(lambda case: math_answer(_prompt(), case[0], answer=case[1]), cases))
    assert scores == [expected for _, _, expected in cases]
