"""Attacks by model-written code, each shown contained AND scored right.

Every case runs a hostile solution through the test harness (what ``code_tests`` scores)
under each namespaced mechanism this machine has, and checks two things: the attack did
not get out (no connection made, no file read or written, no process left, no secret
seen) and the score is what an honest judge gives (0, the honest pass rate, or an error
where the *tests* are at fault). Limits are small so each case takes a few seconds at most.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rltune.sandbox import Limits, SandboxError, TestReport, run_python, run_tests
from rltune.sandbox.mechanisms import UID_BASE, UID_SLOTS, uid_processes

FAST = Limits(cpu_s=1, wall_s=3, memory_mb=256, file_mb=1, processes=12,
              output_bytes=4096, disk_mb=8)
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(-1, 1) == 0"]
HONEST = "def add(a, b):\n    return a + b\n"


@pytest.fixture(params=["bwrap", "unshare"])  # skipped, or failed under CI, where one does not work (conftest)
def mech(request: pytest.FixtureRequest) -> Iterator[str]:
    yield request.param
    # After every case: no process of any sandbox uid is left (zombies aside).
    left = [pid for uid in _sandbox_uids() for pid in uid_processes(uid)]
    assert not left, f"processes left behind: {left}"


def _sandbox_uids() -> set[int]:
    uids = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                uid = int(Path(entry.path, "status").read_text().split("Uid:")[1].split()[0])
            except (OSError, IndexError):
                continue
            if UID_BASE <= uid < UID_BASE + UID_SLOTS:
                uids.add(uid)
    return uids


def score(mech: str, solution: str, tests: list[str] | str = ADD_TESTS,
          limits: Limits = FAST) -> TestReport:
    report = run_tests(solution, tests, limits=limits, mechanism=mech)  # type: ignore[arg-type]
    assert report.result.seconds < limits.wall_s + 1.5
    return report


def _leaks(report: TestReport, *secrets: str) -> bool:
    text = report.result.stdout + report.result.stderr + "".join(
        m for m in report.messages if m)
    return any(s in text for s in secrets)


# --------------------------------------------------------------------------- limits


def test_infinite_loop_busy(mech: str) -> None:
    """CPU limit: the loop dies of SIGXCPU; the loop is in the function, so each test
    that calls it fails -- and the run ends, as the solution process is gone."""
    # A wall clock far past the CPU limit: had the run waited for it, it would end "wall".
    report = score(mech, "def add(a, b):\n    while True:\n        pass\n",
                   limits=dataclasses.replace(FAST, wall_s=60))
    assert (report.passed, report.complete, report.result.limit_hit) == (0, True, None)


def test_infinite_loop_sleeping(mech: str) -> None:
    """Wall limit: a loop that burns no CPU is killed with the whole sandbox."""
    report = score(mech, "import time\ndef add(a, b):\n    while True:\n        time.sleep(1)\n",
                   limits=Limits(wall_s=1.5))
    assert (report.passed, report.result.limit_hit, report.complete) == (0, "wall", False)


def test_partial_credit_is_kept_when_a_later_test_hangs(mech: str) -> None:
    solution = ("import time\ndef add(a, b):\n    if a < 0:\n        time.sleep(60)\n"
                "    return a + b\n")
    report = score(mech, solution, limits=Limits(wall_s=1.5))
    assert report.verdicts == (True, True, None) and report.pass_rate == pytest.approx(2 / 3)


def test_fork_bomb(mech: str) -> None:
    solution = ("import os\ntry:\n    while True:\n        os.fork()\nexcept OSError:\n"
                "    pass\n" + HONEST)
    report = score(mech, solution)
    # Every forked copy answers on the same pipe: the runner reads garbage, fails the test.
    assert report.passed == 0 and report.result.seconds < 2.5


def test_fork_bomb_in_a_child_does_not_touch_the_verdicts(mech: str) -> None:
    solution = ("import os, time\nif os.fork() == 0:\n    try:\n        while True:\n"
                "            os.fork()\n    except OSError:\n        time.sleep(30)\n"
                "    os._exit(0)\n" + HONEST)
    assert score(mech, solution).pass_rate == 1.0


def test_memory_bomb(mech: str) -> None:
    report = score(mech, "blocks = []\nwhile True:\n    blocks.append(bytearray(2**20))\n" + HONEST)
    assert report.passed == 0
    assert report.messages[0] == "the solution did not load: MemoryError: "


def test_thread_bomb(mech: str) -> None:
    """Threads count as processes: the bomb stops at the limit; the solution catches it
    and goes on, so it gets the honest score, and reports how far it got."""
    solution = ("import threading, time\nSTARTED = 0\ntry:\n    while True:\n"
                "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
                "        STARTED += 1\nexcept RuntimeError:\n    pass\n" + HONEST)
    report = score(mech, solution, [*ADD_TESTS, "assert 0 < STARTED < 12"])
    assert report.pass_rate == 1.0


def test_output_flood(mech: str) -> None:
    """The solution's output goes nowhere: a flood neither reaches the host nor ends
    the run."""
    solution = "import sys\nfor _ in range(200000):\n    print('x' * 100)\n" + HONEST
    report = score(mech, solution)
    assert report.pass_rate == 1.0 and "xxxx" not in report.result.stdout
    assert len(report.result.stdout) < 1000


def test_huge_file_write(mech: str) -> None:
    solution = ("try:\n    open('big', 'wb').write(b'x' * 50 * 2**20)\nexcept OSError as e:\n"
                "    ERROR = e.errno\nimport os\nSIZE = os.path.getsize('big')\n" + HONEST)
    report = score(mech, solution, [*ADD_TESTS, "assert ERROR == 27", "assert SIZE == 2**20"])
    assert report.pass_rate == 1.0  # EFBIG at file_mb, and the rest of the program runs


def test_sleeping_children_are_killed(mech: str) -> None:
    marker = f"rltune-left-{uuid.uuid4().hex}"
    solution = (
        "import os, subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', {marker!r}],"
        " start_new_session=True)\n"
        "if os.fork() == 0:\n    os.setsid()\n    import time; time.sleep(300)\n" + HONEST)
    assert score(mech, solution).pass_rate == 1.0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                assert marker.encode() not in Path(entry.path, "cmdline").read_bytes()
            except OSError:
                continue


# --------------------------------------------------------------------------- escapes


@pytest.fixture
def host_server() -> Iterator[tuple[int, list[socket.socket]]]:
    """A TCP server on the host's 127.0.0.1 recording every connection it accepts."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.1)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=serve)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    for conn in accepted:
        conn.close()
    server.close()


