"""A sandbox does not outlive the process that started it, and a uid left behind by a
host that died mid-run is cleared before another run gets it.

The host is killed with SIGKILL, as the OOM killer would: nothing in it runs after that,
so only the kernel can end the sandbox (a parent-death signal, the PID namespace). The
host's own wall clock, which would otherwise end the program, is gone with it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rltune.sandbox import Limits, mechanisms, run_python, runner, watch
from rltune.sandbox.mechanisms import UID_BASE, UID_SLOTS, lease_uid, uid_processes

REPO = Path(__file__).resolve().parents[3]
IS_ROOT = os.geteuid() == 0
NAMESPACED = ["bwrap", "unshare"]  # skipped, or failed under CI, where one does not work (conftest)

# The program sleeps, and its wall limit is, far longer than any bound below: if its
# processes are gone within the bound, the host's death ended them, nothing else.
PROGRAM_LIFE_S = 600
# From starting the host to the program and its child running: an interpreter start,
# importing rltune.sandbox, the mechanism's trial run and the run's own start -- about
# 0.6 s on the (loaded, 2-core) development machine. 60 s is 100 times that: room for a
# machine three times slower under heavier load still.
START_BOUND_S = 60.0
# From the host's death to the last process of the sandbox gone: the kernel sends the
# death signals at once and tears the PID namespace down; 10-20 ms on the development
# machine. 20 s is 1000 times that (over 300 times on a machine three times slower) and
# still 30 times shorter than the program would live.
EXIT_BOUND_S = 20.0

# The host calls run_python from a worker thread, as the reward and tool pools do.
HOST = f"""
import sys, threading
sys.path.insert(0, {str(REPO)!r})
from rltune.sandbox import Limits, run_python
program = "import os, time\\nos.fork()\\ntime.sleep({PROGRAM_LIFE_S})\\n"
limits = Limits(wall_s={PROGRAM_LIFE_S}, cpu_s=10)
worker = threading.Thread(target=run_python, args=(program,),
                          kwargs={{"limits": limits, "mechanism": sys.argv[1]}})
worker.start()
worker.join()
"""


def _parent_and_uid(pid: int) -> tuple[int, int] | None:
    """(parent pid, real uid) of a live process; None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    parent = int(stat.rsplit(")", 1)[1].split()[1])  # the name in brackets may hold spaces
    uid = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("Uid:"))
    return parent, uid


def _descendants(root: int) -> dict[int, int]:
    """pid -> real uid of every live process below ``root``."""
    info = {int(e.name): _parent_and_uid(int(e.name))
            for e in os.scandir("/proc") if e.name.isdigit()}
    children: dict[int, list[int]] = {}
    for pid, found in info.items():
        if found is not None:
            children.setdefault(found[0], []).append(pid)
    out: dict[int, int] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found = info[pid]
        if found is not None:
            out[pid] = found[1]
            todo += children.get(pid, [])
    return out


def _in_pool(uid: int) -> bool:
    return UID_BASE <= uid < UID_BASE + UID_SLOTS


@contextlib.contextmanager
def _pidfds(host: subprocess.Popen[bytes]) -> Iterator[dict[int, int]]:
    """pid -> pidfd of every process of the host's sandbox, once the program and its child
    run (two processes of a pool uid). A pidfd names one process for good, so the check
    cannot be fooled by a reused pid. Whatever is still alive at the end is killed."""
    fds: dict[int, int] = {}
    try:
        end = time.monotonic() + START_BOUND_S
        while sum(map(_in_pool, _descendants(host.pid).values())) < 2:
            if host.poll() is not None:
                pytest.fail(f"the host exited ({host.returncode}) before the program ran")
            if time.monotonic() > end:
                pytest.fail(f"the sandboxed program did not start within {START_BOUND_S} s")
            time.sleep(0.05)
        for pid in _descendants(host.pid):
            with contextlib.suppress(ProcessLookupError):
                fds[pid] = os.pidfd_open(pid)
        # a pid that ended and was reused before its pidfd was opened is not below the host
        for pid in set(fds) - set(_descendants(host.pid)):
            os.close(fds.pop(pid))
        yield fds
    finally:
        for fd in fds.values():
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            os.close(fd)


