"""The test side of a test run: runs the tests, with the solution in another process.

Runs inside the sandbox as the program of :func:`rltune.sandbox.harness.run_tests`. It
reads its orders (tests, a per-run secret, the server program) from stdin, starts the
solution server (:mod:`rltune.sandbox._harness_server`) as a separate interpreter, and runs
each test *here*, where the solution's names are stand-ins (:class:`RemoteObject`) that
forward calls, attribute reads, indexing and iteration to the server.

Why the verdicts cannot be forged by the solution:

- the tests, the comparisons and the verdicts live in this process, which the solution
  never runs code in: it makes itself non-dumpable first (no ``ptrace``, no
  ``/proc/PID/mem`` or ``/proc/PID/fd`` for a process of the same uid) and ignores
  ``SIGINT`` (the only signal Python turns into an exception);
- what comes back from the solution is rebuilt here as exact built-in values
  (:mod:`rltune.sandbox.wire`); any other object stays a handle whose ``==`` is identity
  and whose comparisons and arithmetic are not forwarded, so an "always equal" object,
  patched builtins or ``assert`` helpers in the solution's process change nothing here;
- the solution's names never shadow built-ins in the tests' namespace, and a module it
  imported is replaced by this process's own copy (standard library only);
- verdicts go to stdout, which only this process holds, each line prefixed with a secret
  the host sent on stdin (read before the solution starts): the solution's own output goes
  to ``/dev/null``, and a line without the secret is ignored by the host;
- the solution dying (``exit``, ``os._exit``, a signal, ``ctypes``) only ends its answers:
  each test still waiting fails.

Lines on stdout, after the secret: ``pass I``, ``fail I MESSAGE``, ``done``, and
``harness MESSAGE`` when the tests themselves cannot run here (a module they import is
missing, they pass a function to the solution) -- not the solution's fault.
"""

from __future__ import annotations

import builtins
import os
import sys

from rltune.sandbox import wire

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

_PR_SET_DUMPABLE = 4
REPLY_DEPTH = wire.MAX_DEPTH - 10
"""Deepest answer accepted from the solution: shallower than what a request may carry, so
a test passing an answer back (``decode(encode(s))``) never makes a request too deep --
which would be the harness's error, a way for the solution to dodge a score."""
MESSAGE_CHARS = 800
"""Longest failure message reported (a line stays under the pipe's atomic write size)."""
_NO_IMPORT = frozenset({"this", "antigravity", "idlelib", "tkinter", "turtle", "turtledemo",
                        "site", "readline", "rlcompleter"})


class SolutionError(Exception):
    """The solution failed with no matching built-in exception: it raised a type of its
    own (or ``SystemExit``), died, or answered something unreadable."""


class HarnessProblem(Exception):
    """The tests asked for something the harness cannot do (not the solution's fault)."""


# --------------------------------------------------------------------------- the link


