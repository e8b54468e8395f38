"""The sandbox runner (every mechanism this machine has) and the wire format between the
test runner and the solution server.

Namespaced mechanisms (bwrap, unshare) are parametrized and skipped, with the reason,
where they do not work, or failed under CI (``conftest.py``). ``rlimits-only`` is forced where needed; as root it drops to a
private uid, so it needs an interpreter any user can reach (``/usr/bin/python3``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import shutil
import stat
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from fractions import Fraction
from decimal import Decimal
from pathlib import Path

import pytest

from rltune.sandbox import Limits, SandboxError, isolation, run_python, unavailable
from rltune.sandbox import runner, wire
from rltune.sandbox.mechanisms import UID_BASE, UID_SLOTS

REPO = Path(__file__).resolve().parents[3]
SYSTEM_PYTHON = "/usr/bin/python3"
SMALL = Limits(cpu_s=1, wall_s=5, memory_mb=256, file_mb=1, processes=8,
               output_bytes=4096, disk_mb=8)
# The CPU-limit cases: a wall clock no busy machine reaches before 2 s of CPU (the hard
# limit), so the limit that ends them is the CPU's whatever the load.
CPU_BOUND = dataclasses.replace(SMALL, wall_s=120)
IS_ROOT = os.geteuid() == 0


NAMESPACED = ["bwrap", "unshare"]  # skipped, or failed under CI, where one does not work (conftest)

needs_system_python = pytest.mark.skipif(
    not os.access(SYSTEM_PYTHON, os.X_OK), reason=f"no {SYSTEM_PYTHON}")


def rlimits_only(code: str, **kwargs: object) -> runner.SandboxResult:
    """run_python under rlimits-only, its one-time warning silenced."""
    kwargs.setdefault("python", SYSTEM_PYTHON if IS_ROOT else sys.executable)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return run_python(code, mechanism="rlimits-only", **kwargs)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- basics


@pytest.mark.parametrize("mech", NAMESPACED)
def test_program_gets_stdin_files_and_a_private_cwd(mech: str) -> None:
    code = ("import os, sys\n"
            "print(os.getcwd(), sorted(os.listdir('.')))\n"
            "print(open('data/in.txt').read(), input())\n")
    r = run_python(code, stdin="line one\n", files={"data/in.txt": "héllo"}, mechanism=mech)
    assert r.stdout == "/sandbox ['data', 'main.py']\nhéllo line one\n"
    assert (r.exit_code, r.stderr, r.limit_hit, r.timed_out, r.truncated) == (0, "", None,
                                                                              False, False)
    assert r.isolation == mech
    assert 0 < r.seconds < 5 and r.cpu_seconds is not None and 0 <= r.cpu_seconds < 1


@pytest.mark.parametrize("mech", NAMESPACED)
def test_working_directory_does_not_outlive_the_run(mech: str) -> None:
    run_python("open('left.txt', 'w').write('x')", mechanism=mech)
    r = run_python("import os; print(os.path.exists('left.txt'))", mechanism=mech)
    assert r.stdout == "False\n"


@pytest.mark.parametrize("mech", NAMESPACED)
def test_exit_status_stderr_and_traceback(mech: str) -> None:
    r = run_python("import sys\nsys.stderr.write('oops')\nsys.exit(3)", mechanism=mech)
    assert (r.exit_code, r.stderr, r.limit_hit) == (3, "oops", None)
    r = run_python("x = 1\nraise ValueError('boom')", mechanism=mech)
    assert r.exit_code == 1
    lines = r.stderr.strip().splitlines()
    # Python's own format, starting at the program: no bootstrap frame in between.
    assert lines == ["Traceback (most recent call last):",
                     '  File "/sandbox/main.py", line 2, in <module>',
                     "    raise ValueError('boom')",
                     "ValueError: boom"]


@pytest.mark.parametrize("mech", NAMESPACED)
def test_death_by_signal_is_a_negative_exit_code(mech: str) -> None:
    r = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)", mechanism=mech)
    assert (r.exit_code, r.limit_hit) == (-15, None)


@pytest.mark.parametrize("mech", NAMESPACED)
def test_stdlib_and_ctypes_import(mech: str) -> None:
    r = run_python("import ctypes, json, sqlite3, multiprocessing\nprint('ok')", mechanism=mech)
    assert (r.exit_code, r.stdout) == (0, "ok\n"), r.stderr


def test_isolation_is_decided_once() -> None:
    first = isolation()
    assert first in ("bwrap", "unshare", "rlimits-only")
    assert isolation() is first
    if unavailable("bwrap") is None:
        assert first == "bwrap"
    assert run_python("pass").isolation == first


@pytest.mark.parametrize("name", ["../up.txt", "/etc/x", "a/../../b", "", "main.py"])
def test_bad_file_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="files"):
        run_python("pass", files={name: "x"})


def test_bad_limits_and_mechanism_are_refused() -> None:
    with pytest.raises(ValueError, match="Limits.wall_s"):
        Limits(wall_s=0)
    with pytest.raises(ValueError, match="Limits.memory_mb"):
        Limits(memory_mb=-1)
    with pytest.raises(ValueError, match="mechanism must be one of"):
        run_python("pass", mechanism="docker")  # type: ignore[arg-type]


def test_unavailable_mechanism_is_an_error_not_a_fallback(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "_unavailable", lambda m: "not on this test machine")
    with pytest.raises(SandboxError, match="'bwrap' is not available: not on this test"):
        run_python("pass", mechanism="bwrap")


def test_a_broken_sandbox_start_is_a_sandbox_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "_boot_source", lambda: "raise SystemExit(7)")
    with pytest.raises(SandboxError, match=r"failed to start \(exit 7\)"):
        rlimits_only("print('never')")


# --------------------------------------------------------------------------- limits


@pytest.mark.parametrize("mech", NAMESPACED)
def test_cpu_limit(mech: str) -> None:
    r = run_python("while True: pass", limits=CPU_BOUND, mechanism=mech)
    assert (r.exit_code, r.limit_hit, r.timed_out) == (-24, "cpu", True)  # SIGXCPU
    assert 0.9 < r.cpu_seconds < 2.1  # type: ignore[operator]


@pytest.mark.parametrize("mech", NAMESPACED)
def test_cpu_limit_holds_when_sigxcpu_is_ignored(mech: str) -> None:
    code = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass"
    r = run_python(code, limits=CPU_BOUND, mechanism=mech)
    assert (r.exit_code, r.limit_hit) == (-9, "cpu")  # the hard limit, one second later
    # Past the 1 s soft limit SIGXCPU would have ended (exit -24): ran on to the 2 s hard
    # limit, which a loaded machine's CPU accounting reads a little short of (seen: 1.87).
    assert 1.5 < r.cpu_seconds < 3.1  # type: ignore[operator]


@pytest.mark.parametrize("mech", NAMESPACED)
def test_wall_limit_kills_the_whole_run(mech: str) -> None:
    limits = Limits(wall_s=1.0)
    r = run_python("import time\nprint('started', flush=True)\ntime.sleep(60)",
                   limits=limits, mechanism=mech)
    assert (r.exit_code, r.limit_hit, r.timed_out, r.stdout) == (None, "wall", True,
                                                                 "started\n")
    assert 1.0 <= r.seconds < 2.5


@pytest.mark.parametrize("mech", NAMESPACED)
def test_memory_limit(mech: str) -> None:
    r = run_python("x = bytearray(300 * 2**20)", limits=SMALL, mechanism=mech)
    assert (r.exit_code, r.limit_hit) == (1, "memory")
    assert r.stderr.strip().endswith("MemoryError")


@pytest.mark.parametrize("mech", NAMESPACED)
def test_file_size_and_disk_limits(mech: str) -> None:
    r = run_python("open('big', 'wb').write(b'x' * 2 * 2**20)", limits=SMALL, mechanism=mech)
    assert (r.exit_code, r.limit_hit) == (1, "file")
    assert "File too large" in r.stderr
    # Many files under the per-file limit: the tmpfs size caps the total.
    many = "for i in range(20):\n    open(f'/tmp/f{i}', 'wb').write(b'x' * 900 * 1024)"
    r = run_python(many, limits=SMALL, mechanism=mech)
    assert r.exit_code == 1 and "No space left on device" in r.stderr


@pytest.mark.parametrize("mech", NAMESPACED)
def test_output_is_capped_and_the_flood_stopped(mech: str) -> None:
    r = run_python("import sys\nwhile True: sys.stdout.write('y' * 1000)",
                   limits=SMALL, mechanism=mech)
    assert (r.exit_code, r.limit_hit, r.truncated) == (None, "output", True)
    assert r.stdout == "y" * 4096 and r.seconds < 3


@pytest.mark.parametrize("mech", NAMESPACED)
def test_process_limit(mech: str) -> None:
    code = ("import os\nn = 0\n"
            "try:\n    while True:\n        if os.fork() == 0:\n"
            "            import time; time.sleep(30); os._exit(0)\n        n += 1\n"
            "except OSError as e:\n    print(n, e.errno)")
    r = run_python(code, limits=SMALL, mechanism=mech)
    assert r.stdout == "7 11\n"  # 8 processes in all, then EAGAIN


@pytest.mark.parametrize("mech", NAMESPACED)
def test_environment_is_minimal(mech: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLTUNE_TEST_SECRET", "hunter2")
    r = run_python("import os; print(sorted(os.environ))", mechanism=mech)
    names = set(eval(r.stdout))  # noqa: S307 -- our own program printed a list of str
    assert names <= {"PATH", "HOME", "TMPDIR", "LANG", "PWD"}
    assert "hunter2" not in r.stdout


@pytest.mark.parametrize("mech", NAMESPACED)
def test_concurrent_runs_have_their_own_process_limit(mech: str) -> None:
    """A private uid per run: a fork bomb holding its whole quota does not stop a run
    next to it from starting threads."""
    bomb = ("import os, time\nn = 0\n"
            "try:\n    while True:\n        if os.fork() == 0:\n"
            "            time.sleep(2); os._exit(0)\n        n += 1\n"
            "except OSError:\n    print('full', n, flush=True)\n    time.sleep(1)")
    threads = ("import threading, time\n"
               "ts = [threading.Thread(target=time.sleep, args=(0.2,)) for _ in range(6)]\n"
               "[t.start() for t in ts]; [t.join() for t in ts]; print('threads ok')")
    results: dict[str, runner.SandboxResult] = {}
    bomb_thread = threading.Thread(
        target=lambda: results.update(bomb=run_python(bomb, limits=SMALL, mechanism=mech)))
    bomb_thread.start()
    time.sleep(0.3)
    results["threads"] = run_python(threads, limits=SMALL, mechanism=mech)
    bomb_thread.join()
    assert results["bomb"].stdout == "full 7\n"
    assert results["threads"].stdout == "threads ok\n"


# --------------------------------------------------------------------------- rlimits-only


@needs_system_python
def test_rlimits_only_says_so_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "_warned", False)
    python = SYSTEM_PYTHON if IS_ROOT else sys.executable
    with pytest.warns(RuntimeWarning, match="resource limits only"):
        r = run_python("print('hi')", mechanism="rlimits-only", python=python)
    assert (r.isolation, r.stdout) == ("rlimits-only", "hi\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise
        run_python("pass", mechanism="rlimits-only", python=python)


@needs_system_python
@pytest.mark.skipif(not IS_ROOT, reason="the private-uid drop happens only as root")
def test_rlimits_only_as_root_runs_as_a_private_uid_with_limits() -> None:
    r = rlimits_only("import os; print(os.getresuid())")
    uids = eval(r.stdout)  # noqa: S307 -- a tuple of ints printed by our program
    assert len(set(uids)) == 1 and UID_BASE <= uids[0] < UID_BASE + UID_SLOTS
    code = ("import os\nn = 0\n"
            "try:\n    while True:\n        if os.fork() == 0:\n"
            "            import time; time.sleep(30); os._exit(0)\n        n += 1\n"
            "except OSError:\n    print(n)")
    assert rlimits_only(code, limits=SMALL).stdout == "7\n"
    assert rlimits_only("while True: pass", limits=CPU_BOUND).limit_hit == "cpu"
    assert rlimits_only("import time; time.sleep(9)", limits=Limits(wall_s=1)).limit_hit \
        == "wall"
    # The fallback isolates no file reads: a world-readable host file is readable there
    # (and not in the namespaced mechanisms, see the adversarial tests).
    assert rlimits_only("print(open('/etc/hostname').read() != '')").stdout == "True\n"


@pytest.mark.skipif(not IS_ROOT, reason="only root drops to a private uid")
def test_rlimits_only_as_root_needs_a_reachable_interpreter(tmp_path: Path) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "python").symlink_to(sys.executable)
    with pytest.raises(SandboxError, match="not searchable by other users"):
        rlimits_only("pass", python=str(private / "python"))


NON_ROOT_SCRIPT = """
import sys, warnings
sys.path.insert(0, {repo!r})
from rltune.sandbox import Limits, SandboxError, run_python
limits = Limits(cpu_s=1, wall_s=5, processes=8)
bomb = ("import os\\nn = 0\\ntry:\\n    while True:\\n        if os.fork() == 0:\\n"
        "            import time; time.sleep(30); os._exit(0)\\n        n += 1\\n"
        "except OSError:\\n    print(n)")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        r = run_python(bomb, limits=limits, mechanism=sys.argv[1])
    except SandboxError as exc:
        raise SystemExit(f"unavailable: {{exc}}")
