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
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
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
    uid_processes,
    unshare_args,
    user_task_count,
)

LimitHit = Literal["wall", "cpu", "memory", "file", "output"]

_BOOT = Path(__file__).with_name("_boot.py")
_PY_FLAGS = ("-I", "-S", "-B")
_READ_CHUNK = 1 << 16
_KILL_GRACE_S = 5.0
"""How long a killed sandbox may take to disappear before that is an error."""
_EOF_GRACE_S = 1.0
"""After the program exits, how long its output pipes may stay open (``rlimits-only``:
a descendant that escaped the kill can hold them) before they are abandoned."""


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
        uid = stack.enter_context(lease_uid()) if as_root else None
        launch = _launch(mechanism, interp, limits, uid)
        if launch.host_dir is not None:
            stack.callback(shutil.rmtree, launch.host_dir, True)
        launch.spec.update(files=files, rlimits=_rlimits(mechanism, limits, uid))
        proc, status_r = _spawn(launch)
        with contextlib.closing(_Watch(proc, status_r)) as watch:
            try:
                io = watch.communicate(stdin, limits, deadline=start + limits.wall_s,
                                       on_exit=_leftover_killer(mechanism, uid, proc.pid))
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
        argv = ["unshare", *unshare_args(), "--", *command]
        return _Launch(argv, WORKDIR, _environment(WORKDIR, "/tmp"), spec)
    if uid is not None:
        _check_world_readable(interp)
        # Without namespaces, processes of this uid can outlive a host that was killed
        # mid-run: clear the uid before lending it to a new run.
        _wait_uid_gone(uid)
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


# --------------------------------------------------------------------------- watching


@dataclass
class _Io:
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    status: bytearray = field(default_factory=bytearray)
    truncated: bool = False
    killed_for: LimitHit | None = None