class Link:
    """Request/answer pipes to the solution server."""

    def __init__(self, pid: int, req_fd: int, rep_fd: int, limit: int) -> None:
        self.pid, self.req_fd, self.limit = pid, req_fd, limit
        self.reader = os.fdopen(rep_fd, "rb")
        self.proxies: dict[int, RemoteObject] = {}
        self.dead: str | None = None

    def stop(self, why: str) -> None:
        """Kill the server (if not dead already) and fail every later request."""
        if self.dead is None:
            self.dead = why
            try:
                os.kill(self.pid, 9)
                os.waitpid(self.pid, 0)
            except OSError:
                pass

    def _proxy(self, ref: int, name: str) -> RemoteObject:
        if ref not in self.proxies:
            self.proxies[ref] = RemoteObject(self, ref, name)
        return self.proxies[ref]

    def _ref_of(self, obj: object) -> tuple[int, str]:
        if type(obj) is RemoteObject and object.__getattribute__(obj, "_link") is self:
            return object.__getattribute__(obj, "_ref"), ""
        raise wire.WireError(f"a {type(obj).__name__} cannot be passed to the solution "
                             "(only values of exact built-in types, Fraction, Decimal, and "
                             "objects the solution returned)")

    def receive(self) -> object:
        """The next message from the server."""
        if self.dead is not None:
            raise SolutionError(self.dead)
        try:
            payload = wire.receive(self.reader, self.limit)
        except (wire.WireError, OSError) as exc:
            self.stop(f"unreadable answer from the solution: {exc}")
            raise SolutionError(self.dead) from None
        if payload is None:
            self.stop("the solution process exited")
            raise SolutionError(self.dead)
        try:
            return wire.loads(payload, self._proxy, max_depth=REPLY_DEPTH)
        except wire.WireError as exc:
            raise SolutionError(f"unreadable answer from the solution: {exc}") from None

    def ask(self, op: str, target: RemoteObject, *operands: object) -> object:
        """Send one request about ``target`` and return the answer's value (raising what
        the solution raised)."""
        try:
            data = wire.dumps((op, target, *operands), self._ref_of, exact=True)
        except wire.WireError as exc:
            raise HarnessProblem(str(exc)) from None
        if self.dead is not None:
            raise SolutionError(self.dead)
        try:
            wire.send(self.req_fd, data)
        except OSError:
            self.stop("the solution process exited")
            raise SolutionError(self.dead) from None
        reply = self.receive()
        if type(reply) is tuple and len(reply) == 3 and reply[0] == "ok":
            if op == "call":
                _copy_back(reply[2], *operands)
            return reply[1]
        if reply == ("stop",) and op == "next":
            raise StopIteration
        if type(reply) is tuple and len(reply) == 2 and reply[0] == "err":
            raise solution_exception(reply[1])
        raise SolutionError(f"unreadable answer from the solution to {op!r}")

    def hello(self) -> tuple[dict[str, object], dict[str, str]]:
        """The solution's top-level values and modules; SolutionError if it did not
        load."""
        msg = self.receive()
        if (type(msg) is tuple and len(msg) == 3 and msg[0] == "hello"
                and type(msg[1]) is dict and type(msg[2]) is dict
                and all(type(k) is str for k in msg[1])
                and all(type(k) is str and type(v) is str for k, v in msg[2].items())):
            return msg[1], msg[2]
        if type(msg) is tuple and len(msg) == 2 and msg[0] == "load_error":
            raise SolutionError(f"the solution did not load: {_error_text(msg[1])}")
        raise SolutionError("unreadable greeting from the solution")


def _copy_back(back: object, args: object, kwargs: object) -> None:
    """Apply the solution's in-place changes to the list/dict/set/bytearray arguments."""
    if type(back) is not list or type(args) is not tuple or type(kwargs) is not dict:
        raise SolutionError("unreadable answer from the solution")
    for item in back:
        if not (type(item) is tuple and len(item) == 2):
            raise SolutionError("unreadable answer from the solution")
        key, new = item
        if type(key) is int and 0 <= key < len(args):
            old = args[key]
        elif type(key) is str and key in kwargs:
            old = kwargs[key]
        else:
            raise SolutionError("unreadable answer from the solution")
        if type(old) is not type(new):
            raise SolutionError("unreadable answer from the solution")
        if type(old) in (list, bytearray):
            old[:] = new  # type: ignore[index]
        elif type(old) in (dict, set):
            old.clear()  # type: ignore[attr-defined]
            old.update(new)  # type: ignore[attr-defined]


def solution_exception(error: object) -> Exception:
    """The exception to raise in a test for an error the solution reported: the built-in
    type of that name when there is one (so ``pytest.raises(ValueError)`` works), else
    :class:`SolutionError`. Always an ``Exception``: a ``SystemExit`` or
    ``KeyboardInterrupt`` from the solution cannot end the test run."""
    if not (type(error) is tuple and len(error) == 3 and type(error[0]) is str
            and type(error[1]) is bool and type(error[2]) is str):
        return SolutionError("unreadable error from the solution")
    name, is_builtin, message = error
    cls = getattr(builtins, name, None) if is_builtin else None
    exc: Exception | None = None
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            exc = cls(message)
        except Exception:  # a type whose constructor wants more (UnicodeDecodeError)
            exc = None
    if exc is None:
        exc = SolutionError(f"{name}: {message}")
    exc._rltune_from_solution = True  # type: ignore[attr-defined]
    return exc


def _error_text(error: object) -> str:
    exc = solution_exception(error)
    return str(exc) if isinstance(exc, SolutionError) else f"{type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------- stand-ins


def _checked(value: object, kind: type, what: str) -> object:
    if type(value) is not kind:
        raise SolutionError(f"{what} returned {type(value).__name__}, not {kind.__name__}")
    return value


