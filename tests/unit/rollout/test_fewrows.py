"""The few-row kernel (rltune/rollout/fewrows.cpp) against F.linear, its errors, and what
the decoder does where it cannot be built."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from rltune.rollout import fastpath, fewrows


@pytest.fixture(autouse=True)
def _built(request: pytest.FixtureRequest, require_fewrows) -> None:
    if "without_kernel" not in request.keywords:  # the tests of the fallback need no kernel
        require_fewrows()


def error_bound(x: torch.Tensor, w: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 forward error bound of a dot product of k terms in any order, with
    fused multiply-adds or not: |computed - exact| <= k u sum|x_i w_i| with u = 2^-24 (the
    standard γ_k bound, γ_k ≈ k u), for either of the two computed products; their
    difference is within twice that. ``extra`` (the bias and residual, added at the end)
    adds 2 u of its magnitude per addition."""
    k = x.shape[-1]
    bound = 2 * k * 2.0**-24 * (x.abs() @ w.abs().t())
    if extra is not None:
        bound = bound + 4 * 2.0**-24 * extra.abs()
    return bound + 1e-30


# (rows, n, k). rows: one row block, a partial one, several, none; columns: whole panels of
# 16 and 8 floats, a ragged tail, fewer than one panel; k: one, several, none
SHAPES = [(8, 64, 48), (3, 40, 24), (21, 33, 100), (1, 512, 7), (16, 17, 256), (5, 7, 40), (0, 24, 8),
          (4, 24, 0), (9, 3, 1)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows,n,k", SHAPES, ids=lambda v: str(v))
def test_product_equals_f_linear(rows: int, n: int, k: int, threads: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    x, res = torch.randn(rows, k, generator=gen), torch.randn(rows, n, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        packed = fewrows.pack(w)
        plain = fewrows.linear(x, packed)
        full = fewrows.linear(x, packed, b, res)
    finally:
        torch.set_num_threads(before)
    assert packed.shape == (n, k) and plain.shape == (rows, n) and plain.is_contiguous()
    if rows == 0 or k == 0:  # an empty product: the bias and residual alone, or nothing
        torch.testing.assert_close(plain, torch.zeros(rows, n), atol=0, rtol=0)
        torch.testing.assert_close(full, (b + res), atol=0, rtol=0)
    exact = x.double() @ w.double().t()
    assert ((plain.double() - exact).abs() <= error_bound(x, w).double()).all()
    want = exact + b.double() + res.double()
    assert ((full.double() - want).abs() <= error_bound(x, w, b.abs() + res.abs()).double()).all()
    # each output is one thread's dot product in a fixed order: the thread count changes
    # which thread computes it, not its value
    torch.set_num_threads(1 if threads == 2 else 2)
    try:
        torch.testing.assert_close(fewrows.linear(x, packed, b, res), full, atol=0, rtol=0)
    finally:
        torch.set_num_threads(before)


def test_stacked_weights_pack_as_their_concatenation() -> None:
    """q, k and v (or gate and up) packed from their own tensors equal the packing of
    their concatenation, bit for bit, including a ragged total."""
    gen = torch.Generator().manual_seed(5)
    parts = [torch.randn(n, 24, generator=gen) for n in (16, 9, 9)]
    x = torch.randn(8, 24, generator=gen)
    stacked, joined = fewrows.pack(parts), fewrows.pack(torch.cat(parts))
    assert stacked.shape == joined.shape == (34, 24)
    torch.testing.assert_close(fewrows.linear(x, stacked), fewrows.linear(x, joined), atol=0, rtol=0)


def test_leading_dimensions_and_strided_inputs() -> None:
    """``x [R, T, k]`` as the prefill passes it; non-contiguous x and residual are read
    as their values."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(40, 24, generator=gen)
    x = torch.randn(24, 5, 3, generator=gen).permute(2, 1, 0)  # [3, 5, 24], not contiguous
    res = torch.randn(40, 5, 3, generator=gen).permute(2, 1, 0)
    got = fewrows.linear(x, fewrows.pack(w), None, res)
    assert got.shape == (3, 5, 40)
    want = x.double() @ w.double().t() + res.double()
    assert ((got.double() - want).abs() <= error_bound(x, w, res).double()).all()


def test_bad_inputs_are_named() -> None:
    packed = fewrows.pack(torch.randn(16, 8))
    with pytest.raises(RuntimeError, match=r"x must be a float32 CPU tensor, got Double"):
        fewrows.linear(torch.randn(2, 8, dtype=torch.float64), packed)
    with pytest.raises(RuntimeError, match=r"does not fit a \[16, 8\] weight"):
        fewrows.linear(torch.randn(2, 9), packed)
    with pytest.raises(RuntimeError, match=r"bias has 15 elements, the weight 16 rows"):
        fewrows.linear(torch.randn(2, 8), packed, torch.randn(15))
    with pytest.raises(RuntimeError, match=r"residual \[16, 2\] is not the output's shape \[2, 16\]"):
        fewrows.linear(torch.randn(2, 8), packed, None, torch.randn(16, 2))
    # a plain weight, a copy, a slice: refused, never read as panels (whatever the vector width)
    for wrong in (torch.randn(16, 8), torch.randn(32, 8), packed.clone(), packed[:, :4], packed[:8]):
        with pytest.raises(RuntimeError, match="is not fewrows_pack's output as it returned it"):
            fewrows.linear(torch.randn(2, wrong.shape[1]), wrong)
    with pytest.raises(RuntimeError, match=r"the weights must be 2-D with the same columns, got \[4, 7\] after \[16, 8\]"):
        fewrows.pack([torch.randn(16, 8), torch.randn(4, 7)])
    with pytest.raises(RuntimeError, match=r"weight must be a float32 CPU tensor, got Half"):
        fewrows.pack(torch.randn(16, 8).half())


def test_the_shape_functions_match_the_kernels() -> None:
    """What the compiler is told the operators return (shape, strides, dtype) is what they
    return, for a 2-D and a 3-D input."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    parts = [torch.randn(20, 12), torch.randn(4, 12)]
    packed = fewrows.pack(parts)
    for x in (torch.randn(3, 12), torch.randn(2, 5, 12)):
        real = fewrows.linear(x, packed, torch.randn(24))
        with FakeTensorMode() as mode:
            fake_packed = torch.ops.rltune.fewrows_pack([mode.from_tensor(p) for p in parts])
            fake = torch.ops.rltune.fewrows_linear(mode.from_tensor(x), fake_packed, None, None)
        assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)
        assert fake_packed.shape == packed.shape


def test_the_decode_layer_shape_function_matches_the_kernel() -> None:
    """``fewrows_decode_layer``'s outputs as the compiler is told them: 3 rows, hidden 16,
    2 query heads and 1 kv head of 8, intermediate 12."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    rows, hidden, d, inner, slots = 3, 16, 8, 12, 5
    args = dict(h=torch.randn(rows, hidden), norm1=torch.ones(hidden), eps1=1e-6,
                qkv=fewrows.pack(torch.randn(4 * d, hidden)), qkv_bias=None,
                keys=torch.zeros(rows, 1, slots, d), values=torch.zeros(rows, 1, slots, d),
                key_bias=torch.zeros(rows, 1, slots), cos=torch.ones(rows, d), sin=torch.zeros(rows, d), t=2,
                scale=d ** -0.5, o=fewrows.pack(torch.randn(hidden, 2 * d)), o_bias=None, norm2=torch.ones(hidden),
                eps2=1e-6, gate_up=fewrows.pack(torch.randn(2 * inner, hidden)),
                down=fewrows.pack(torch.randn(hidden, inner)))
    real = torch.ops.rltune.fewrows_decode_layer(**args)
    with FakeTensorMode() as mode:
        fake = torch.ops.rltune.fewrows_decode_layer(
            **{k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()})
    assert [(f.shape, f.stride(), f.dtype) for f in fake] == [(r.shape, r.stride(), r.dtype) for r in real]


def test_the_avx2_build_passes_these_tests(tmp_path) -> None:
    """A CPU with AVX-512 builds the kernel with 16-float vectors and two panels a step; an
    AVX2 CPU builds it with 8-float vectors and one. That second build is made here with
    ``-mno-avx512f`` (a compiler wrapper as ``CXX``, a cache of its own) and this file's
    other tests run on it in a child process."""
    if "avx512f" not in fewrows._cpu_flags().split():
        pytest.skip("this CPU's own build is the 8-float one, which the other tests run")
    wrapper = tmp_path / "cxx"
    wrapper.write_text(f'#!/bin/sh\nexec "{fewrows._compiler()}" "$@" -mno-avx512f\n')
    wrapper.chmod(0o755)
    env = {**os.environ, "CXX": str(wrapper), "RLTUNE_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "not avx2"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout
    assert len(list((tmp_path / "cache" / "kernels").glob("fewrows-*.so"))) == 1  # built through the wrapper


def test_a_failed_build_names_the_command_and_the_compiler_error(tmp_path) -> None:
    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++\n")
    with pytest.raises(fewrows.FewRowsUnavailable, match=r"building bad.cpp failed \(.*bad.cpp.*\):\n.*error"):
        fewrows._build(fewrows._compiler(), tmp_path / "cache" / "k.so", source=bad)
    with pytest.raises(fewrows.FewRowsUnavailable, match="no-such-compiler"):
        fewrows._build(str(tmp_path / "no-such-compiler"), tmp_path / "cache" / "k.so")


def test_the_cache_follows_the_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("RLTUNE_CACHE_DIR", str(tmp_path / "a"))
    assert fewrows.cache_dir() == tmp_path / "a" / "kernels"
    monkeypatch.delenv("RLTUNE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "b"))
    assert fewrows.cache_dir() == tmp_path / "b" / "rltune" / "kernels"


def test_the_default_kernel_follows_the_row_count() -> None:
    """fewrows where the product waits on the weights (few rows), oneDNN's GEMM beyond
    :data:`FEW_ROWS`; a requested kernel is used at any row count."""
    assert fastpath.packed_kernel(rows=8) == fastpath.packed_kernel(rows=fastpath.FEW_ROWS) == "fewrows"
    assert fastpath.packed_kernel("fewrows", rows=256) == "fewrows"
    if torch.backends.mkldnn.is_available():
        assert fastpath.packed_kernel(rows=fastpath.FEW_ROWS + 1) == "onednn"
        assert fastpath.packed_kernel("onednn", rows=8) == "onednn"


@pytest.mark.without_kernel
def test_where_it_cannot_be_built_the_decoder_says_so_and_uses_onednn(monkeypatch, caplog) -> None:
    monkeypatch.setattr(fewrows, "unavailable", lambda: "no C++ compiler found")
    monkeypatch.setattr(fastpath, "_FALLBACK_LOGGED", [])
    with pytest.raises(ValueError, match="the fewrows kernel cannot run here: no C\\+\\+ compiler found"):
        fastpath.packed_kernel("fewrows")
    if not torch.backends.mkldnn.is_available():
        return
    with caplog.at_level(logging.WARNING, logger=fastpath.__name__):
        assert fastpath.packed_kernel(rows=8) == "onednn"
        assert fastpath.packed_kernel(rows=8) == "onednn"
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "no C++ compiler found" in said[0]  # once, with the reason
    with pytest.raises(ValueError, match="unknown packed kernel 'mkl'"):
        fastpath.packed_kernel("mkl")
