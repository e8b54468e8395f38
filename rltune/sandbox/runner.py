"""Run untrusted Python in a sandbox with hard limits: :func:`run_python`.

Each run gets a private working directory, no network, a read-only view of the system and
of the Python installation only, a minimal environment, its own PID namespace (or uid)
killed as a whole when the run ends, and capped output. The mechanism is the best one this
machine gives (:func:`isolation`); ``docs/sandbox.md`` lists what each one isolates, and
what the ``rlimits-only`` fallback does not.

Per-call overhead is one ``bwrap``/``unshare`` start plus one interpreter start
(``python -I -S -B``): the program runs in the interpreter that set the sandbox up.
"""

from __future__ import annotations

import contextlib
import functools
import marshal
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

from rltune.sandbox.mechanisms import (
    MECHANISMS,
    WORKDIR,
    Interpreter,
    Mechanism,
    SandboxError,
    bwrap_args,
    layout,
    lease_uid,
    mountpoint,
    probe_interpreter,
    unavailable_reason,
    unshare_argv,
    user_task_count,
)
from rltune.sandbox.watch import Io, Watch, leftover_killer, wait_uid_gone

LimitHit = Literal["wall", "cpu", "memory", "file", "output"]

_BOOT = Path(__file__).with_name("_boot.py")
_PY_FLAGS = ("-I", "-S", "-B")


