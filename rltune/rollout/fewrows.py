"""A float32 matrix product for the few rows of a CPU decode step (``fewrows.cpp``).

A decode step multiplies the batch's few rows (8 for a GRPO group) by every weight of the
model, reading each weight once for two flops per row: its speed is how fast the weights
stream from memory. oneDNN's and MKL's kernels are tuned for many rows; for 8 they read
the weights well below the machine's bandwidth (``docs/performance.md``). ``fewrows.cpp``
streams a weight stored once per generation as contiguous panels of output columns and
applies every loaded weight vector to all rows at once, on torch's own threads.

The C++ source ships with the package and is compiled on first use with the C++
compiler (``$CXX``, else ``c++``) against the running torch's headers and libraries
(:mod:`torch.utils.cpp_extension`'s paths), for the CPU it runs on (``-march=native``),
linked against the OpenMP runtime torch loaded, in about 10 s. The library is cached
under ``$RLTUNE_CACHE_DIR`` (default ``$XDG_CACHE_HOME/rltune``, else
``~/.cache/rltune``), keyed by the source, the compiler and its version, the CPU's
feature flags, the torch version, install and ABI, and the OpenMP runtime; a cached
build that does not load here is rebuilt for the process. It registers the torch operators
``rltune::fewrows_pack`` and ``rltune::fewrows_linear`` (so a compiled graph calls the
kernel with no Python between) and ``rltune::fewrows_decode_layer`` (a decoder layer for
one token a row on those products: :func:`decode_layer`), with shape functions for the
compiler.

Where it cannot be built (no compiler, a failed compile) :func:`unavailable` says why;
the decoder then uses oneDNN's packed product and says so once in the log.

A packed weight is a tensor of the weight's logical shape ``[n, k]`` whose storage holds
the panels (as oneDNN's packed weight is ``[n, k]`` over its own layout): it is an input
to :func:`linear` only, never to another torch op.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("fewrows.cpp")

_LOCK = threading.Lock()
_STATE: dict[str, str | None] = {}


def unavailable() -> str | None:
    """Why the kernel cannot run in this process, or None when it can (builds and loads
    it on the first call; later calls return the first answer)."""
    with _LOCK:
        if "reason" not in _STATE:
            try:
                _load()
                _STATE["reason"] = None
            except FewRowsUnavailable as err:
                _STATE["reason"] = str(err)
            except Exception as err:  # noqa: BLE001 - any failure to build or load means "not here", with its reason
                _STATE["reason"] = f"building or loading {SOURCE.name} failed: {type(err).__name__}: {err}"
        return _STATE["reason"]


class FewRowsUnavailable(RuntimeError):
    """The kernel could not be built or loaded here; the message says why."""


def cache_dir() -> Path:
    """Where built libraries are kept (see the module docstring)."""
    if os.environ.get("RLTUNE_CACHE_DIR"):
        return Path(os.environ["RLTUNE_CACHE_DIR"]) / "kernels"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rltune" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def _load() -> None:
    if not hasattr(torch.ops.rltune, "fewrows_linear"):
        compiler = _compiler()
        key = hashlib.sha256(b"\0".join(
            s if isinstance(s, bytes) else s.encode()
            for s in (SOURCE.read_bytes(), compiler, _compiler_version(compiler), _cpu_flags(), torch.__version__,
                      str(Path(torch.__file__).parent), str(torch._C._GLIBCXX_USE_CXX11_ABI), str(openmp_runtime()))
        )).hexdigest()[:20]
        target = cache_dir() / f"fewrows-{key}.so"
        if not target.exists():
            with _build_lock(target):  # processes starting together build it once
                if not target.exists():
                    target = _build(compiler, target)
        try:
            torch.ops.load_library(str(target))
        except (OSError, RuntimeError) as err:
            # a cached build this machine cannot load (a damaged file, or one another
            # machine wrote under the same key): build a private copy for this process
            try:
                private = _build(compiler, Path(tempfile.mkdtemp(prefix="rltune-fewrows-")) / target.name)
                torch.ops.load_library(str(private))
            except (OSError, RuntimeError) as again:
                raise FewRowsUnavailable(f"the built kernel {target} does not load: {err}; "
                                         f"rebuilt, it does not either: {again}") from again
    if "fakes" not in _STATE:
        torch.library.register_fake("rltune::fewrows_pack")(_pack_shape)
        torch.library.register_fake("rltune::fewrows_linear")(_linear_shape)
        torch.library.register_fake("rltune::fewrows_decode_layer")(_decode_layer_shape)
        _STATE["fakes"] = None


def _compiler_version(compiler: str) -> str:
    """``compiler --version``'s first line (part of the cache key), or "" if it fails."""
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.splitlines()[0] if done.stdout else ""


@contextlib.contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    """An exclusive lock on ``target``'s cache directory for the build, where the
    directory is writable and the platform has ``flock``; else no lock (the build's
    atomic rename still leaves one complete file)."""
    try:
        import fcntl

        target.parent.mkdir(parents=True, exist_ok=True)
        handle = open(target.parent / ".lock", "a")
    except (ImportError, OSError):
        yield
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:  # a file system without locks (some network homes): build unlocked
            pass
        yield


def _compiler() -> str:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise FewRowsUnavailable("no C++ compiler found (set CXX, or install g++)")
    return compiler


