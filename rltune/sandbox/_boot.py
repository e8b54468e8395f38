"""The first code that runs inside a sandbox: it finishes the isolation, then runs the program.

This file is not imported by rltune: :mod:`rltune.sandbox.runner` passes its source to the
interpreter with ``python -I -S -B -c SOURCE SPEC_FD`` (standard library only, no site, no
environment variables read, no bytecode written). Everything it needs arrives as one
``marshal``-ed dict of plain values on the inherited descriptor ``SPEC_FD``, written by the
host (see ``runner._launch``), so nothing about the run is visible in its command line.
It imports nothing beyond built-in modules on the common path (``json`` alone would add
8 ms to every run); ``ctypes`` only where a system call needs it.

Status lines on ``status_fd``, for the host only: ``ready``, ``exit CODE CPU_SECONDS``,
``error MESSAGE``.

The steps, in order (each one a function below):

1. ``unshare`` mechanism only: build a new root file system in the fresh mount namespace
   (a read-only tmpfs holding read-only binds of the system and Python directories, a new
   ``/proc``, a minimal ``/dev``, size-capped tmpfs for ``/sandbox`` and ``/tmp``) and
   ``pivot_root`` into it, detaching the old root.
2. Namespaced mechanisms: fork. The parent stays as PID 1 of the PID namespace (see
   :func:`_init`): it reaps orphans and, when the program exits, reports the program's exact
   wait status and CPU time on ``status_fd`` and exits, which makes the kernel kill every
   process left in the namespace. The program runs in the child, never as PID 1, so signals
   such as ``SIGXCPU`` have their normal effect on it.
3. Write the program (``main.py``) and its files into the working directory.
4. When a uid is given (the host runs as root): ``chown`` the working directory to it and
   drop every privilege (supplementary groups, gid, uid; the kernel clears the capability
   sets on the uid change), then check that the drop cannot be undone.
5. Set the resource limits (``RLIMIT_NPROC`` is enforced only now that the process is not
   root, which is why step 4 exists).
6. Say "ready" on ``status_fd`` and close it (the program never holds it), then run
   ``main.py`` as ``__main__`` in this interpreter (no second interpreter start). Only
   the host reads the pipe: a host that is gone by now (it may have died before
   ``unshare`` or ``bwrap`` had set the parent-death signal that ties them to it) makes
   the write fail with ``EPIPE``, so the program never starts without a host to watch it.

A failure in steps 1-5 is the sandbox's, not the program's: it is reported on ``status_fd``
as ``error ...`` and the process exits with status 125.
"""

from __future__ import annotations

import marshal
import os
import sys

TYPE_CHECKING = False  # typing costs start-up time inside the sandbox; mypy reads this
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC = 32, 4096, 16384
_MNT_DETACH = 2
_PR_SET_DUMPABLE = 4
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_DEVICES = ("null", "zero", "full", "random", "urandom")


def _libc() -> tuple[Any, Callable[[], int]]:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                           ctypes.c_ulong, ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.syscall.argtypes = [ctypes.c_long, ctypes.c_char_p, ctypes.c_char_p]
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                           ctypes.c_ulong]
    return libc, ctypes.get_errno