@dataclass(frozen=True)
class Limits:
    """Hard limits of one run. Sizes in MiB unless named otherwise."""

    cpu_s: float = 5.0
    """CPU seconds per process (``RLIMIT_CPU``, rounded up to whole seconds; ``SIGXCPU`` at
    the limit, ``SIGKILL`` one second later)."""
    wall_s: float = 10.0
    """Wall-clock seconds from the start of the call, sandbox start-up included; past it
    the whole sandbox (namespace, or every process of the run's uid) is killed."""
    memory_mb: int = 512
    """Address space per process (``RLIMIT_AS``): an allocation past it fails
    (``MemoryError`` in Python)."""
    file_mb: int = 16
    """Largest file a process may write (``RLIMIT_FSIZE``)."""
    processes: int = 16
    """Processes and threads of the run together (``RLIMIT_NPROC`` of its private uid)."""
    output_bytes: int = 65536
    """Bytes kept of stdout and of stderr each. A stream that goes past it gets the run
    killed (an output flood would otherwise cost the host its reading time)."""
    disk_mb: int = 64
    """Size of each tmpfs (``/sandbox``, ``/tmp``, ``/dev/shm``) in the namespaced
    mechanisms: the total a run can store, not only the largest file."""

    def __post_init__(self) -> None:
        for name in ("cpu_s", "wall_s", "memory_mb", "file_mb", "processes",
                     "output_bytes", "disk_mb"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"Limits.{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class SandboxResult:
    """What a run did. ``exit_code`` is the program's status: ``-N`` when a signal ``N``
    ended it, None when the sandbox killed it (``limit_hit`` says why)."""

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool
    """Ended by the wall-clock or the CPU limit."""
    limit_hit: LimitHit | None
    """The limit that ended or marked the run. ``wall``, ``cpu`` and ``output`` are
    observed by the host; ``memory`` and ``file`` are read from the program's own last
    error line (``MemoryError``; ``File too large``, or death by ``SIGXFSZ``) and are
    labels for people, not evidence."""
    seconds: float
    """Wall-clock seconds of the whole call."""
    isolation: Mechanism
    cpu_seconds: float | None = None
    """CPU time of the program and the children it waited for, when it exited."""
    truncated: bool = False
    """stdout or stderr went past ``Limits.output_bytes``."""


# --------------------------------------------------------------------------- public API


def run_python(
    code: str,
    *,
    stdin: str | bytes = "",
    files: Mapping[str, str] | None = None,
    limits: Limits = Limits(),
    python: str = sys.executable,
    mechanism: Mechanism | None = None,
) -> SandboxResult:
    """Run ``code`` as ``main.py`` with ``python -I -S -B`` in a sandbox.

    ``stdin`` is fed to the program (``str`` as UTF-8) and then closed. ``files`` are
    written next to it first (relative paths; ``main.py`` is taken).
    ``mechanism`` forces one of :data:`MECHANISMS` (default: :func:`isolation`); one that
    does not work here raises :class:`SandboxError`. The program's failures (exceptions,
    limits, signals) are in the result; only the sandbox's own failures raise.
    """
    chosen = isolation() if mechanism is None else mechanism
    if chosen not in MECHANISMS:
        raise ValueError(f"mechanism must be one of {MECHANISMS}, got {chosen!r}")
    if mechanism is not None:
        reason = _unavailable(mechanism)
        if reason is not None:
            raise SandboxError(f"sandbox mechanism {mechanism!r} is not available: {reason}")
    if chosen == "rlimits-only":
        _warn_rlimits_only()
    all_files = {"main.py": code, **_checked_files(files)}
    data = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
    return _execute(chosen, all_files, data, limits, probe_interpreter(python))


@functools.lru_cache(maxsize=1)
def isolation() -> Mechanism:
    """The mechanism this machine gives, decided once per process: ``bwrap`` if it runs a
    trial program, else ``unshare``, else ``rlimits-only`` (with a warning)."""
    for mechanism in ("bwrap", "unshare"):
        if _unavailable(mechanism) is None:
            return mechanism
    _warn_rlimits_only()
    return "rlimits-only"


def unavailable(mechanism: Mechanism) -> str | None:
    """Why ``mechanism`` does not work here (None when it does), checked once by running
    a trial program under it."""
    return _unavailable(mechanism)


# --------------------------------------------------------------------------- choosing


@functools.lru_cache(maxsize=None)
def _unavailable(mechanism: Mechanism) -> str | None:
    reason = unavailable_reason(mechanism)
    if reason is not None or mechanism == "rlimits-only":
        return reason
    try:
        result = _execute(mechanism, {"main.py": "print('ok')"}, b"",
                          Limits(wall_s=30.0), probe_interpreter(sys.executable))
    except SandboxError as exc:
        return str(exc)
    if result.exit_code != 0 or result.stdout != "ok\n":
        return f"trial run failed (exit {result.exit_code}): {result.stderr.strip()[-500:]}"
    return None


_warned = False
_warn_lock = threading.Lock()


def _warn_rlimits_only() -> None:
    global _warned
    with _warn_lock:
        if _warned:
            return
        _warned = True
    reasons = "; ".join(f"{m}: {_unavailable(m) or 'works, not chosen'}"
                        for m in ("bwrap", "unshare"))
    warnings.warn(
        "code sandbox: running with resource limits only -- no namespaces, so sandboxed "
        "code can use the network, read files its uid can read and see other processes "
        "(see docs/sandbox.md); bubblewrap, or root for `unshare`, isolates. "
        f"Mechanisms here: {reasons}",
        RuntimeWarning, stacklevel=3,
    )


def _checked_files(files: Mapping[str, str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, text in (files or {}).items():
        path = PurePosixPath(name)
        if path.is_absolute() or ".." in path.parts or not path.parts or name != str(path):
            raise ValueError(f"files: {name!r} must be a plain relative path inside the "
                             "working directory")
        if name == "main.py":
            raise ValueError("files: 'main.py' is the program itself (pass it as `code`)")
        if not isinstance(text, str):
            raise ValueError(f"files[{name!r}] must be str, got {type(text).__name__}")
        out[name] = text
    return out


# --------------------------------------------------------------------------- one run


@dataclass
class _Launch:
    argv: list[str]
    workdir: str
    env: dict[str, str]
    spec: dict[str, object]
    host_dir: str | None = None
    """rlimits-only: the host directory serving as working directory (removed after)."""


def _execute(mechanism: Mechanism, files: dict[str, str], stdin: bytes, limits: Limits,
             interp: Interpreter) -> SandboxResult:
    start = time.monotonic()
    as_root = os.geteuid() == 0
    with contextlib.ExitStack() as stack:
        uid = stack.enter_context(lease_uid(wait_uid_gone)) if as_root else None
        launch = _launch(mechanism, interp, limits, uid)
        if launch.host_dir is not None:
            stack.callback(shutil.rmtree, launch.host_dir, True)
        launch.spec.update(files=files, rlimits=_rlimits(mechanism, limits, uid))
        proc, status_r = _spawn(launch)
        # Never return with the sandbox's process unreaped, even after an error: that
        # keeps it from running on unwatched, and keeps this thread, whose end would
        # fire its parent-death signal, alive for as long as the sandbox is.
        stack.callback(_reap, proc)
        with contextlib.closing(Watch(proc, status_r)) as watch:
            try:
                io = watch.communicate(stdin, limits.output_bytes,
                                       deadline=start + limits.wall_s,
                                       on_exit=leftover_killer(mechanism, uid, proc.pid))
            finally:
                watch.finish(mechanism, uid)
        result = _result(mechanism, io, watch, limits, seconds=time.monotonic() - start)
    return result


def _launch(mechanism: Mechanism, interp: Interpreter, limits: Limits,
            uid: int | None) -> _Launch:
    command = [interp.executable, *_PY_FLAGS, "-c", _boot_source()]
    spec: dict[str, object] = {"root": None, "init": mechanism != "rlimits-only",
                               "uid": uid, "gid": uid, "sys_path": list(interp.site)}
    if mechanism == "bwrap":
        argv = ["bwrap", *bwrap_args(layout(interp), as_root=uid is not None,
                                     disk_mb=limits.disk_mb), "--", *command]
        return _Launch(argv, WORKDIR, _environment(WORKDIR, "/tmp"), spec)
    if mechanism == "unshare":
        lay = layout(interp)
        spec["root"] = {"mountpoint": mountpoint(), "ro_binds": list(lay.ro_binds),
                        "symlinks": dict(lay.symlinks), "tmpfs_mb": limits.disk_mb,
                        "workdir": WORKDIR}
        argv = [*unshare_argv(), "--", *command]
        return _Launch(argv, WORKDIR, _environment(WORKDIR, "/tmp"), spec)
    if uid is not None:
        # (processes of this uid that outlived a host killed mid-run were cleared when
        # the uid was leased: see lease_uid)
        _check_world_readable(interp)
    host_dir = tempfile.mkdtemp(prefix="rltune-sandbox-")
    return _Launch(command, host_dir, _environment(host_dir, host_dir), spec, host_dir)


def _environment(home: str, tmp: str) -> dict[str, str]:
    """The whole environment of the sandbox (and of bwrap/unshare, so no host variable
    is readable through ``/proc/1/environ`` either)."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": tmp,
            "LANG": "C.UTF-8"}


def _rlimits(mechanism: Mechanism, limits: Limits, uid: int | None) -> dict[str, list[int]]:
    cpu = math.ceil(limits.cpu_s)
    mib = 1024 * 1024
    if uid is not None:  # a private uid: the program's processes are all it counts
        nproc = limits.processes
    elif mechanism == "bwrap":  # a user namespace: PID 1 (same uid) counts too
        nproc = limits.processes + 1
    else:  # the whole user's tasks count: allow that many more
        nproc = user_task_count() + limits.processes
    return {"cpu": [cpu, cpu + 1], "as": [limits.memory_mb * mib] * 2,
            "fsize": [limits.file_mb * mib] * 2, "nproc": [nproc] * 2, "core": [0, 0]}


def _check_world_readable(interp: Interpreter) -> None:
    """rlimits-only as root drops to a private uid with no namespace to re-mount the
    interpreter: every directory on the way to it must be searchable by any user."""
    for path in map(Path, (interp.executable, *interp.prefixes, *interp.site)):
        for part in [*reversed(path.parents), path]:
            if not part.stat().st_mode & stat.S_IXOTH:
                raise SandboxError(
                    f"rlimits-only runs the program as an unprivileged uid, which cannot "
                    f"reach {path} ({part} is not searchable by other users); use a "
                    "world-readable interpreter, e.g. python=/usr/bin/python3")


@functools.lru_cache(maxsize=1)
def _boot_source() -> str:
    return _BOOT.read_text(encoding="utf-8")


def _spawn(launch: _Launch) -> tuple[subprocess.Popen[bytes], int]:
    """Start the sandbox; the spec travels in a memfd, the status comes back in a pipe."""
    status_r, status_w = os.pipe2(os.O_CLOEXEC)
    spec_fd = os.memfd_create("rltune-sandbox-spec")
    try:
        launch.spec.update(status_fd=status_w, workdir=launch.workdir)
        data = marshal.dumps(launch.spec)
        view = memoryview(data)
        while view:
            view = view[os.write(spec_fd, view):]
        os.lseek(spec_fd, 0, os.SEEK_SET)
        proc = subprocess.Popen(
            [*launch.argv, str(spec_fd)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, pass_fds=(spec_fd, status_w), env=launch.env,
            cwd="/", start_new_session=True,
        )
    except OSError as exc:
        os.close(status_r)
        raise SandboxError(f"cannot start the sandbox ({launch.argv[0]}): {exc}") from exc
    finally:
        os.close(spec_fd)
        os.close(status_w)
    return proc, status_r


def _reap(proc: subprocess.Popen[bytes]) -> None:
    """Kill and reap the sandbox's own process if :meth:`Watch.finish` did not get to
    (an error before or inside it). Killing it ends the sandbox: ``unshare``'s and
    ``bwrap``'s children die with them."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# --------------------------------------------------------------------------- result


def _result(mechanism: Mechanism, io: Io, watch: Watch, limits: Limits, *,
            seconds: float) -> SandboxResult:
    status = _status_messages(bytes(io.status))
    if "error" in status:
        raise SandboxError(f"{status['error']} ({mechanism}); stderr: {_tail(io.stderr)}")
    if "ready" not in status:
        if io.killed_for == "wall":
            raise SandboxError(f"the {mechanism} sandbox did not start within "
                               f"wall_s={limits.wall_s}")
        raise SandboxError(f"the {mechanism} sandbox failed to start (exit "
                           f"{watch.proc.returncode}): {_tail(io.stderr)}")
    if io.killed_for is not None:
        exit_code, cpu = None, None
    elif mechanism == "rlimits-only":
        exit_code, cpu = watch.proc.returncode, watch.rusage_cpu
    elif "exit" in status:
        code_text, cpu_text = status["exit"].split()
        exit_code, cpu = int(code_text), float(cpu_text)
    else:
        raise SandboxError(f"the {mechanism} sandbox ended without reporting the program's "
                           f"exit (exit {watch.proc.returncode}): {_tail(io.stderr)}")
    stderr = io.stderr.decode("utf-8", "replace")
    limit = io.killed_for or _limit_from_exit(exit_code, cpu, stderr, limits)
    return SandboxResult(
        exit_code=exit_code, stdout=io.stdout.decode("utf-8", "replace"), stderr=stderr,
        timed_out=limit in ("wall", "cpu"), limit_hit=limit, seconds=seconds,
        isolation=mechanism, cpu_seconds=cpu, truncated=io.truncated,
    )


def _status_messages(data: bytes) -> dict[str, str]:
    """The bootstrap's status lines (``ready``, ``exit CODE CPU``, ``error MESSAGE``) as
    {word: rest of the line}."""
    merged: dict[str, str] = {}
    for line in data.decode("utf-8", "replace").splitlines():
        word, _, rest = line.partition(" ")
        if word not in ("ready", "exit", "error"):
            raise SandboxError(f"unreadable sandbox status line {line[:200]!r}")
        merged[word] = rest
    return merged


def _limit_from_exit(exit_code: int | None, cpu: float | None, stderr: str,
                     limits: Limits) -> LimitHit | None:
    if exit_code == -signal.SIGXCPU or (
        exit_code == -signal.SIGKILL and cpu is not None and cpu >= math.ceil(limits.cpu_s)
    ):
        return "cpu"
    if exit_code == -signal.SIGXFSZ:
        return "file"
    if exit_code == 0 or exit_code is None:
        return None
    last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
    if last.startswith("MemoryError"):
        return "memory"
    if "File too large" in last:
        return "file"
    return None


def _tail(data: bytes | bytearray, n: int = 2000) -> str:
    return bytes(data[-n:]).decode("utf-8", "replace").strip() or "(no output)"