def test_network_is_unreachable(mech: str, host_server: tuple[int, list[socket.socket]]) -> None:
    port, accepted = host_server
    solution = (
        "import socket\nRESULTS = []\n"
        f"for addr in [('127.0.0.1', {port}), ('1.1.1.1', 80), ('8.8.8.8', 53)]:\n"
        "    try:\n        socket.create_connection(addr, timeout=1).close()\n"
        "        RESULTS.append('connected')\n"
        "    except OSError as e:\n        RESULTS.append(e.errno)\n" + HONEST)
    # The solution proves it could not connect: an error for each address.
    report = score(mech, solution, [*ADD_TESTS,
                                    "assert all(type(r) is int for r in RESULTS)"])
    assert report.pass_rate == 1.0
    assert accepted == []  # and the host server never saw a connection


def test_files_outside_cannot_be_read(mech: str, tmp_path: Path) -> None:
    secret = f"secret-{uuid.uuid4().hex}"
    path = tmp_path / "secret.txt"
    path.write_text(secret)
    path.chmod(0o644)  # readable by anyone on the host: only the mount namespace hides it
    repo_file = Path(__file__).resolve()
    solution = (
        "def add(a, b):\n    found = []\n"
        f"    for p in [{str(path)!r}, {str(repo_file)!r}, '/etc/shadow', '/root/.bashrc',\n"
        "              '/proc/1/environ', '/proc/1/mem']:\n"
        "        try:\n            found.append(open(p).read())\n"
        "        except OSError:\n            pass\n    return '|'.join(found)\n")
    report = score(mech, solution, [f"assert add(0, 0) == ''"])
    assert report.pass_rate == 1.0  # nothing outside was readable
    assert not _leaks(report, secret)


def test_files_outside_cannot_be_written(mech: str, tmp_path: Path) -> None:
    targets = [tmp_path / "evil.txt", Path("/tmp") / f"rltune-evil-{uuid.uuid4().hex}",
               Path(__file__).resolve().parent / f"evil-{uuid.uuid4().hex}.py"]
    solution = (
        f"for p in {[str(t) for t in targets]!r}:\n"
        "    try:\n        open(p, 'w').write('pwned')\n    except OSError:\n        pass\n"
        + HONEST)
    assert score(mech, solution).pass_rate == 1.0
    assert not any(t.exists() for t in targets)