class RemoteObject:
    """A stand-in for an object that lives in the solution's process.

    Forwarded: calls, attributes (not dunders), indexing, ``len``, ``bool``, iteration,
    ``str``/``repr`` and ``float``/``int`` conversion -- each answer is a plain value or
    another stand-in. Never forwarded: ``==``, ordering, hashing, arithmetic and ``in``
    (which falls back to iterating), so the solution never sees a test's expected value
    and never decides a comparison: a stand-in equals only itself."""

    __slots__ = ("_link", "_ref", "_type")

    def __init__(self, link: Link, ref: int, type_name: str) -> None:
        object.__setattr__(self, "_link", link)
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "_type", type_name)

    def _ask(self, op: str, *operands: object) -> object:
        return object.__getattribute__(self, "_link").ask(op, self, *operands)

    def __call__(self, *args: object, **kwargs: object) -> object:
        return self._ask("call", args, kwargs)

    def __getattr__(self, name: str) -> object:
        if name.startswith("__") and name not in ("__name__", "__doc__", "__qualname__"):
            raise AttributeError(name)
        return self._ask("getattr", name)

    def __setattr__(self, name: str, value: object) -> None:
        self._ask("setattr", name, value)

    def __getitem__(self, key: object) -> object:
        return self._ask("getitem", key)

    def __setitem__(self, key: object, value: object) -> None:
        self._ask("setitem", key, value)

    def __delitem__(self, key: object) -> None:
        self._ask("delitem", key)

    def __len__(self) -> int:
        n = _checked(self._ask("len"), int, "len()")
        if n < 0:  # type: ignore[operator]
            raise SolutionError("len() returned a negative number")
        return n  # type: ignore[return-value]

    def __bool__(self) -> bool:
        return _checked(self._ask("bool"), bool, "bool()")  # type: ignore[return-value]

    def __iter__(self) -> object:
        return self._ask("iter")

    def __next__(self) -> object:
        return self._ask("next")

    def __str__(self) -> str:
        return _checked(self._ask("str"), str, "str()")  # type: ignore[return-value]

    def __repr__(self) -> str:
        return _checked(self._ask("repr"), str, "repr()")  # type: ignore[return-value]

    def __float__(self) -> float:
        return _checked(self._ask("float"), float, "float()")  # type: ignore[return-value]

    def __int__(self) -> int:
        return _checked(self._ask("int"), int, "int()")  # type: ignore[return-value]

    __eq__ = object.__eq__
    __hash__ = object.__hash__


# --------------------------------------------------------------------------- running


class Reporter:
    """Verdict lines, each prefixed with the run's secret, on a private copy of the
    original stdout; fd 1 itself is pointed at stderr, so nothing else that writes to
    stdout (a test's ``print``, a library) lands between verdicts."""

    def __init__(self, nonce: str) -> None:
        self.prefix = nonce.encode("ascii") + b" "
        self.fd = os.dup(1)  # close-on-exec: the solution server never holds it
        os.dup2(2, 1)
        sys.stdout = sys.stderr

    def line(self, text: str) -> None:
        data = memoryview(self.prefix + text.encode("utf-8", "replace") + b"\n")
        while data:
            data = data[os.write(self.fd, data):]

    def verdict(self, index: int, passed: bool, message: str | None) -> None:
        self.line(f"pass {index}" if passed else f"fail {index} {_one_line(message or '')}")


def _one_line(text: str) -> str:
    text = text[:MESSAGE_CHARS]
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def harness_problem(exc: BaseException) -> str | None:
    """The message when ``exc`` means the tests cannot run here at all."""
    if isinstance(exc, HarnessProblem):
        return str(exc)
    if (isinstance(exc, ImportError) and not getattr(exc, "_rltune_from_solution", False)
            and exc.name and exc.name.split(".")[0] != "solution"):
        return f"the tests import {exc.name!r}, which is not available in the sandbox: {exc}"
    return None


class HarnessStop(Exception):
    """Stop the run: the tests cannot run here (the host raises, the sample is unscored)."""


def run_one(fn: Callable[[], object]) -> tuple[bool, str | None]:
    """(passed, failure message). Any exception fails the test, except a harness
    problem, which stops the run."""
    try:
        fn()
    except BaseException as exc:
        problem = harness_problem(exc)
        if problem is not None:
            raise HarnessStop(problem) from None
        return False, f"{type(exc).__name__}: {_safe_str(exc)}"
    return True, None


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return "<unprintable>"


