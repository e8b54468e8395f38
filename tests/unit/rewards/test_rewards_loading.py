"""load_reward_fn: every spec form, and an error message for each way a spec goes wrong."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from rltune.data.records import Prompt
from rltune.rewards import builtin
from rltune.rewards.loading import RewardLoadError, load_reward_fn

USER_FILE = textwrap.dedent(
    """
    def my_reward(prompt, completion, **kw):
        return float(len(completion)) + kw.get("bonus", 0.0)

    def helper_score(prompt, completion, **kw):
        return 0.5

    LIMIT = 3
    """
)


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _prompt() -> Prompt:
    return Prompt(id="p0", text="2+2?")


def test_module_spec_canonical_and_builtin_alias() -> None:
    assert load_reward_fn("rltune.rewards.builtin:exact_numeric") is builtin.exact_numeric
    assert load_reward_fn("builtin:format_regex") is builtin.format_regex
    assert load_reward_fn("  builtin:exact_numeric ") is builtin.exact_numeric


def test_absolute_file_spec_as_a_new_user_writes_it(tmp_path: Path) -> None:
    path = _write(tmp_path / "my_rewards.py", USER_FILE)
    fn = load_reward_fn(f"{path}:my_reward")
    assert fn(_prompt(), "abcd") == 4.0
    assert fn(_prompt(), "abcd", bonus=1.5) == 5.5
    # Loading the same file again reuses the module rather than re-running it.
    assert load_reward_fn(f"{path}:my_reward") is fn


def test_relative_file_prefers_base_dir_then_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config_dir = tmp_path / "recipes"
    work_dir = tmp_path / "work"
    _write(config_dir / "r.py", "def f(prompt, completion, **kw):\n    return 1.0\n")
    _write(work_dir / "r.py", "def f(prompt, completion, **kw):\n    return 2.0\n")
    _write(work_dir / "only_here.py", "def g(prompt, completion, **kw):\n    return 3.0\n")
    monkeypatch.chdir(work_dir)
    assert load_reward_fn("r.py:f", base_dir=str(config_dir))(_prompt(), "") == 1.0
    assert load_reward_fn("r.py:f")(_prompt(), "") == 2.0
    # Not in base_dir: found in the working directory.
    assert load_reward_fn("only_here.py:g", base_dir=str(config_dir))(_prompt(), "") == 3.0
    # A sub-directory path is a file spec even without ".py" being the only clue.
    _write(work_dir / "sub" / "deep.py", "def h(prompt, completion, **kw):\n    return 4.0\n")
    assert load_reward_fn("sub/deep.py:h")(_prompt(), "") == 4.0


def test_two_files_with_the_same_name_do_not_collide(tmp_path: Path) -> None:
    a = _write(tmp_path / "a" / "rewards.py", "def f(prompt, completion):\n    return 1.0\n")
    b = _write(tmp_path / "b" / "rewards.py", "def f(prompt, completion):\n    return 2.0\n")
    assert load_reward_fn(f"{a}:f")(_prompt(), "") == 1.0
    assert load_reward_fn(f"{b}:f")(_prompt(), "") == 2.0


def test_user_file_with_a_dataclass_loads(tmp_path: Path) -> None:
    text = textwrap.dedent(
        """
        from dataclasses import dataclass

        @dataclass
        class Weights:
            a: float = 2.0

        def scored(prompt, completion, **kw):
            return Weights().a
        """
    )
    path = _write(tmp_path / "dc.py", text)
    assert load_reward_fn(f"{path}:scored")(_prompt(), "") == 2.0


@pytest.mark.parametrize("spec", ["exact_numeric", "builtin:", ":exact_numeric", ""])
def test_missing_colon_or_part(spec: str) -> None:
    with pytest.raises(RewardLoadError, match="expected `module:function`"):
        load_reward_fn(spec)


def test_module_not_importable_shows_import_error() -> None:
    with pytest.raises(RewardLoadError) as info:
        load_reward_fn("no_such_pkg_xyz.rewards:f")
    message = str(info.value)
    assert "cannot import module 'no_such_pkg_xyz.rewards'" in message
    assert "No module named 'no_such_pkg_xyz'" in message


def test_module_form_for_a_local_file_hints_at_the_file_form(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(tmp_path / "zz_local_rewards_q.py", USER_FILE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    with pytest.raises(RewardLoadError, match=r"write it as `zz_local_rewards_q\.py:FUNCTION`"):
        load_reward_fn("zz_local_rewards_q:my_reward")


def test_module_that_raises_on_import(tmp_path: Path) -> None:
    path = _write(tmp_path / "broken.py", "raise RuntimeError('needs GPU')\n")
    with pytest.raises(RewardLoadError, match="running .*broken.py failed: RuntimeError: needs GPU"):
        load_reward_fn(f"{path}:f")
    path = _write(tmp_path / "exits.py", "import sys\nsys.exit('bye')\n")
    with pytest.raises(RewardLoadError, match="running .*exits.py failed: SystemExit: bye"):
        load_reward_fn(f"{path}:f")
    path = _write(tmp_path / "syntax.py", "def f(:\n")
    with pytest.raises(RewardLoadError, match="SyntaxError"):
        load_reward_fn(f"{path}:f")


def test_file_not_found_shows_resolved_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config_dir = tmp_path / "cfg"
    config_dir.mkdir()
    with pytest.raises(RewardLoadError) as info:
        load_reward_fn("rewards/missing.py:f", base_dir=str(config_dir))
    message = str(info.value)
    assert "file not found" in message
    assert str(config_dir.resolve() / "rewards" / "missing.py") in message
    assert str(tmp_path.resolve() / "rewards" / "missing.py") in message


def test_missing_attribute_lists_callables_and_closest(tmp_path: Path) -> None:
    path = _write(tmp_path / "user.py", USER_FILE)
    with pytest.raises(RewardLoadError) as info:
        load_reward_fn(f"{path}:my_rewrd")
    message = str(info.value)
    assert "has no attribute 'my_rewrd'" in message
    assert "did you mean 'my_reward'?" in message
    assert "its functions: helper_score, my_reward)" in message
    assert "LIMIT" not in message


def test_builtin_typo_suggests_the_builtin() -> None:
    with pytest.raises(RewardLoadError, match="did you mean 'exact_numeric'"):
        load_reward_fn("builtin:exact_numerc")


def test_not_callable(tmp_path: Path) -> None:
    path = _write(tmp_path / "user.py", USER_FILE)
    with pytest.raises(RewardLoadError, match="'LIMIT' is a value of type int, not a function"):
        load_reward_fn(f"{path}:LIMIT")


def test_class_is_not_a_reward_function(tmp_path: Path) -> None:
    path = _write(tmp_path / "cls.py", "class R:\n    def __call__(self, p, c):\n        return 1\n")
    with pytest.raises(RewardLoadError, match="'R' is a class, not a function"):
        load_reward_fn(f"{path}:R")


@pytest.mark.parametrize(
    "source",
    [
        "def f(completion):\n    return 1.0\n",
        "def f(prompt, *, completion):\n    return 1.0\n",
        "def f(**meta):\n    return 1.0\n",
    ],
)
def test_signature_that_cannot_take_prompt_and_completion(tmp_path: Path, source: str) -> None:
    path = _write(tmp_path / "sig.py", source)
    with pytest.raises(RewardLoadError, match=r"cannot be called as fn\(prompt, completion, \*\*meta\)"):
        load_reward_fn(f"{path}:f")


@pytest.mark.parametrize(
    "source",
    [
        "def f(*args, **kw):\n    return 1.0\n",
        "def f(prompt, completion, answer=None):\n    return 1.0\n",
        "class _R:\n    def __call__(self, prompt, completion, **kw):\n        return 1.0\nf = _R()\n",
    ],
)
def test_accepted_signatures(tmp_path: Path, source: str) -> None:
    path = _write(tmp_path / "ok.py", source)
    assert load_reward_fn(f"{path}:f")(_prompt(), "x") == 1.0