def _still_running(fds: dict[int, int], bound_s: float) -> list[int]:
    """The pids whose pidfd did not report an exit within ``bound_s``."""
    end = time.monotonic() + bound_s
    alive = dict(fds)
    with selectors.DefaultSelector() as sel:
        for pid, fd in alive.items():
            sel.register(fd, selectors.EVENT_READ, pid)
        while alive and (left := end - time.monotonic()) > 0:
            for key, _ in sel.select(timeout=left):
                sel.unregister(key.fd)
                alive.pop(key.data)
    return sorted(alive)


@pytest.mark.parametrize("mech", NAMESPACED)
def test_sandbox_ends_when_its_host_is_killed(mech: str) -> None:
    with tempfile.TemporaryFile() as err:
        host = subprocess.Popen([sys.executable, "-c", HOST, mech], cwd="/",
                                stdout=subprocess.DEVNULL, stderr=err)
        try:
            with _pidfds(host) as fds:
                sandbox = {pid: _parent_and_uid(pid) for pid in fds}
                host.kill()
                host.wait()
                left = _still_running(fds, EXIT_BOUND_S)
                assert not left, (
                    f"{mech}: {len(left)} of the sandbox's {len(fds)} processes "
                    f"(pid: (parent, uid) {sandbox}) outlived the killed host by "
                    f"{EXIT_BOUND_S} s: {left}")
        finally:
            if host.poll() is None:
                host.kill()
                host.wait()
            err.seek(0)
            print(err.read().decode(errors="replace")[-2000:], file=sys.stderr)


@pytest.mark.skipif(not IS_ROOT, reason="uids are leased only as root")
def test_a_uid_a_dead_host_held_is_cleared_before_reuse(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A lease whose holder died mid-run (its lock file still names it) is reused only
    after the uid's processes are gone; a cleanly ended lease is reused without a look."""
    slot = 4000 + os.getpid() % 90  # a slot concurrent runs are unlikely to be holding
    uid = UID_BASE + slot
    monkeypatch.setattr(mechanisms.random, "randrange", lambda n: slot)
    with lease_uid(watch.wait_uid_gone) as got:
        if got != uid:
            pytest.skip(f"uid {uid} is leased by a concurrent run")
    lock = Path(tempfile.gettempdir()) / "rltune-sandbox-uids" / str(uid)
    assert lock.read_bytes() == b""  # ended cleanly
    leftover = subprocess.Popen(["sleep", str(PROGRAM_LIFE_S)], user=uid, group=uid,
                                extra_groups=[])
    try:
        lock.write_bytes(b"12345\n")  # as a host killed mid-run leaves it
        with lease_uid(watch.wait_uid_gone) as got:
            assert got == uid
            assert leftover.wait(timeout=EXIT_BOUND_S) == -signal.SIGKILL
            assert uid_processes(uid) == []
    finally:
        if leftover.poll() is None:
            leftover.kill()
        leftover.wait()


@pytest.mark.parametrize("mech", NAMESPACED)
def test_an_error_after_the_start_still_ends_the_sandbox(
        mech: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """run_python never returns, even raising, with the sandbox's process alive and
    unreaped: it would run on unwatched, and the calling thread's end would no longer be
    the only thing that fires its parent-death signal."""
    started: list[subprocess.Popen[bytes]] = []

    def failing_watch(proc: subprocess.Popen[bytes], status_r: int) -> None:
        started.append(proc)
        os.close(status_r)
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(runner, "Watch", failing_watch)
    try:
        with pytest.raises(OSError, match="Too many open files"):
            run_python(f"import time; time.sleep({PROGRAM_LIFE_S})", mechanism=mech,
                       limits=Limits(wall_s=PROGRAM_LIFE_S))
        assert len(started) == 1 and started[0].returncode is not None
    finally:
        for proc in started:
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_unshare_needs_setpriv(monkeypatch: pytest.MonkeyPatch) -> None:
    real_which = shutil.which
    monkeypatch.setattr(mechanisms.shutil, "which",
                        lambda name: None if name == "setpriv" else real_which(name))
    reason = mechanisms.unavailable_reason("unshare")
    assert reason is not None and "`setpriv` is not installed" in reason
