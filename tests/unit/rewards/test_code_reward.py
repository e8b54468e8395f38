"""code_tests: code extraction, pass rates against hand-counted verdicts, and which
failures are scores (the program's) and which are errors (the tests' or the harness's)."""

from __future__ import annotations

import textwrap

import pytest

from rltune.data.records import Prompt
from rltune.rewards.code import code_tests, extract_code
from rltune.rewards.loading import load_reward_fn
from rltune.sandbox import SandboxError

PROMPT = Prompt(id="code-3", text="Write add(a, b).")
ADD = "def add(a, b):\n    return a + b\n"


def fenced(code: str, tag: str = "python") -> str:
    return f"Here you go:\n```{tag}\n{code}```\nDone."


# --------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(("completion", "expected"), [
    ("```python\nA\n```", "A\n"),
    ("```python\nA\n```\ntext\n```python\nB\n```", "B\n"),  # the last python block
    ("```python\nA\n```\n```text\nout\n```", "A\n"),  # python beats a later other block
    ("```py\nA\n```", "A\n"),
    ("```Python3 title\nA\n```", "A\n"),
    ("```\nA\n```\n```bash\nB\n```", "B\n"),  # no python block: the last block
    ("def f(): pass", "def f(): pass"),  # no fence: all of it
    ("sure:\n```python\ndef f():\n    return 1", "def f():\n    return 1"),  # cut off
    ("```text\nA\n```\n```python\nB", "B"),  # an unclosed python block is still python
    ("  ```python\n  indented\n  ```", "  indented\n"),
    ("inline ```python x``` only", "inline ```python x``` only"),  # not a fence line
])
def test_extract_code(completion: str, expected: str) -> None:
    assert extract_code(completion) == expected


# --------------------------------------------------------------------------- scores


def test_pass_rate_counts_tests() -> None:
    wrong_on_negatives = "def add(a, b):\n    return abs(a) + abs(b)\n"
    tests = ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(-1, 1) == 0",
             "assert add(10, 5) == 15"]
    assert code_tests(PROMPT, fenced(ADD), tests=tests) == 1.0
    assert code_tests(PROMPT, fenced(wrong_on_negatives), tests=tests) == 0.75
    # Returning 0 is right for add(0, 0) and add(-1, 1): 2 of 4.
    assert code_tests(PROMPT, fenced("def add(a, b):\n    return 0\n"), tests=tests) == 0.5


def test_test_module_with_pytest_helpers_classes_and_generators() -> None:
    solution = textwrap.dedent("""
        from collections import OrderedDict

        LIMIT = 2

        class LRU:
            def __init__(self, size):
                self.size, self.data = size, OrderedDict()
            def put(self, key, value):
                self.data[key] = value
                self.data.move_to_end(key)
                if len(self.data) > self.size:
                    self.data.popitem(last=False)
            def get(self, key):
                if key not in self.data:
                    raise KeyError(key)
                self.data.move_to_end(key)
                return self.data[key]
            def __len__(self):
                return len(self.data)

        def squares(n):
            for i in range(n):
                yield i * i

        def sort_in_place(items):
            items.sort()

        def parse(text):
            if not text:
                raise ValueError("empty")
            return {"n": int(text), "parts": (text, 1.5), "tags": {1, 2}}

        if __name__ == "__main__":
            raise SystemExit("not run: the solution is imported as a module")
    """)
    tests = textwrap.dedent("""
        import pytest
        from solution import LRU, squares

        def make(size=LIMIT):
            return LRU(size)

        def test_cache_evicts():
            cache = make()
            cache.put("a", 1); cache.put("b", 2); cache.get("a"); cache.put("c", 3)
            assert len(cache) == 2
            with pytest.raises(KeyError):
                cache.get("b")
            assert cache.get("a") == 1

        def test_generator():
            assert list(squares(4)) == [0, 1, 4, 9]
            assert 9 in squares(4)

        def test_mutation_reaches_the_test():
            items = [3, 1, 2]
            sort_in_place(items)
            assert items == [1, 2, 3]

        def test_exact_types():
            out = parse("7")
            assert out == {"n": 7, "parts": ("7", 1.5), "tags": {1, 2}}
            assert type(out["parts"]) is tuple and type(out["n"]) is int
            assert parse("8") != {"n": 8, "parts": ["8", 1.5], "tags": {1, 2}}  # list != tuple

        def test_errors_keep_their_type():
            with pytest.raises(ValueError, match="empty"):
                parse("")

        def test_wrong_on_purpose():
            assert parse("1")["n"] == 2
    """)
    assert code_tests(PROMPT, fenced(solution), tests=tests) == pytest.approx(5 / 6)


