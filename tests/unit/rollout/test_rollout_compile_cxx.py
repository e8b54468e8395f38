"""``rollout.compile`` on the CPU without a working C++ compiler is refused when the
generator is built, as one ``ConfigError`` naming the key, the compiler looked for and
the fix, instead of inductor's traceback in the middle of the first step; the lookup
runs once per process, only when compiling on the CPU, and never for ``compile=false``."""

from __future__ import annotations

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor import cpp_builder

from rltune.config import ConfigError
from rltune.rollout import compiled
from rltune.rollout.compiled import CompiledStep, cpp_compiler_problem, require_cpp_compiler
from rltune.rollout.hf import HFGenerator


@pytest.fixture
def fresh_lookup(monkeypatch: pytest.MonkeyPatch):
    """This process's answer forgotten (inductor's and rltune's), and forgotten again after."""
    monkeypatch.setattr(compiled, "_CPP_COMPILER", {})
    cpp_builder.cpp_compiler_search.cache_clear()
    yield
    cpp_builder.cpp_compiler_search.cache_clear()


@pytest.fixture
def no_compiler(fresh_lookup, monkeypatch: pytest.MonkeyPatch):
    """Inductor looks for the compiler CXX names, and it does not exist."""
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with inductor_config.patch({"cpp.cxx": (None, "/nonexistent/c++")}):
        yield


MESSAGE = (r"^rollout\.compile=true compiles with torch inductor's C\+\+ backend on the CPU, but no working C\+\+ "
           r"compiler was found \(tried /nonexistent/c\+\+, from CXX\); install g\+\+ or set CXX to a working C\+\+ "
           r"compiler, or set rollout\.compile=false$")


def test_the_generator_refuses_at_start(tiny_model, tokenizer, no_compiler) -> None:
    with pytest.raises(ConfigError, match=MESSAGE):
        HFGenerator(tiny_model, tokenizer, compile=True)


def test_compile_off_never_looks(tiny_model, tokenizer, no_compiler, monkeypatch) -> None:
    monkeypatch.setattr(compiled, "cpp_compiler_problem", lambda: pytest.fail("looked up with compile off"))
    assert HFGenerator(tiny_model, tokenizer)._compiled is None


def test_other_devices_are_not_checked(no_compiler) -> None:
    require_cpp_compiler("rollout.compile", torch.device("cuda"))  # Triton's business, not this machine's C++
    require_cpp_compiler("rollout.compile", "meta")
    assert compiled._CPP_COMPILER == {}
    CompiledStep()  # no device: nothing checked (a step built by hand)


def test_the_lookup_runs_once_per_process(fresh_lookup, monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", lambda: calls.append(1) or "g++")
    assert cpp_compiler_problem() is None and cpp_compiler_problem() is None
    require_cpp_compiler("rollout.compile", "cpu")
    assert calls == [1]


def test_a_compiler_found_passes(fresh_lookup, monkeypatch) -> None:
    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", lambda: "g++")
    assert CompiledStep("cpu") is not None


def test_unset_cxx_says_so(fresh_lookup, monkeypatch) -> None:
    monkeypatch.delenv("CXX", raising=False)
    with inductor_config.patch({"cpp.cxx": (None, "/nonexistent/g++")}):
        assert cpp_compiler_problem() == "no working C++ compiler was found (tried /nonexistent/g++; CXX is unset)"