def test_environment_secrets_are_not_visible(mech: str, monkeypatch: pytest.MonkeyPatch) -> None:
    token = f"tok-{uuid.uuid4().hex}"
    monkeypatch.setenv("RLTUNE_API_TOKEN", token)
    solution = ("import os\ndef add(a, b):\n"
                "    seen = repr(dict(os.environ))\n"
                "    for p in ('/proc/1/environ', '/proc/self/environ'):\n"
                "        try:\n            seen += open(p).read()\n"
                "        except OSError:\n            pass\n    return seen\n")
    report = score(mech, solution, ["assert 'RLTUNE' not in add(0, 0)"])
    assert report.pass_rate == 1.0 and not _leaks(report, token)


# the interpreter and its venv, bound read-only wherever they live (under /tmp, say)
_PYTHON_DIRS = tuple(sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}))


def test_the_tests_cannot_be_read_by_the_solution(mech: str) -> None:
    """The expected values exist only in the test process: the solution searches every
    place it can read for them (files, other processes' command lines and memory,
    inherited descriptors) and would answer with the sentinel if it found it."""
    sentinel = f"expected-{uuid.uuid4().hex}"
    solution = (
        "import os\n"
        "def readable():\n"
        "    for root, dirs, names in os.walk('/'):\n"
        "        # the system and the Python installation are read-only copies of the host's\n"
        "        dirs[:] = [d for d in dirs if os.path.join(root, d) not in\n"
        f"                   ('/proc', '/sys', '/usr', '/root', '/work', '/dev', *{_PYTHON_DIRS!r})]\n"
        "        yield from (os.path.join(root, n) for n in names)\n"
        "    others = [p for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()]\n"
        "    for pid in others:\n"
        "        for f in ('cmdline', 'environ', 'mem', 'fd/0', 'fd/1', 'fd/3'):\n"
        "            yield f'/proc/{pid}/{f}'\n"
        "def add(a, b):\n"
        # Built at run time, so its own source file does not contain the sentinel.
        f"    wanted = {sentinel[:12]!r} + {sentinel[12:]!r}\n"
        "    for path in readable():\n"
        "        try:\n"
        "            with open(path, 'rb') as fh:\n"
        "                if wanted.encode() in fh.read(1 << 20):\n"
        "                    return wanted\n"
        "        except OSError:\n"
        "            pass\n"
        "    return 'not found'\n")
    report = score(mech, solution, [f"assert add(1, 2) == {sentinel!r}"])
    assert report.passed == 0 and report.messages[0] == "AssertionError: "


# --------------------------------------------------------------------------- forging


def test_fake_markers_and_result_files(mech: str) -> None:
    solution = (
        "import os, sys\n"
        "for line in ('pass 0', 'pass 1', 'pass 2', 'done', 'PASSED 3/3'):\n"
        "    print(line); sys.stderr.write(line + '\\n'); os.write(1, line.encode() + b'\\n')\n"
        "for name in ('results.json', 'report.xml', '/tmp/results.json', '.pytest_cache'):\n"
        "    try:\n        open(name, 'w').write('{\"passed\": 3, \"failed\": 0}')\n"
        "    except OSError:\n        pass\n"
        "def add(a, b):\n    return 0\n")
    report = score(mech, solution)
    assert report.verdicts == (False, False, True)  # add(-1, 1) == 0 is honestly right


def test_exit_before_the_tests_run(mech: str) -> None:
    for early in ("import sys\nsys.exit(0)\n", "exit(0)\n", "import os\nos._exit(0)\n",
                  "raise SystemExit(0)\n", "raise KeyboardInterrupt\n"):
        report = score(mech, early + HONEST)
        assert (report.passed, report.complete) == (0, True), early


def test_exit_inside_a_test(mech: str) -> None:
    for body in ("sys.exit(0)", "os._exit(0)", "raise SystemExit(0)", "raise KeyboardInterrupt",
                 "raise BaseException('stop')", "raise GeneratorExit"):
        solution = ("import os, sys\ndef add(a, b):\n    if a == 2:\n"
                    f"        {body}\n    return a + b\n")
        report = score(mech, solution)
        # os._exit kills the solution process: the tests after it fail too.
        expected = (True, False, False) if body == "os._exit(0)" else (True, False, True)
        assert report.verdicts == expected, body


def test_exceptions_escaping_tests_are_failures(mech: str) -> None:
    solution = ("def add(a, b):\n    if a < 0:\n        raise ValueError('negative')\n"
                "    return a + b\n")
    report = score(mech, solution)
    assert report.verdicts == (True, True, False)
    assert report.messages[2] == "ValueError: negative"