def test_humaneval_style_check_function() -> None:
    tests = textwrap.dedent("""
        def check(candidate):
            assert candidate(2, 3) == 5
            assert candidate(-2, 2) == 0

        def test_check():
            check(add)
    """)
    assert code_tests(PROMPT, fenced(ADD), tests=tests) == 1.0


def test_functions_named_like_stdlib_modules_are_the_solution_s() -> None:
    solution = "def numbers(n):\n    return list(range(n))\n\nrandom = 4\n"
    tests = ["assert numbers(3) == [0, 1, 2]", "assert random == 4"]
    assert code_tests(PROMPT, fenced(solution), tests=tests) == 1.0


@pytest.mark.parametrize(("completion", "why"), [
    (fenced("def add(a, b)\n    return a + b\n"), "syntax error"),
    (fenced("def plus(a, b):\n    return a + b\n"), "missing function"),
    (fenced("raise RuntimeError('at import')\n" + ADD), "raises at import"),
    (fenced("def add(a, b):\n    return [] + 1\n"), "raises when called"),
    ("I cannot solve this.", "prose only"),
    ("", "empty"),
])
def test_broken_programs_score_zero(completion: str, why: str) -> None:
    assert code_tests(PROMPT, completion, tests=["assert add(1, 2) == 3"]) == 0.0, why


def test_missing_import_from_solution_scores_zero() -> None:
    tests = "from solution import plus\n\ndef test_plus():\n    assert plus(1, 2) == 3\n"
    assert code_tests(PROMPT, fenced(ADD), tests=tests) == 0.0


def test_timeout_and_memory_are_failures_not_errors() -> None:
    slow = fenced("import time\ndef add(a, b):\n    time.sleep(10)\n")
    assert code_tests(PROMPT, slow, tests=["assert add(1, 2) == 3"], timeout_s=1.0) == 0.0
    hungry = fenced("def add(a, b):\n    return len(bytearray(2**30))\n")
    assert code_tests(PROMPT, hungry, tests=["assert add(1, 2) == 3"], memory_mb=256) == 0.0


def test_extra_meta_fields_are_ignored() -> None:
    assert code_tests(PROMPT, fenced(ADD), tests=["assert add(1, 1) == 2"],
                      answer="unused", difficulty=3) == 1.0


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(("tests", "match"), [
    ([], "the list is empty"),
    ("def helper():\n    return 1\n", "defines no test_\\* functions"),
    (["assert add(1, 2) ==="], r"tests\[0\] is not valid Python"),
    ("def test_x(:\n", "test module is not valid Python"),
    ("def test_x(tmp_path):\n    pass\n", "takes parameters"),
    ("async def test_x():\n    pass\n", "is async"),
    ([b"assert True"], r"tests\[0\] must be a string"),
    (42, "must be a list of Python snippets"),
])
def test_unusable_tests_are_errors_naming_the_prompt(tests: object, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        code_tests(PROMPT, fenced(ADD), tests=tests)  # type: ignore[arg-type]
    assert "prompt 'code-3'" in str(info.value)


def test_harness_problems_are_errors_not_scores() -> None:
    with pytest.raises(SandboxError, match="'not_a_real_module', which is not available"):
        code_tests(PROMPT, fenced(ADD), tests=["import not_a_real_module\nassert add(1, 2) == 3"])
    with pytest.raises(SandboxError, match="a function cannot be passed to the solution"):
        code_tests(PROMPT, fenced("def apply(f, x):\n    return f(x)\n"),
                   tests=["assert apply(lambda v: v + 1, 1) == 2"])
    # Not silently a plain dict, which would make `most_common` fail the solution.
    with pytest.raises(SandboxError, match="a Counter cannot be passed to the solution"):
        code_tests(PROMPT, fenced("def top(c):\n    return c.most_common(1)[0][0]\n"),
                   tests=["from collections import Counter\nassert top(Counter('aab')) == 'a'"])


def test_loads_as_a_reward_function() -> None:
    fn = load_reward_fn("rltune.rewards.code:code_tests")
    assert fn(PROMPT, fenced(ADD), tests=["assert add(2, 2) == 4"]) == 1.0