def _check(rc: int, get_errno: Callable[[], int], what: str) -> None:
    if rc != 0:
        errno = get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _build_root(root: dict[str, Any]) -> None:
    """Step 1 (``unshare`` only): a new root made of read-only binds and fresh tmpfs."""
    libc, get_errno = _libc()

    def mount(src: str | None, target: str, fstype: str | None, flags: int,
              data: str | None = None) -> None:
        def enc(s: str | None) -> bytes | None:
            return None if s is None else s.encode()

        rc = libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data))
        _check(rc, get_errno, f"mount {src} on {target}")

    new = root["mountpoint"]
    mount("tmpfs", new, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=0755")
    for path, target in root["symlinks"].items():
        os.symlink(target, new + path)
    os.makedirs(new + "/dev", mode=0o755)
    mount("tmpfs", new + "/dev", "tmpfs", _MS_NOSUID | _MS_NOEXEC, "size=64k,mode=0755")
    for name in _DEVICES:
        open(f"{new}/dev/{name}", "wb").close()
        mount(f"/dev/{name}", f"{new}/dev/{name}", None, _MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{new}/dev/{name}")
    size = f"size={root['tmpfs_mb']}m"
    for path, mode in (("/dev/shm", "1777"), ("/tmp", "1777"), (root["workdir"], "0755")):
        os.makedirs(new + path, mode=0o755, exist_ok=True)
        mount("tmpfs", new + path, "tmpfs", _MS_NOSUID | _MS_NODEV, f"{size},mode={mode}")
    # the binds come after the tmpfs: an interpreter or venv that lives under /tmp stays
    # visible (read-only) inside the fresh /tmp
    for path in root["ro_binds"]:
        os.makedirs(new + path, mode=0o755, exist_ok=True)
        mount(path, new + path, None, _MS_BIND | _MS_REC)
        mount(None, new + path, None,
              _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    os.makedirs(new + "/proc", mode=0o755)
    mount("proc", new + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    # pivot_root(".", "."): the old root ends up stacked under the new one and is then
    # detached, so no path inside leads back to the host's file system.
    os.chdir(new)
    _check(libc.syscall(_PIVOT_ROOT[os.uname().machine], b".", b"."), get_errno, "pivot_root")
    _check(libc.umount2(b".", _MNT_DETACH), get_errno, "detach the old root")
    os.chdir("/")
    mount(None, "/", None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)


def _fork_init(same_uid: bool, status_fd: int) -> None:
    """Step 2: fork; the parent becomes :func:`_init`, the child returns and goes on.

    When the program will run under the same uid as PID 1 (no privilege drop: a
    non-root host), PID 1 makes itself non-dumpable first, so the program can neither
    ptrace it nor open its descriptors through ``/proc/1/fd``; the child undoes that for
    itself, the program being an ordinary process."""
    prctl: Callable[[int], None] | None = None
    if same_uid:
        libc, get_errno = _libc()

        def prctl(value: int) -> None:
            _check(libc.prctl(_PR_SET_DUMPABLE, value, 0, 0, 0), get_errno, "prctl")

        prctl(0)
    child = os.fork()
    if child != 0:
        _init(child, status_fd)
    if prctl is not None:
        prctl(1)


def _init(child: int, status_fd: int) -> None:
    """Step 2, parent side: PID 1 of the namespace. Never returns."""
    for fd in (0, 1, 2):
        os.close(fd)
    while True:
        try:
            pid, status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            os._exit(0)
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            cpu = usage.ru_utime + usage.ru_stime
            os.write(status_fd, f"exit {code} {cpu!r}\n".encode())
            os._exit(0)


def _write_files(workdir: str, files: dict[str, str]) -> None:
    """Step 3: the program and its files, parents created as needed."""
    for rel, text in files.items():
        path = os.path.join(workdir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)


def _drop_privileges(workdir: str, uid: int, gid: int) -> None:
    """Step 4: hand the working directory to ``uid`` and become it, for good."""
    for parent, dirs, names in os.walk(workdir):
        for name in [*dirs, *names]:
            os.lchown(os.path.join(parent, name), uid, gid)
    os.chown(workdir, uid, gid)
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
        raise RuntimeError(f"privilege drop to {uid}:{gid} did not take")
    try:
        os.setuid(0)
    except PermissionError:
        return
    raise RuntimeError("privilege drop can be undone (setuid(0) succeeded)")


def _set_limits(limits: dict[str, list[int]]) -> None:
    """Step 5: name -> [soft, hard] for RLIMIT_<NAME>."""
    import resource

    for name, (soft, hard) in limits.items():
        resource.setrlimit(getattr(resource, "RLIMIT_" + name.upper()), (soft, hard))


def _run_main(workdir: str, extra_path: list[str]) -> None:
    """Step 6: run ``main.py`` as ``__main__``, as ``python main.py`` would."""
    import builtins

    path = os.path.join(workdir, "main.py")
    with open(path, encoding="utf-8") as fh:
        source = fh.read()
    sys.argv[:] = ["main.py"]
    sys.path[:] = [workdir, *sys.path, *extra_path]
    module = type(sys)("__main__")
    module.__file__ = path
    module.__builtins__ = builtins
    sys.modules["__main__"] = module
    try:
        code = compile(source, path, "exec")
        exec(code, module.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:  # the program's own error: print it as Python would
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        sys.exit(1)


def _fail(status_fd: int, exc: BaseException) -> None:
    message = f"sandbox setup failed: {type(exc).__name__}: {exc}".replace("\n", " ")
    try:
        os.write(status_fd, f"error {message}\n".encode())
    finally:
        os._exit(125)


def main(spec_fd: int) -> None:
    with os.fdopen(spec_fd, "rb") as fh:
        spec = marshal.loads(fh.read())
    status_fd = spec["status_fd"]
    try:
        if spec["root"] is not None:
            _build_root(spec["root"])
        if spec["init"]:
            _fork_init(spec["uid"] is None, status_fd)
        workdir = spec["workdir"]
        _write_files(workdir, spec["files"])
        if spec["uid"] is not None:
            _drop_privileges(workdir, spec["uid"], spec["gid"])
        _set_limits(spec["rlimits"])
        os.chdir(workdir)
        os.write(status_fd, b"ready\n")
        os.close(status_fd)
    except BaseException as exc:
        _fail(status_fd, exc)
    _run_main(workdir, extra_path=spec["sys_path"])


if __name__ == "__main__":
    main(int(sys.argv[1]))