def test_always_equal_objects(mech: str) -> None:
    solution = (
        "class Anything:\n    def __eq__(self, other): return True\n"
        "    def __ne__(self, other): return False\n    def __hash__(self): return 0\n"
        "class EqInt(int):\n    def __eq__(self, other): return True\n"
        "    __hash__ = int.__hash__\n"
        "def add(a, b):\n    return Anything() if a == 1 else EqInt(99)\n")
    report = score(mech, solution, [*ADD_TESTS, "assert add(1, 2) != 5",
                                    "assert not (add(1, 2) != 3)", "assert [add(1, 2)] == [3]"])
    # An int subclass arrives as its int value (99); the other object as a stand-in,
    # equal only to itself. Only `add(1, 2) != 5` is (honestly) true.
    assert report.verdicts == (False, False, False, True, False, False)


def test_patched_builtins_and_assert_helpers(mech: str) -> None:
    solution = (
        "import builtins, math, unittest\n"
        "builtins.AssertionError = type('Never', (Exception,), {})\n"
        "math.isclose = lambda *a, **k: True\n"
        "unittest.TestCase.assertEqual = lambda *a, **k: None\n"
        "def all(*a): return True\ndef abs(x): return 0\ndef sorted(*a, **k): return [1, 2, 3]\n"
        "def add(a, b):\n    return 0\n")
    tests = ["assert math.isclose(add(0.1, 0.2), 0.3)",  # `math` the solution imported
             "assert all(add(i, 1) == i + 1 for i in range(3))",
             "assert abs(add(1, 1) - 2) < 1e-9",
             "assert sorted([add(3, 0), add(1, 0), add(2, 0)]) == [1, 2, 3]",
             "import unittest\nunittest.TestCase().assertEqual(add(1, 1), 2)"]
    assert score(mech, solution, tests).passed == 0


def test_objects_posing_as_modules(mech: str) -> None:
    """The tests use `math` without importing it (as many datasets do, leaning on the
    solution's imports): an object the solution names `math` does not stand in for it."""
    solution = ("class FakeMath:\n    def isclose(self, *a, **k):\n        return True\n"
                "math = FakeMath()\ndef add(a, b):\n    return 0\n")
    assert score(mech, solution, ["assert math.isclose(add(0.1, 0.2), 0.3)"]).passed == 0


def test_a_rewritten_solution_server(mech: str) -> None:
    """The solution rewrites the server it runs in, to greet the test runner with its own
    `__builtins__` (so `all` and `abs` would be its functions), a fake `math` and a value
    for `add` of its choice. The runner trusts none of it."""
    solution = textwrap.dedent("""
        import sys
        server = sys.modules["rltune.sandbox._harness_server"]
        wire = sys.modules["rltune.sandbox.wire"]
        yes = lambda *a, **k: True

        class FakeMath:
            isclose = staticmethod(yes)

        def greet(reply, handles):
            values = {"__builtins__": {"all": server.Opaque(yes), "abs": server.Opaque(yes)},
                      "math": server.Opaque(FakeMath()), "__name__": "x", "add": 3,
                      "bad name": 1}
            return wire.dumps(("hello", values, {"json": "os"}), handles.ref)

        server.encode_reply = greet
    """)
    tests = ["assert all([add == 3, False])", "assert abs(-1) is True",
             "assert math.isclose(add, 0)", "assert json.loads('[1]') == [1]"]
    report = score(mech, solution, tests)
    # `add` is the plain value 3 it sent; `all`, `abs` and `math` are the runner's own, and
    # so is `json` (used as a module by the tests), though it was claimed to be `os`.
    assert report.verdicts == (False, False, False, True)


def test_solution_functions_posing_as_tests(mech: str) -> None:
    """`from solution import *` after the tests are defined would replace them with
    the solution's `test_*` functions, which pass by doing nothing."""
    solution = ("def test_add():\n    pass\n\ndef test_more():\n    pass\n\n"
                "def add(a, b):\n    return 0\n")
    module = ("def test_add():\n    assert add(1, 2) == 3\n\n"
              "from solution import *\n"
              "from solution import test_more\n\n"
              "def test_more():\n    assert add(2, 2) == 4\n\n"
              "from solution import test_more\n")
    report = score(mech, solution, module)
    # test_add: `import *` skips test-like names, so it is the module's own (and fails);
    # test_more: explicitly replaced by the solution's -- refused, a failure.
    assert report.verdicts == (False, False)
    assert "replaced by the solution" in (report.messages[1] or "")