print(r.isolation, r.stdout.strip(), r.exit_code, len(caught))
"""


@contextlib.contextmanager
def _readable_copy_of_the_sandbox() -> Iterator[str]:
    """A copy of ``rltune/sandbox`` that nobody can import, in a fresh world-readable
    folder: the checkout may live where only its owner can read (a clone under a 0700
    ``mktemp -d`` folder), and an ordinary user running rltune has their own copy."""
    base = Path(tempfile.gettempdir())
    closed = [str(d) for d in (base, *base.parents) if not d.stat().st_mode & stat.S_IXOTH]
    if closed:
        pytest.skip(f"the temporary folder {base} is not reachable by other users ({closed[0]})")
    root = Path(tempfile.mkdtemp(prefix="rltune-sandbox-copy-"))
    try:
        shutil.copytree(REPO / "rltune" / "sandbox", root / "rltune" / "sandbox",
                        ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(REPO / "rltune" / "__init__.py", root / "rltune" / "__init__.py")
        for path in (root, *root.rglob("*")):
            path.chmod(0o755 if path.is_dir() else 0o644)
        yield str(root)
    finally:
        shutil.rmtree(root)


@needs_system_python
@pytest.mark.skipif(not IS_ROOT, reason="needs root to start a process as nobody")
@pytest.mark.parametrize("mech", ["bwrap", "rlimits-only"])
def test_as_a_non_root_user(mech: str) -> None:
    """The same code run by an ordinary user (nobody): bwrap in a user namespace, or the
    rlimits-only fallback with the process limit counted on top of the user's tasks."""
    with _readable_copy_of_the_sandbox() as root:
        out = subprocess.run(
            [SYSTEM_PYTHON, "-I", "-c", NON_ROOT_SCRIPT.format(repo=root), mech],
            user=65534, group=65534, extra_groups=[], capture_output=True, text=True,
            timeout=60, cwd="/", env={"PATH": "/usr/bin:/bin"},
        )
    if out.stderr.startswith("unavailable:"):  # e.g. no unprivileged user namespaces
        pytest.skip(f"{mech} as an ordinary user: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    isolation_, forks, exit_code, warned = out.stdout.split()
    assert (isolation_, exit_code) == (mech, "0")
    assert warned == ("1" if mech == "rlimits-only" else "0")
    if mech == "bwrap":
        assert forks == "7"  # 8 processes: the user namespace counts only the run
    else:
        assert 7 <= int(forks) < 8 + 5  # the user's other tasks were counted in


# --------------------------------------------------------------------------- overhead


@pytest.mark.slow
@pytest.mark.parametrize("mech", [*NAMESPACED, "rlimits-only"])
def test_overhead_of_an_empty_program(mech: str) -> None:
    """Median wall time of run_python('pass') over 20 calls (printed; run with -s)."""
    run = (lambda: rlimits_only("pass")) if mech == "rlimits-only" else (
        lambda: run_python("pass", mechanism=mech))
    run()
    times = []
    for _ in range(20):
        start = time.perf_counter()
        assert run().exit_code == 0
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    print(f"\n{mech}: median {median * 1000:.1f} ms, min {min(times) * 1000:.1f} ms")
    assert median < 0.5


# --------------------------------------------------------------------------- wire


class Handle:
    pass


ROUND_TRIP = [
    None, True, False, 0, -1, 2**200, -(2**4000 + 7), 1.5, -0.0, math.inf, -math.inf,
    1e-310, 3 + 4j, "", "héllo\n\x00", "\ud800", b"", b"\x00\xff", bytearray(b"ab"),
    [], [1, [2, [3]]], (), (1, "a", (None,)), set(), {1, "x", (2, 3)}, frozenset({1.5}),
    {}, {"a": 1, 2: [3], (4, 5): {6: None}}, Fraction(-3, 7), Decimal("1.10"),
]


@pytest.mark.parametrize("value", ROUND_TRIP, ids=repr)
def test_wire_round_trip_keeps_values_and_exact_types(value: object) -> None:
    back = wire.loads(wire.dumps(value))
    assert back == value and type(back) is type(value)
    assert repr(back) == repr(value)  # -0.0 stays -0.0, 1.10 keeps its digits


def test_wire_nan_and_nested_types() -> None:
    back = wire.loads(wire.dumps([math.nan, (1, [2.0])]))
    assert math.isnan(back[0]) and back[1] == (1, [2.0])  # type: ignore[index]
    assert [type(x) for x in back[1]] == [int, list]  # type: ignore[index]


def test_wire_sends_subclasses_as_their_base_value() -> None:
    from collections import OrderedDict, defaultdict, namedtuple
    from enum import IntEnum

    class AlwaysEqual(int):
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = int.__hash__

    class Color(IntEnum):
        RED = 2

    point = namedtuple("point", "x y")
    sent = [AlwaysEqual(5), Color.RED, point(1, 2), defaultdict(list, a=[1]),
            OrderedDict(b=2), type("S", (str,), {})("s")]
    back = wire.loads(wire.dumps(sent))
    assert back == [5, 2, (1, 2), {"a": [1]}, {"b": 2}, "s"]
    assert [type(x) for x in back] == [int, int, tuple, dict, dict, str]  # type: ignore
    assert back[0] != 6  # type: ignore[index]  # the subclass's __eq__ did not travel


def test_wire_exact_mode_refuses_subclasses() -> None:
    from collections import Counter

    assert wire.loads(wire.dumps([1, (2.5, "s")], exact=True)) == [1, (2.5, "s")]
    with pytest.raises(wire.WireError, match="cannot send a Counter"):
        wire.dumps({"k": Counter("ab")}, exact=True)
    data = wire.dumps([Counter("a")], lambda o: (1, "Counter"), exact=True)
    assert wire.loads(data, lambda ref, name: (ref, name)) == [(1, "Counter")]


def test_wire_handles_travel_as_id_and_type_name() -> None:
    obj = Handle()
    data = wire.dumps({"k": [obj]}, lambda o: (7, type(o).__qualname__))
    seen: list[tuple[int, str]] = []
    back = wire.loads(data, lambda ref, name: seen.append((ref, name)) or "stand-in")
    assert back == {"k": ["stand-in"]} and seen == [(7, "Handle")]
    with pytest.raises(wire.WireError, match="cannot send a Handle"):
        wire.dumps(obj)
    with pytest.raises(wire.WireError, match="unexpected handle"):
        wire.loads(data)


def test_wire_refuses_deep_values() -> None:
    deep: list[object] = []
    for _ in range(wire.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(wire.WireError, match="nested too deeply"):
        wire.dumps(deep)
    with pytest.raises(wire.WireError, match="nested too deeply"):
        wire.loads(b"l1:" * (wire.MAX_DEPTH + 5) + b"N")
    ten_deep = b"l1:" * 10 + b"N"
    assert wire.loads(ten_deep, max_depth=10) == [[[[[[[[[[None]]]]]]]]]]
    with pytest.raises(wire.WireError, match="nested too deeply"):
        wire.loads(ten_deep, max_depth=9)


@pytest.mark.parametrize("data", [
    b"", b"X", b"i;", b"i12", b"ig;", b"i1;N", b"f1.0", b"fzz;", b"s5:abc", b"s-1:",
    b"s99999999999999:", b"l2:N", b"S1:l0:", b"d1:l0:N", b"q1;0;", b"x1;", b"Dxyz",
    b"D3:abc", b"s1:\xff", b"t1:",
])
def test_wire_malformed_input_is_a_wire_error(data: bytes) -> None:
    with pytest.raises(wire.WireError):
        wire.loads(data)


def test_wire_fuzzed_input_never_raises_anything_else() -> None:
    rng = random.Random(1234)
    seed = wire.dumps([ROUND_TRIP[:12], {"k": (1, 2.5, "s")}, b"\x01\x02"])
    for _ in range(3000):
        data = bytearray(seed)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            wire.loads(bytes(data[: rng.randint(0, len(data))]))
        except wire.WireError:
            pass


def test_wire_framing() -> None:
    import io

    r, w = os.pipe()
    wire.send(w, b"abc")
    wire.send(w, b"")
    os.close(w)
    with os.fdopen(r, "rb") as reader:
        assert wire.receive(reader, 10) == b"abc"
        assert wire.receive(reader, 10) == b""
        assert wire.receive(reader, 10) is None
    with pytest.raises(wire.WireError, match="over the 3-byte limit"):
        wire.receive(io.BytesIO(b"4\nabcd"), 3)
    with pytest.raises(wire.WireError, match="cut short"):
        wire.receive(io.BytesIO(b"4\nab"), 10)
    with pytest.raises(wire.WireError, match="bad frame header"):
        wire.receive(io.BytesIO(b"x\nab"), 10)