class _Watch:
    """Feeds stdin, collects capped output and the status lines, enforces the wall clock
    and the output cap, and finally kills and reaps everything the run left."""

    def __init__(self, proc: subprocess.Popen[bytes], status_r: int) -> None:
        self.proc = proc
        self.status_r = status_r
        self.pidfd = os.pidfd_open(proc.pid)
        self.rusage_cpu: float | None = None

    def communicate(self, stdin: bytes, limits: Limits, *, deadline: float,
                    on_exit: Callable[[], None]) -> _Io:
        """Run the loop until the program exited and its output pipes closed, the wall
        clock ran out (``killed_for="wall"``) or an output went past its cap
        (``killed_for="output"``). ``on_exit`` runs once, when the sandbox's own process
        has exited (rlimits-only kills the program's leftovers there, so pipes close)."""
        io = _Io()
        proc = self.proc
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        sel = selectors.DefaultSelector()
        buffers = {proc.stdout.fileno(): io.stdout, proc.stderr.fileno(): io.stderr,
                   self.status_r: io.status}
        for fd in (*buffers, self.pidfd):
            sel.register(fd, selectors.EVENT_READ)
        pending = memoryview(stdin)
        stdin_fd = proc.stdin.fileno()
        if pending:
            os.set_blocking(stdin_fd, False)
            sel.register(stdin_fd, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        end = deadline
        exited = False
        try:
            while not (exited and buffers.keys().isdisjoint(sel.get_map())):
                now = time.monotonic()
                if now >= end:
                    io.killed_for = None if exited else "wall"
                    break
                for key, _ in sel.select(timeout=end - now):
                    if key.fd == self.pidfd:
                        sel.unregister(self.pidfd)
                        exited, end = True, time.monotonic() + _EOF_GRACE_S
                        on_exit()
                    elif key.fd == stdin_fd:
                        pending = self._feed(sel, stdin_fd, pending)
                    elif not self._read(sel, key.fd, buffers[key.fd], io, limits):
                        io.killed_for = "output"
                        return io
        finally:
            sel.close()
            if not proc.stdin.closed:
                proc.stdin.close()
        return io

    def _feed(self, sel: selectors.BaseSelector, fd: int, pending: memoryview) -> memoryview:
        try:
            pending = pending[os.write(fd, pending[:_READ_CHUNK]):]
        except BlockingIOError:
            return pending
        except BrokenPipeError:  # the program closed stdin: what it did not read is lost
            pending = pending[:0]
        if not pending:
            sel.unregister(fd)
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        return pending

    def _read(self, sel: selectors.BaseSelector, fd: int, buf: bytearray, io: _Io,
              limits: Limits) -> bool:
        """Read what is there; False when the output cap was passed."""
        chunk = os.read(fd, _READ_CHUNK)
        if not chunk:
            sel.unregister(fd)
            return True
        room = limits.output_bytes - len(buf) if fd != self.status_r else len(chunk)
        buf += chunk[:room]
        if len(chunk) > room:
            io.truncated = True
            return False
        return True

    def finish(self, mechanism: Mechanism, uid: int | None) -> None:
        """Kill whatever is left of the run, reap the sandbox and wait until every process
        of the run is gone (so a leased uid is free again).

        Namespaced runs: the namespace's PID 1 is killed directly and awaited; it exits
        only after the kernel has killed and reaped every other process in its namespace,
        so its exit proves the run is gone. rlimits-only as root: every process of the
        run's uid. rlimits-only otherwise: the process group (a descendant that made
        itself a new session escapes; see docs/sandbox.md)."""
        namespaced = mechanism != "rlimits-only"
        pidfds = [fd for fd in map(_pidfd_or_none, _children(self.proc.pid)) if fd is not None
                  ] if namespaced else []
        try:
            for fd in pidfds:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            _, status, usage = os.wait4(self.proc.pid, 0)
            self.proc.returncode = os.waitstatus_to_exitcode(status)
            self.rusage_cpu = usage.ru_utime + usage.ru_stime
            if not all(_wait_readable(fd) for fd in pidfds):
                raise SandboxError(f"a sandbox did not exit within {_KILL_GRACE_S} s of SIGKILL")
            if uid is not None and not namespaced:
                _wait_uid_gone(uid)
        finally:
            for fd in pidfds:
                os.close(fd)

    def close(self) -> None:
        os.close(self.pidfd)
        os.close(self.status_r)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _pidfd_or_none(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


def _wait_readable(fd: int) -> bool:
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        return bool(sel.select(timeout=_KILL_GRACE_S))


def _leftover_killer(mechanism: Mechanism, uid: int | None, pgid: int) -> Callable[[], None]:
    """What to do the moment the sandbox's process exits. Namespaced: nothing (the
    namespace is already gone). rlimits-only: kill the program's descendants, which may
    hold its output pipes open."""
    def kill() -> None:
        if mechanism != "rlimits-only":
            return
        if uid is not None:
            _kill_uid(uid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    return kill


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid``: ``kill(-1)`` run *as* that uid reaches exactly
    its processes, whatever sessions or process groups they made for themselves."""
    try:
        subprocess.run(["kill", "-9", "-1"], user=uid, group=uid, extra_groups=[],
                       env={"PATH": "/usr/bin:/bin"}, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False, timeout=_KILL_GRACE_S)
    except FileNotFoundError as exc:
        raise SandboxError("rlimits-only as root needs the `kill` command (procps or "
                           "util-linux) to end the processes of a run") from exc


def _wait_uid_gone(uid: int) -> None:
    """Kill the processes of ``uid`` until there are none (zombies aside)."""
    end = time.monotonic() + _KILL_GRACE_S
    while uid_processes(uid):
        if time.monotonic() > end:
            raise SandboxError(f"processes of sandbox uid {uid} survived SIGKILL")
        _kill_uid(uid)
        time.sleep(0.005)


# --------------------------------------------------------------------------- result


def _result(mechanism: Mechanism, io: _Io, watch: _Watch, limits: Limits, *,
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

