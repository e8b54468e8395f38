"""Watching one sandbox run: feeding its stdin, collecting its capped output and status
lines, enforcing the wall clock, and killing and reaping everything it left
(:class:`Watch`); :mod:`rltune.sandbox.runner` starts the run and reads the result.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rltune.sandbox.mechanisms import Mechanism, SandboxError, uid_processes

_READ_CHUNK = 1 << 16
_KILL_GRACE_S = 5.0
"""How long a killed sandbox may take to disappear before that is an error."""
_EOF_GRACE_S = 1.0
"""After the program exits, how long its output pipes may stay open (``rlimits-only``:
a descendant that escaped the kill can hold them) before they are abandoned."""


@dataclass
class Io:
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    status: bytearray = field(default_factory=bytearray)
    truncated: bool = False
    killed_for: Literal["wall", "output"] | None = None


class Watch:
    """Feeds stdin, collects capped output and the status lines, enforces the wall clock
    and the output cap, and finally kills and reaps everything the run left."""

    def __init__(self, proc: subprocess.Popen[bytes], status_r: int) -> None:
        self.proc = proc
        self.status_r = status_r
        try:
            self.pidfd = os.pidfd_open(proc.pid)
        except BaseException:
            os.close(status_r)  # close() will not run
            raise
        self.rusage_cpu: float | None = None

    def communicate(self, stdin: bytes, output_bytes: int, *, deadline: float,
                    on_exit: Callable[[], None]) -> Io:
        """Run the loop until the program exited and its output pipes closed, the wall
        clock ran out (``killed_for="wall"``) or an output went past ``output_bytes``
        (``killed_for="output"``). ``on_exit`` runs once, when the sandbox's own process
        has exited (rlimits-only kills the program's leftovers there, so pipes close)."""
        io = Io()
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
                    elif not self._read(sel, key.fd, buffers[key.fd], io, output_bytes):
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

    def _read(self, sel: selectors.BaseSelector, fd: int, buf: bytearray, io: Io,
              output_bytes: int) -> bool:
        """Read what is there; False when the output cap was passed."""
        chunk = os.read(fd, _READ_CHUNK)
        if not chunk:
            sel.unregister(fd)
            return True
        room = output_bytes - len(buf) if fd != self.status_r else len(chunk)
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
                wait_uid_gone(uid)
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


def leftover_killer(mechanism: Mechanism, uid: int | None, pgid: int) -> Callable[[], None]:
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


def wait_uid_gone(uid: int) -> None:
    """Kill the processes of ``uid`` until there are none (zombies aside); a
    :class:`SandboxError` if some are still there after ``_KILL_GRACE_S``."""
    end = time.monotonic() + _KILL_GRACE_S
    while uid_processes(uid):
        if time.monotonic() > end:
            raise SandboxError(f"processes of sandbox uid {uid} survived SIGKILL")
        _kill_uid(uid)
        time.sleep(0.005)