def namespace(values: dict[str, object], modules: dict[str, str],
              library: list[str]) -> dict[str, object]:
    """The solution's names as the tests see them, also installed as ``sys.modules
    ["solution"]`` for ``from solution import f``.

    The server's greeting is not trusted: dunder names (``__builtins__``!) and
    non-identifiers are dropped; a name that is a built-in (``abs``, ``all``, ``sorted``...)
    is left out of the tests' globals and of ``import *`` (a solution defining
    ``all = lambda *a: True`` must not decide a test); a module the solution imported is
    this process's own import of it (standard library only). ``library``: names the tests
    use as standard-library modules (``math.isclose(...)`` without importing ``math``) --
    they are this process's modules whatever the server sent, so an object the solution
    named ``math`` cannot answer for ``math.isclose``."""
    module = type(sys)("solution")
    shared: dict[str, object] = {}
    claimed: dict[str, object] = dict(values)
    claimed.update({name: None for name in (*modules, *library)})
    for name, value in claimed.items():
        if not name.isidentifier() or name.startswith("__"):
            continue
        if name in library or name in modules:
            value = _own_module(name if name in library else modules[name])
            if value is None:
                continue
        setattr(module, name, value)
        if not hasattr(builtins, name):
            shared[name] = value
    module.__all__ = [  # type: ignore[attr-defined]
        n for n in shared if not n.startswith(("_", "test"))]
    sys.modules["solution"] = module
    return shared


def _own_module(name: str) -> object | None:
    top = name.split(".")[0]
    if top not in sys.stdlib_module_names or top in _NO_IMPORT:
        return None
    try:
        __import__(name)
    except Exception:
        return None
    return sys.modules.get(name)


def run_all(orders: dict[str, object], link: Link, report: Reporter) -> None:
    """Run every test in ``orders`` and report each verdict, then ``done``."""
    count = len(orders["names"])  # type: ignore[arg-type]
    try:
        values, modules = link.hello()
    except SolutionError as exc:
        for i in range(count):
            report.verdict(i, False, str(exc))
        report.line("done")
        return
    library = orders["library"]
    ns = {**namespace(values, modules, library),  # type: ignore[arg-type]
          "__name__": "tests", "__builtins__": builtins}
    source = orders["source"]
    if orders["mode"] == "asserts":
        for i, text in enumerate(source):  # type: ignore[arg-type]
            code = compile(text, f"<test {i}>", "exec")
            report.verdict(i, *run_one(lambda: exec(code, ns)))
    else:
        code = compile(source, "tests.py", "exec")  # type: ignore[call-overload]
        loaded, error = run_one(lambda: exec(code, ns))
        for i, name in enumerate(orders["names"]):  # type: ignore[arg-type]
            fn = ns.get(name)
            if not loaded:
                report.verdict(i, False, f"the test module failed: {error}")
            elif not _defined_by_tests(fn):
                report.verdict(i, False, f"{name} is not the test module's function after "
                                         "the module ran (replaced by the solution's?)")
            else:
                report.verdict(i, *run_one(fn))  # type: ignore[arg-type]
    report.line("done")


def _defined_by_tests(fn: object) -> bool:
    """A plain function compiled from the test module -- not a stand-in for a solution
    function of the same name that ``from solution import *`` brought in."""
    return (type(fn) is type(_defined_by_tests)
            and fn.__code__.co_filename == "tests.py")  # type: ignore[attr-defined]


def start_server(program: str, limit: int, sys_path: list[str]) -> Link:
    """Start the solution server: stdio on /dev/null, SIGINT back to its default, and of
    our descriptors only its two pipe ends (every other one is close-on-exec)."""
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            import _signal

            _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.set_inheritable(req_r, True)
            os.set_inheritable(rep_w, True)
            os.execv(sys.executable, [sys.executable, "-I", "-S", "-B", "-c", program,
                                      str(req_r), str(rep_w), *sys_path])
        finally:
            os._exit(127)
    os.close(req_r)
    os.close(rep_w)
    return Link(pid, req_w, rep_r, limit)


def _make_undumpable() -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def main() -> None:
    import _signal  # the built-in behind `signal`, which would import enum (slow)

    _signal.signal(_signal.SIGINT, _signal.SIG_IGN)
    _make_undumpable()
    orders = wire.loads(sys.stdin.buffer.read())
    if type(orders) is not dict:
        raise TypeError("the test orders must be a dict")
    report = Reporter(orders["nonce"])  # type: ignore[arg-type]
    for name in orders["imports"]:  # type: ignore[attr-defined]
        try:  # before the solution runs; a module that is missing fails when used
            __import__(name)
        except Exception:
            pass
    link = start_server(orders["server"], orders["reply_limit"],  # type: ignore[arg-type]
                        orders["sys_path"])  # type: ignore[arg-type]
    try:
        run_all(orders, link, report)
    except HarnessStop as stop:
        report.line(f"harness {_one_line(str(stop))}")
    finally:
        link.stop("the test run ended")
