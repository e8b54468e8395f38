"""Plain values across a process boundary, rebuilt with exact built-in types.

The test runner and the solution server of :mod:`rltune.sandbox.tests` talk through pipes
in this format. What matters is the direction solution -> tests: whatever the solution
sends is decoded into objects of *exact* built-in types (``int``, ``str``, ``list``, ...)
built by the test process itself, so a comparison in a test runs the interpreter's own
``__eq__`` on values and never code the solution wrote. An object that is not a plain
value travels as a *handle* (an id and a type name) and stays on the solution's side.

Grammar (one value; lengths and counts in decimal ASCII, numbers in hex)::

    N  T  F                      None, True, False
    i<hex>;                      int (any size: hex conversion has no digit limit)
    f<float.hex>;                float (inf, nan and -0.0 included)
    c<float.hex>;<float.hex>;    complex
    s<len>:<utf-8>  b<len>:<bytes>  y<len>:<bytes>      str, bytes, bytearray
    l<n>: t<n>: S<n>: Z<n>:  + n values                  list, tuple, set, frozenset
    d<n>:  + n key, value pairs                          dict
    q<hex>;<hex>;                Fraction (numerator; denominator)
    D<len>:<text>                Decimal
    x<id>;<len>:<type name>      handle

Standard library only, and nothing imported at module level beyond ``sys``: this module
runs inside the sandbox, where every import costs start-up time.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # typing costs start-up time inside the sandbox; mypy reads this
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import BinaryIO

    Encoder = Callable[[object], tuple[int, str]]
    Decoder = Callable[[int, str], object]

MAX_DEPTH = 100
"""Deepest nesting accepted either way (a deeper value is refused, not a crash)."""


class WireError(ValueError):
    """A value that cannot be sent, or bytes that are not a valid message."""


# --------------------------------------------------------------------------- encoding


_EXACT = frozenset({type(None), bool, int, float, complex, str, bytes, bytearray, list,
                    tuple, set, frozenset, dict})


def dumps(value: object, handle: Encoder | None = None, *, exact: bool = False) -> bytes:
    """Encode ``value``; ``handle(obj) -> (id, type name)`` stands in for anything that is
    not a plain value (without it such an object is a :class:`WireError`).

    Subclasses of built-in types are sent as their base type's value (a ``namedtuple`` as
    a tuple, an ``IntEnum`` member as an int, a ``defaultdict`` as a dict): the receiver
    compares the value, never the subclass's methods. ``exact=True`` refuses them instead
    (the tests' side: a ``Counter`` passed to the solution must not silently arrive as a
    plain ``dict``)."""
    out: list[bytes] = []
    _dump(value, out, handle, 0, exact)
    return b"".join(out)


def _dump(v: object, out: list[bytes], handle: Encoder | None, depth: int,
          exact: bool) -> None:
    if depth > MAX_DEPTH:
        raise WireError("value nested too deeply")
    t = type(v)
    if exact and t not in _EXACT and not _is_fraction(t) and not _is_decimal(t):
        if handle is None:
            raise WireError(f"cannot send a {t.__name__} object (only values of exact "
                            "built-in types)")
        ref, name = handle(v)
        out.append(b"x%d;" % ref)
        _blob(out, b"", str(name).encode("utf-8", "replace"))
    elif v is None:
        out.append(b"N")
    elif t is bool:
        out.append(b"T" if v else b"F")
    elif isinstance(v, int):
        out.append(b"i%s;" % format(int.__int__(v), "x").encode())
    elif isinstance(v, float):
        out.append(b"f%s;" % float.hex(float.__float__(v)).encode())
    elif isinstance(v, complex):
        c = complex(v)  # type: ignore[arg-type]
        out.append(b"c%s;%s;" % (c.real.hex().encode(), c.imag.hex().encode()))
    elif isinstance(v, str):
        _blob(out, b"s", str.__str__(v).encode("utf-8", "surrogatepass"))
    elif isinstance(v, bytes):
        _blob(out, b"b", bytes.__getitem__(v, slice(None)))
    elif isinstance(v, bytearray):
        _blob(out, b"y", bytes(v))
    elif isinstance(v, dict):
        items = list(dict.items(v))
        out.append(b"d%d:" % len(items))
        for key, item in items:
            _dump(key, out, handle, depth + 1, exact)
            _dump(item, out, handle, depth + 1, exact)
    elif isinstance(v, (list, tuple, set, frozenset)):
        tag = (b"l" if isinstance(v, list) else b"t" if isinstance(v, tuple)
               else b"S" if isinstance(v, set) else b"Z")
        items = list(v)
        out.append(b"%s%d:" % (tag, len(items)))
        for item in items:
            _dump(item, out, handle, depth + 1, exact)
    elif _is_fraction(t):
        out.append(b"q%s;%s;" % (format(v.numerator, "x").encode(),
                                 format(v.denominator, "x").encode()))
    elif _is_decimal(t):
        _blob(out, b"D", str(v).encode("ascii"))
    elif _is_numpy_scalar(v):
        _dump(v.item(), out, handle, depth, exact)
    elif handle is not None:
        ref, name = handle(v)
        out.append(b"x%d;" % ref)
        _blob(out, b"", str(name).encode("utf-8", "replace"))
    else:
        raise WireError(f"cannot send a {t.__name__} object (only plain values)")


def _blob(out: list[bytes], tag: bytes, data: bytes) -> None:
    out.append(b"%s%d:" % (tag, len(data)))
    out.append(data)


def _is_fraction(t: type) -> bool:
    module = sys.modules.get("fractions")
    return module is not None and t is module.Fraction


def _is_decimal(t: type) -> bool:
    module = sys.modules.get("decimal")
    return module is not None and t is module.Decimal


def _is_numpy_scalar(v: object) -> bool:
    """A numpy scalar (``np.int64(3)``) is sent as its Python value. Whatever ``item()``
    returns is only a value, so a fake "numpy" class gains nothing."""
    return type(v).__module__ == "numpy" and hasattr(v, "item") and hasattr(v, "dtype")


# --------------------------------------------------------------------------- decoding


def loads(data: bytes, handle: Decoder | None = None, *, max_depth: int = MAX_DEPTH) -> object:
    """Decode one value that must fill ``data`` exactly. ``handle(id, type name)`` turns
    a handle into an object (without it a handle is a :class:`WireError`). Every
    malformed input, and nesting deeper than ``max_depth``, raises :class:`WireError`,
    never anything else."""
    if not isinstance(data, bytes):
        raise WireError("a message must be bytes")
    try:
        value, end = _load(data, 0, handle, max_depth)
    except WireError:
        raise
    except (ValueError, TypeError, IndexError, ArithmeticError, RecursionError,
            MemoryError) as exc:  # an unhashable set element, a zero denominator...
        raise WireError(f"malformed message: {type(exc).__name__}: {exc}") from None
    if end != len(data):
        raise WireError(f"{len(data) - end} stray bytes after the value")
    return value


def _number(data: bytes, pos: int, sep: bytes = b";") -> tuple[str, int]:
    end = data.index(sep, pos)
    return data[pos:end].decode("ascii"), end + 1


def _count(data: bytes, pos: int) -> tuple[int, int]:
    text, pos = _number(data, pos, b":")
    if not text.isdigit() or len(text) > 12:
        raise WireError(f"bad length {text[:20]!r}")
    return int(text), pos


def _bytes_at(data: bytes, pos: int) -> tuple[bytes, int]:
    n, pos = _count(data, pos)
    if pos + n > len(data):
        raise WireError("truncated message")
    return data[pos:pos + n], pos + n


def _hex_int(text: str) -> int:
    body = text[1:] if text[:1] == "-" else text
    if not body or not all(ch in "0123456789abcdef" for ch in body):
        raise WireError(f"bad integer {text[:20]!r}")
    return int(text, 16)


_CONSTANTS: dict[bytes, object] = {b"N": None, b"T": True, b"F": False}


def _load(data: bytes, pos: int, handle: Decoder | None, room: int) -> tuple[object, int]:
    """One value at ``pos``; ``room``: how many more levels of nesting are allowed."""
    if room < 0:
        raise WireError("value nested too deeply")
    if pos >= len(data):
        raise WireError("truncated message")
    tag = data[pos:pos + 1]
    pos += 1
    if tag in _CONSTANTS:
        return _CONSTANTS[tag], pos
    if tag in (b"i", b"f", b"c", b"q"):
        return _load_number(tag, data, pos)
    if tag in (b"s", b"b", b"y", b"D"):
        raw, pos = _bytes_at(data, pos)
        if tag == b"s":
            return raw.decode("utf-8", "surrogatepass"), pos
        if tag == b"D":
            import decimal

            return decimal.Decimal(raw.decode("ascii")), pos
        return (raw if tag == b"b" else bytearray(raw)), pos
    if tag in (b"l", b"t", b"S", b"Z", b"d"):
        return _load_container(tag, data, pos, handle, room)
    if tag == b"x":
        text, pos = _number(data, pos)
        if not text.isdigit():
            raise WireError(f"bad handle id {text[:20]!r}")
        name, pos = _bytes_at(data, pos)
        if handle is None:
            raise WireError("unexpected handle")
        return handle(int(text), name.decode("utf-8", "replace")), pos
    raise WireError(f"unknown tag {tag!r} at byte {pos - 1}")


def _load_number(tag: bytes, data: bytes, pos: int) -> tuple[object, int]:
    """The int (``i``), float (``f``), complex (``c``) or Fraction (``q``) after ``tag``."""
    text, pos = _number(data, pos)
    if tag == b"i":
        return _hex_int(text), pos
    if tag == b"f":
        return float.fromhex(text), pos
    second, pos = _number(data, pos)
    if tag == b"c":
        return complex(float.fromhex(text), float.fromhex(second)), pos
    import fractions

    return fractions.Fraction(_hex_int(text), _hex_int(second)), pos


def _load_container(tag: bytes, data: bytes, pos: int, handle: Decoder | None,
                    room: int) -> tuple[object, int]:
    """The list, tuple, set, frozenset (``l t S Z``: a count, then the items) or dict
    (``d``: a count, then key and value in turn) after ``tag``, one level deeper."""
    n, pos = _count(data, pos)
    if tag == b"d":
        out = {}
        for _ in range(n):
            key, pos = _load(data, pos, handle, room - 1)
            out[key], pos = _load(data, pos, handle, room - 1)
        return out, pos
    items = []
    for _ in range(n):
        item, pos = _load(data, pos, handle, room - 1)
        items.append(item)
    kind = {b"l": list, b"t": tuple, b"S": set, b"Z": frozenset}[tag]
    return (items if kind is list else kind(items)), pos


# --------------------------------------------------------------------------- framing


def send(fd: int, payload: bytes) -> None:
    """Write one framed message (``<length>\\n<payload>``) to ``fd``."""
    import os

    view = memoryview(b"%d\n" % len(payload) + payload)
    while view:
        view = view[os.write(fd, view):]


def receive(reader: BinaryIO, limit: int) -> bytes | None:
    """Read one framed message from the binary file ``reader``: None at end of file,
    :class:`WireError` for a malformed frame or one longer than ``limit`` bytes."""
    header = reader.readline(24)
    if not header:
        return None
    if not header.endswith(b"\n") or not header[:-1].isdigit():
        raise WireError(f"bad frame header {header[:24]!r}")
    n = int(header)
    if n > limit:
        raise WireError(f"message of {n} bytes is over the {limit}-byte limit")
    payload = reader.read(n)
    if len(payload) != n:
        raise WireError("message cut short (the sender died?)")
    return payload
