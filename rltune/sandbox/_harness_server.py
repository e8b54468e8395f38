"""The solution side of a test run: loads ``solution.py`` and answers requests about it.

Runs inside the sandbox as its own interpreter, started by the test runner
(:mod:`rltune.sandbox._harness_runner`) with ``python -I -S -B -c PROGRAM REQ_FD REP_FD
[SYS_PATH...]``, stdin/stdout/stderr on ``/dev/null``. It never sees the tests: it only
receives requests (call this, get that attribute, iterate this) with the tests' *inputs*,
and answers with values (:mod:`rltune.sandbox.wire`) or handles to objects it keeps.

Nothing here is trusted by the runner: the solution shares this process and can rewrite
any of it. Its only power is to choose the values it answers with.

Messages (each a wire-encoded tuple):

- first, to the runner: ``("hello", {name: value or handle}, {name: module name})`` for
  the module's top-level names (modules apart: the runner binds its own copy of a
  standard-library module rather than a handle to the solution's), or
  ``("load_error", error)`` when loading failed;
- requests: ``(op, handle, *operands)`` with ``op`` one of :data:`OPS`;
- replies: ``("ok", value, copy_back)``, ``("err", error)`` or ``("stop",)`` (``next`` on
  an exhausted iterator). ``copy_back`` lists ``(position or name, value)`` for the list,
  dict, set and bytearray arguments of a call, so in-place changes reach the caller.
  ``error`` is ``(type name, is a built-in type, message)``.
"""

from __future__ import annotations

import os
import sys

from rltune.sandbox import wire

MAX_REQUEST = 64 * 1024 * 1024
MAX_EXPORT_VALUE = 1024 * 1024
"""A top-level value larger than this (encoded) is announced as a handle, not copied."""
_MUTABLE = (list, dict, set, bytearray)

OPS = ("call", "getattr", "setattr", "getitem", "setitem", "delitem", "len", "bool",
       "iter", "next", "str", "repr", "float", "int")


class Opaque:
    """Wraps an object that must travel as a handle even if it looks like a value."""

    def __init__(self, obj: object) -> None:
        self.obj = obj


class Handles:
    """Objects the runner holds handles to, by id; kept alive for the whole run."""

    def __init__(self) -> None:
        self.objects: list[object] = []
        self.ids: dict[int, int] = {}

    def ref(self, obj: object) -> tuple[int, str]:
        if type(obj) is Opaque:
            obj = obj.obj
        key = id(obj)
        if key not in self.ids:
            self.ids[key] = len(self.objects)
            self.objects.append(obj)
        return self.ids[key], type(obj).__qualname__

    def get(self, ref: int, _name: str) -> object:
        if not 0 <= ref < len(self.objects):
            raise wire.WireError(f"no object with handle {ref}")
        return self.objects[ref]


def describe(exc: BaseException) -> tuple[str, bool, str]:
    """(type name, whether it is the built-in type of that name, message)."""
    cls = type(exc)
    builtin = cls.__module__ == "builtins"
    try:
        message = str(exc)
    except BaseException:  # a solution-defined __str__ may do anything
        message = "<unprintable>"
    return cls.__name__, builtin, message[:2000]


def load(path: str) -> object:
    """Execute ``path`` as the module ``solution`` (not ``__main__``: a
    ``if __name__ == "__main__":`` block in it does not run)."""
    module = type(sys)("solution")
    module.__file__ = path
    sys.modules["solution"] = module
    with open(path, encoding="utf-8") as fh:
        source = fh.read()
    exec(compile(source, path, "exec"), module.__dict__)
    return module


def serve_one(request: object, handles: Handles) -> tuple[object, ...]:
    """Carry out one request; the solution's exceptions (all of them, ``SystemExit``
    and ``KeyboardInterrupt`` included) become an ``err`` reply."""
    if not (isinstance(request, tuple) and len(request) >= 2 and request[0] in OPS):
        return ("err", ("ProtocolError", False, f"bad request {str(request)[:200]}"))
    op, obj, *rest = request
    try:
        if op == "call":
            args, kwargs = rest
            value = obj(*args, **kwargs)  # type: ignore[operator]
            back = [(i, a) for i, a in enumerate(args) if type(a) in _MUTABLE]
            back += [(k, a) for k, a in kwargs.items() if type(a) in _MUTABLE]
            return ("ok", value, back)
        if op == "next":
            try:
                return ("ok", next(obj), [])  # type: ignore[call-overload]
            except StopIteration:
                return ("stop",)
        return ("ok", _simple(op, obj, rest), [])
    except BaseException as exc:
        return ("err", describe(exc))


def _simple(op: str, obj: object, rest: list[object]) -> object:
    if op == "getattr":
        return getattr(obj, str(rest[0]))
    if op == "setattr":
        return setattr(obj, str(rest[0]), rest[1])
    if op == "getitem":
        return obj[rest[0]]  # type: ignore[index]
    if op == "setitem":
        obj[rest[0]] = rest[1]  # type: ignore[index]
        return None
    if op == "delitem":
        del obj[rest[0]]  # type: ignore[attr-defined]
        return None
    conversions = {"len": len, "bool": bool, "iter": iter, "str": str, "repr": repr,
                   "float": float, "int": int}
    return conversions[op](obj)  # type: ignore[operator]


def encode_reply(reply: tuple[object, ...], handles: Handles) -> bytes:
    """Encode ``reply``; a value that cannot be encoded (too deep, a conversion raising)
    is the solution's error, reported as such."""
    try:
        return wire.dumps(reply, handles.ref)
    except BaseException as exc:
        return wire.dumps(("err", describe(exc)))


def main() -> None:
    req_fd, rep_fd = int(sys.argv[1]), int(sys.argv[2])
    handles = Handles()
    try:
        module = load("solution.py")
    except BaseException as exc:
        wire.send(rep_fd, wire.dumps(("load_error", describe(exc))))
        return
    exports: dict[str, object] = {}
    modules: dict[str, str] = {}
    for name, value in list(vars(module).items()):
        if name.startswith("__"):
            continue
        if type(value) is type(sys):
            modules[name] = str(getattr(value, "__name__", ""))
            continue
        try:  # a value that does not encode (too deep, odd subclass) or is large
            fits = len(wire.dumps(value, handles.ref)) <= MAX_EXPORT_VALUE
        except BaseException:
            fits = False
        exports[name] = value if fits else Opaque(value)  # ... goes as a handle
    wire.send(rep_fd, encode_reply(("hello", exports, modules), handles))
    reader = os.fdopen(req_fd, "rb")
    while True:
        payload = wire.receive(reader, MAX_REQUEST)
        if payload is None:
            return
        try:
            request = wire.loads(payload, handles.get)
        except wire.WireError as exc:
            wire.send(rep_fd, wire.dumps(("err", ("ProtocolError", False, str(exc)))))
            continue
        wire.send(rep_fd, encode_reply(serve_one(request, handles), handles))