def test_ctypes_tricks(mech: str) -> None:
    cases = {
        "kill the test runner": "ctypes.CDLL(None).kill(os.getppid(), 9)",
        "kill every process": "ctypes.CDLL(None).kill(-1, 9)",
        "libc exit": "ctypes.CDLL(None).exit(0)",
        "segfault": "ctypes.string_at(0)",
        "ptrace the runner": "assert ctypes.CDLL(None).ptrace(16, os.getppid(), 0, 0) == 0",
        # Make the small int 3 read as 0 in this process: `add(1, 2) == 3` and `3 == 0`
        # become true here -- and nowhere else.
        "rewrite an int in memory":
            "ctypes.cast(id(3) + 24, ctypes.POINTER(ctypes.c_uint32))[0] = 0",
    }
    for name, trick in cases.items():
        solution = f"import ctypes, os\n{trick}\ndef add(a, b):\n    return 0\n"
        report = score(mech, solution)
        assert report.passed in (0, 1), name
        # add(-1, 1) == 0 is honestly right: it passes only when the solution survived.
        assert report.verdicts[:2] in ((False, False), (None, None)), name


def test_signals_against_the_test_runner(mech: str) -> None:
    sigint = "import os, signal, time\nos.kill(os.getppid(), signal.SIGINT)\ntime.sleep(0.2)\n"
    assert score(mech, sigint + HONEST).pass_rate == 1.0  # ignored: no KeyboardInterrupt
    sigstop = "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\n"
    report = score(mech, sigstop + HONEST, limits=Limits(wall_s=1.5))
    assert (report.passed, report.result.limit_hit) == (0, "wall")


def test_modules_planted_for_the_runner(mech: str) -> None:
    solution = ("for name in ('pytest.py', 'sitecustomize.py', 'math.py', 'json.py'):\n"
                "    open(name, 'w').write('import os; os._exit(0)')\n"
                "def add(a, b):\n    return 0\n")
    module = "import math\nimport pytest\nfrom solution import add\n" \
             "def test_add():\n    assert math.isclose(add(1, 2), 3)\n"
    report = score(mech, solution, module)
    assert (report.passed, report.complete) == (0, True)  # ran with the real modules


def test_unanswerable_values(mech: str) -> None:
    """Answers the runner refuses to decode: each is that test's failure, not an error."""
    bodies = {
        "20 MiB": "return 'x' * (20 * 2**20)",
        "deeply nested": "x = []\n    for _ in range(500):\n        x = [x]\n    return x",
        "cyclic": "x = []\n    x.append(x)\n    return x",
    }
    for name, body in bodies.items():
        report = score(mech, f"def add(a, b):\n    {body}\n")
        assert (report.passed, report.complete) == (0, True), name


def test_answers_passed_back_cannot_make_a_harness_error(mech: str) -> None:
    """An answer nested just below what a request may carry, passed back by the test
    (`decode(encode(s))`), would make the request too deep -- the harness's error, and
    "no score" is a way out of a 0. Such an answer is refused as the solution's instead."""
    solution = ("def encode(s):\n    x = s\n    for _ in range(95):\n        x = [x]\n"
                "    return x\n"
                "def decode(x):\n    while type(x) is list:\n        x = x[0]\n    return x\n")
    report = score(mech, solution, ["assert decode(encode('abc')) == 'abc'"])
    assert report.passed == 0 and "nested too deeply" in (report.messages[0] or "")


def test_no_tests_is_an_error_not_a_score(mech: str) -> None:
    for tests in ([], "def helper():\n    pass\n", "x = 1"):
        with pytest.raises(ValueError, match="no test"):
            score(mech, HONEST, tests)  # type: ignore[arg-type]


def test_run_python_with_a_sentinel_cannot_escape(mech: str, tmp_path: Path) -> None:
    """The same escapes through plain run_python, checked from the outside."""
    marker = tmp_path / "escaped"
    code = ("import os\n"
            f"for p in [{str(marker)!r}, '/work/escaped', '/root/escaped']:\n"
            "    try:\n        open(p, 'w').write('x')\n    except OSError as e:\n"
            "        print(e.errno)\n")
    r = run_python(code, limits=FAST, mechanism=mech)  # type: ignore[arg-type]
    # No such directory here, or the read-only root (the Python installation's parents).
    assert [int(e) for e in r.stdout.split()] in ([2, 30, 30], [2, 2, 30], [2, 30, 2], [2, 2, 2])
    assert not marker.exists()


def test_an_error_in_the_harness_is_not_a_score(mech: str) -> None:
    with pytest.raises(SandboxError, match="not available in the sandbox"):
        score(mech, HONEST, ["import no_such_module_xyz\nassert add(1, 2) == 3"])
