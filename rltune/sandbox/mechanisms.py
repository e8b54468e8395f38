"""How a sandboxed run is started under each isolation mechanism, and which ones work here.

Three mechanisms, best first (``docs/sandbox.md`` has what each isolates):

- ``bwrap``: bubblewrap builds the namespaces and the read-only root; run as root it keeps
  only ``CAP_SETUID``, ``CAP_SETGID`` and ``CAP_CHOWN`` for the bootstrap to drop to the
  run's own uid; run as another user it works inside a user namespace.
- ``unshare``: util-linux ``unshare`` makes the network, PID, mount, IPC and UTS
  namespaces and the bootstrap builds the root itself (root only: without a user namespace
  an ordinary user may not make them); util-linux ``setpriv`` starts it, so that it dies
  with the host (:func:`unshare_argv`).
- ``rlimits-only``: no namespaces at all; resource limits, a private working directory
  and, as root, a private uid. Used where neither of the others works, never silently: the
  result says so and a warning is logged once.

A run started by root drops to a uid of its own, leased from a pool for the length of the
run (:func:`lease_uid`): ``RLIMIT_NPROC`` counts the processes *of a uid*, so a private uid
makes the process limit per run (a fork bomb in one sample cannot starve a concurrent
one), lets the host kill every process of the run by uid, and owns nothing on the machine.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import json
import os
import random
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Mechanism = Literal["bwrap", "unshare", "rlimits-only"]
MECHANISMS: tuple[Mechanism, ...] = ("bwrap", "unshare", "rlimits-only")

WORKDIR = "/sandbox"
"""The working directory inside the namespaced mechanisms (a size-capped tmpfs)."""

UID_BASE = 1_500_000_000
"""First uid of the pool: far from system, user and container (subuid) ranges."""
UID_SLOTS = 4096

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
"""Bound read-only (or recreated as symlinks, on merged-/usr systems) in every sandbox."""

PIVOT_ROOT_ARCHES = ("x86_64", "aarch64")
"""Machines whose ``pivot_root`` syscall number the bootstrap knows."""

_PROBE = (
    "import json, os, sys, sysconfig\n"
    "venv = sys.prefix != sys.base_prefix\n"
    "site = {sysconfig.get_path('purelib'), sysconfig.get_path('platlib')} if venv else set()\n"
    "print(json.dumps({'executable': os.path.realpath(sys.executable),\n"
    "                  'prefixes': sorted({os.path.realpath(sys.base_prefix),\n"
    "                                      os.path.realpath(sys.base_exec_prefix)}),\n"
    "                  'site': sorted(os.path.realpath(p) for p in site if os.path.isdir(p))}))\n"
)


class SandboxError(RuntimeError):
    """The sandbox itself failed (a mechanism that is not available, a program that
    could not be started, a broken setup) -- never a verdict on the program it runs."""


@dataclass(frozen=True)
class Interpreter:
    """What a sandbox needs to know about a Python interpreter to run it."""

    executable: str
    """Real path of the binary (a venv's ``bin/python`` resolved)."""
    prefixes: tuple[str, ...]
    """Installation directories: standard library, extension modules, ``libpython``."""
    site: tuple[str, ...]
    """A venv's site-packages, appended to ``sys.path`` inside; empty otherwise."""


@functools.lru_cache(maxsize=None)
def probe_interpreter(python: str) -> Interpreter:
    """Ask ``python`` where it lives (once per path)."""
    try:
        out = subprocess.run(
            [python, "-I", "-c", _PROBE], capture_output=True, text=True, timeout=60,
            check=True, env={"PATH": os.defpath},
        ).stdout
        info = json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        raise SandboxError(f"cannot run the sandbox interpreter {python!r}: {exc}") from exc
    return Interpreter(info["executable"], tuple(info["prefixes"]), tuple(info["site"]))


@dataclass(frozen=True)
class Layout:
    """The read-only part of a sandbox's file system: host paths seen at the same path."""

    ro_binds: tuple[str, ...]
    symlinks: tuple[tuple[str, str], ...]
    """(path, target) for top-level system directories that are symlinks (``/bin``)."""


def layout(interp: Interpreter) -> Layout:
    """System directories plus the interpreter's installation and site-packages, with
    nested duplicates removed (a prefix under ``/usr`` is already there)."""
    binds: list[str] = []
    links: list[tuple[str, str]] = []
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            links.append((path, os.readlink(path)))
        elif os.path.isdir(path):
            binds.append(path)
    for path in (*interp.prefixes, *interp.site):
        if not any(_within(path, b) for b in binds) and os.path.isdir(path):
            binds.append(path)
    return Layout(tuple(binds), tuple(links))


def _within(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def bwrap_args(lay: Layout, *, as_root: bool, disk_mb: int) -> list[str]:
    """Options of ``bwrap`` (before the command) for one run."""
    args = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--as-pid-1", "--new-session",
            "--cap-drop", "ALL"]
    if as_root:  # no user namespace: the bootstrap drops to the run's uid itself
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_CHOWN"]
    else:
        args += ["--unshare-user", "--disable-userns"]
    size = str(disk_mb * 1024 * 1024)
    # the tmpfs first, then the binds: an interpreter or venv that lives under /tmp stays
    # visible (read-only) inside the fresh /tmp
    args += ["--proc", "/proc", "--dev", "/dev",
             "--size", size, "--perms", "1777", "--tmpfs", "/dev/shm",
             "--size", size, "--perms", "0755", "--tmpfs", WORKDIR,
             "--size", size, "--perms", "1777", "--tmpfs", "/tmp"]
    made: set[str] = {"/tmp", WORKDIR}
    for path, target in lay.symlinks:
        args += ["--symlink", target, path]
    for path in lay.ro_binds:
        for parent in _ancestors(path):  # made 0755: bwrap would copy /root's 0700
            if parent not in made and not any(_within(parent, b) for b in lay.ro_binds):
                args += ["--perms", "0755", "--dir", parent]
                made.add(parent)
        args += ["--ro-bind", path, path]
    args += ["--remount-ro", "/", "--chdir", WORKDIR]
    return args


def _ancestors(path: str) -> list[str]:
    parts = Path(path).parts[1:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def unshare_argv() -> list[str]:
    """The command line before the bootstrap's: ``unshare`` and its options, started
    through ``setpriv`` so that it dies with the host.

    ``--kill-child`` ties the namespace's PID 1 to ``unshare`` (``unshare`` dying kills
    it, and the kernel then kills the rest of the namespace), but nothing ties ``unshare``
    to the host: were the host killed (``kill -9``, the OOM killer), ``unshare`` would be
    reparented to init and the program would run on with no wall clock. ``setpriv
    --pdeathsig KILL`` sets the parent-death signal before it execs ``unshare`` (it
    survives the exec; ``--pdeathsig`` needs util-linux 2.33, which the trial run of
    the mechanism checks), as ``bwrap --die-with-parent`` does for itself. A wrapper and not
    a ``preexec_fn``: that would make ``subprocess`` fork the whole host instead of using
    ``vfork`` (slow for a trainer's large address space) and run Python code in a child
    of a threaded process (the hazard ``subprocess`` warns of).

    The signal comes when the *thread* that started ``setpriv`` ends, not the process;
    :func:`rltune.sandbox.runner.run_python` starts the sandbox in the calling thread
    and does not return before it has reaped it, so that thread outlives the sandbox
    unless the whole host dies."""
    return ["setpriv", "--pdeathsig", "KILL", "--",
            "unshare", "--net", "--pid", "--fork", "--mount", "--ipc", "--uts",
            "--propagation", "private", "--kill-child"]


@functools.lru_cache(maxsize=1)
def mountpoint() -> str:
    """An empty host directory over which each ``unshare`` run mounts its new root, in its
    own mount namespace only (so one directory serves every run, concurrent or not)."""
    path = tempfile.mkdtemp(prefix="rltune-sandbox-root-")
    atexit.register(_remove_dir, path)
    return path


def _remove_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(path)


def unavailable_reason(mechanism: Mechanism) -> str | None:
    """Why ``mechanism`` cannot work on this machine, from static checks (binaries,
    privileges); None when it may. The runner then proves it with a trial run."""
    if mechanism == "bwrap":
        return None if shutil.which("bwrap") else "bubblewrap (`bwrap`) is not installed"
    if mechanism == "unshare":
        missing = [name for name in ("unshare", "setpriv") if shutil.which(name) is None]
        if missing:  # setpriv ends the sandbox with the host (see unshare_argv)
            names = " and ".join(f"`{name}`" for name in missing)
            return f"util-linux {names} {'is' if len(missing) == 1 else 'are'} not installed"
        if os.geteuid() != 0:
            return "`unshare` without a user namespace needs root"
        if os.uname().machine not in PIVOT_ROOT_ARCHES:
            return f"no pivot_root syscall number for {os.uname().machine}"
        return None
    return None


@contextlib.contextmanager
def lease_uid(clear: Callable[[int], None]) -> Iterator[int]:
    """A uid (and gid of the same number) no other run holds, for the ``with`` block.

    Leases are ``flock``s on files in a root-only directory, so they hold across threads
    and processes and are released even if this process dies. The lock is released at
    once then, but the dead host's sandbox may still be ending (or, for ``rlimits-only``,
    running on): its processes must not share the next run's ``RLIMIT_NPROC`` count (nor,
    under ``rlimits-only``, be killed by its cleanup). So a lease writes its holder's pid in the file and empties
    it only when the block ends without an exception (the run's processes are then known
    to be gone). A uid whose file is not empty is passed to ``clear`` first, which must
    kill its processes within a bounded time or raise :class:`SandboxError`; a uid that
    cannot be cleared is skipped. Checking only then keeps the scan of ``/proc`` (several
    milliseconds on a busy machine) off the common path."""
    lock_dir = Path(tempfile.gettempdir()) / "rltune-sandbox-uids"
    lock_dir.mkdir(mode=0o700, exist_ok=True)
    info = lock_dir.stat()
    if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise SandboxError(f"{lock_dir} must belong to uid {os.geteuid()} and not be "
                           "writable by others (it holds the sandbox uid leases)")
    start = random.randrange(UID_SLOTS)
    for i in range(UID_SLOTS):
        uid = UID_BASE + (start + i) % UID_SLOTS
        fd = _take_uid(lock_dir / str(uid), uid, clear)
        if fd is None:
            continue
        try:
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            yield uid
            # reached only when the block ended without an exception; after one, the
            # file keeps the pid, since the run may have left processes
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)
        return
    raise SandboxError(f"all {UID_SLOTS} sandbox uids are in use or cannot be cleared")


def _take_uid(path: Path, uid: int, clear: Callable[[int], None]) -> int | None:
    """The locked lease file of ``uid``, its leftovers cleared; None when another run
    holds it or its leftovers survived ``clear``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.pread(fd, 1, 0):  # the last holder did not end its run cleanly
            clear(uid)
    except (BlockingIOError, SandboxError):
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def uid_processes(uid: int) -> list[int]:
    """PIDs of the live (not zombie) processes whose real uid is ``uid``. A zombie is
    dead already; it waits for the host's init to reap it."""
    return [pid for pid, fields in _process_status()
            if _real_uid(fields) == uid and not fields["State"].startswith("Z")]


def user_task_count() -> int:
    """Processes and threads of this process's real uid: what ``RLIMIT_NPROC`` counts."""
    uid = os.getuid()
    return sum(int(f["Threads"]) for _, f in _process_status() if _real_uid(f) == uid)


def _real_uid(fields: dict[str, str]) -> int:
    return int(fields["Uid"].split()[0])


def _process_status() -> Iterator[tuple[int, dict[str, str]]]:
    """(pid, fields of ``/proc/PID/status``) for every process still there when read."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", encoding="ascii", errors="replace") as fh:
                fields = dict(line.split(":", 1) for line in fh if ":" in line)
        except OSError:  # gone meanwhile
            continue
        if {"Uid", "Threads", "State"} <= fields.keys():
            yield int(entry.name), {k: v.strip() for k, v in fields.items()}
