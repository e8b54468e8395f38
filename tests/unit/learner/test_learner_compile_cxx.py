"""``train.compile`` on the CPU without a working C++ compiler is refused when the blocks
are set up for compiling (``compile_blocks``, as the learner is built), as one
``ConfigError`` naming the key, the compiler looked for and the fix, instead of
inductor's traceback in the middle of the first learn phase."""

from __future__ import annotations

import copy

import pytest
from torch._inductor import config as inductor_config
from torch._inductor import cpp_builder

from rltune.config import ConfigError
from rltune.learner.compiled import compile_blocks, is_compiled
from rltune.learner.parallel import transformer_blocks
from rltune.rollout import compiled


@pytest.fixture
def no_compiler(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(compiled, "_CPP_COMPILER", {})
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    cpp_builder.cpp_compiler_search.cache_clear()
    with inductor_config.patch({"cpp.cxx": (None, "/nonexistent/c++")}):
        yield
    cpp_builder.cpp_compiler_search.cache_clear()


def test_inductor_without_a_compiler_is_refused_before_anything_is_compiled(tiny_model, no_compiler) -> None:
    model = copy.deepcopy(tiny_model)
    with pytest.raises(ConfigError, match=r"^train\.compile=true compiles with torch inductor's C\+\+ backend on the "
                                          r"CPU, but no working C\+\+ compiler was found \(tried /nonexistent/c\+\+, "
                                          r"from CXX\); install g\+\+ or set CXX .*, or set train\.compile=false$"):
        compile_blocks(model)
    assert not any(is_compiled(b) for b in transformer_blocks(model))


def test_a_backend_that_generates_no_code_needs_no_compiler(tiny_model, no_compiler) -> None:
    model = copy.deepcopy(tiny_model)
    assert compile_blocks(model, backend="eager") == len(transformer_blocks(model))
    assert compiled._CPP_COMPILER == {}