def _build(compiler: str, target: Path, source: Path = SOURCE) -> Path:
    """Compile ``source`` into ``target`` (atomically: a concurrent build by another
    process leaves one complete file); the library's path."""
    from torch.utils.cpp_extension import include_paths, library_paths

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    except OSError:  # an unwritable cache: build for this process only
        work = Path(tempfile.mkdtemp(prefix="rltune-fewrows-"))
        target = work / target.name
    obj, built = work / "fewrows.o", work / target.name
    # torch's parallel_for is inline OpenMP where torch runs on OpenMP: compiled with
    # -fopenmp, and linked against the runtime torch loaded, not the compiler's own (a
    # second runtime would be a second thread pool)
    openmp = torch.backends.openmp.is_available()
    runtime = openmp_runtime() if openmp else None
    if openmp and runtime is None:
        raise FewRowsUnavailable("torch runs on OpenMP, but its runtime was not found among the "
                                 "process's loaded libraries (/proc/self/maps)")
    commands = [
        [compiler, "-O3", "-march=native", "-std=c++20", "-fPIC", "-DNDEBUG", *(["-fopenmp"] if openmp else []),
         f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
         *(f"-I{p}" for p in include_paths()), "-c", str(source), "-o", str(obj)],
        [compiler, "-shared", str(obj), "-o", str(built), *([str(runtime)] if runtime else []),
         *(f"-L{p}" for p in library_paths()), *(f"-Wl,-rpath,{p}" for p in library_paths()),
         "-lc10", "-ltorch_cpu"],
    ]
    try:
        for command in commands:
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=600)
            except (OSError, subprocess.TimeoutExpired) as err:
                raise FewRowsUnavailable(f"building {source.name} failed: {' '.join(command)}: {err}") from err
            if done.returncode != 0:
                raise FewRowsUnavailable(
                    f"building {source.name} failed ({' '.join(command)}):\n{done.stderr[-3000:]}")
        if built != target:
            os.replace(built, target)
    finally:
        if built != target:  # the cache keeps the library only
            shutil.rmtree(work, ignore_errors=True)
    return target


def openmp_runtime() -> Path | None:
    """The OpenMP runtime (GNU, Intel or LLVM) loaded in this process, from its memory
    map; None where there is none or the map is unreadable."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and re.search(r"/lib(gomp|iomp5|omp)[-.][^/]*so", fields[5]):
            return Path(fields[5])
    return None


def _pack_shape(weights: list[torch.Tensor]) -> torch.Tensor:
    return weights[0].new_empty((sum(w.shape[0] for w in weights), weights[0].shape[1]))


def _linear_shape(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


def _decode_layer_shape(h: torch.Tensor, norm1: torch.Tensor, eps1: float, qkv: torch.Tensor,
                        qkv_bias: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor,
                        key_bias: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, t: int, scale: float,
                        o: torch.Tensor, o_bias: torch.Tensor | None, norm2: torch.Tensor, eps2: float,
                        gate_up: torch.Tensor, down: torch.Tensor) -> list[torch.Tensor]:
    return [h.new_empty(h.shape), h.new_empty((h.shape[0], qkv.shape[0])), h.new_empty(h.shape),
            h.new_empty((h.shape[0], gate_up.shape[0]))]


def pack(weight: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """``weight [n, k]`` (float32, CPU), or several ``[n_i, k]`` stacked along ``n`` as
    one (without concatenating them first), stored as the kernel's panels in a tensor of
    the stacked logical shape (see the module docstring)."""
    _require()
    return torch.ops.rltune.fewrows_pack([weight] if isinstance(weight, torch.Tensor) else list(weight))


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x Wᵀ + bias + residual`` with ``packed`` from :func:`pack`; ``x [..., k]``,
    ``residual`` of the output's shape; a new contiguous ``[..., n]`` tensor."""
    return torch.ops.rltune.fewrows_linear(x, packed, bias, residual)


def decode_layer(h: torch.Tensor, norm1: torch.Tensor, eps1: float, qkv: torch.Tensor, qkv_bias: torch.Tensor | None,
                 keys: torch.Tensor, values: torch.Tensor, key_bias: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, t: int, scale: float, o: torch.Tensor, o_bias: torch.Tensor | None,
                 norm2: torch.Tensor, eps2: float, gate_up: torch.Tensor, down: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoder layer for one new token of each row ``h [R, H]`` in one native call
    (``fewrows.cpp``: the one-query step of :class:`~rltune.rollout.fastpath.LeanDecoder`
    with every product on :func:`pack` ed weights): writes slot ``t`` of ``keys`` and
    ``values`` ``[R, KV, T, D]``; ``key_bias [R KV, 1, T]`` is 0 at a valid slot and
    ``-inf`` at a padded one, ``cos, sin [R, D]`` this position's. Returns ``(h after the
    layer, q/k/v before rotary [R, (Hq + 2 KV) D], h after the attention's residual,
    gate/up [R, 2 I])``."""
    out = torch.ops.rltune.fewrows_decode_layer(h, norm1, eps1, qkv, qkv_bias, keys, values, key_bias, cos, sin, t,
                                                scale, o, o_bias, norm2, eps2, gate_up, down)
    return out[0], out[1], out[2], out[3]


def _require() -> None:
    reason = unavailable()
    if reason:
        raise FewRowsUnavailable(reason)
