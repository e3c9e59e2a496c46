"""Child processes that cannot outlive their owner.

All components join one process group, so a single killpg reaches every one
of them, and each gets PR_SET_PDEATHSIG so that even a SIGKILLed owner (no
atexit, no signal handler) takes them down with it.
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_PR_SET_PDEATHSIG = 1
EPHEMERAL_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Above the ports Kubernetes' own components and common services listen on (kubelet 10250…).
_LOWEST_TEST_PORT = 20000


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports that were free a moment ago, outside the ephemeral range.

    A port the kernel hands out for bind(0) comes from the range it also gives every outgoing
    connection: one chosen for a process that restarts later (the operator, its liveness
    endpoint) can meanwhile be some client's local port, and the restart fails with EADDRINUSE.
    Below that range only an explicit bind takes a port. Held open together so none repeats.
    """
    candidates = _listen_port_candidates()
    sockets: list[socket.socket] = []
    try:
        for port in random.sample(candidates, len(candidates)):
            if len(sockets) == count:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            sockets.append(s)
        if len(sockets) < count:
            raise RuntimeError(f"fewer than {count} free ports outside the ephemeral range")
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _listen_port_candidates() -> range:
    """Ports the kernel never picks as an outgoing connection's local port."""
    low, high = (int(v) for v in EPHEMERAL_PORT_RANGE.read_text().split())
    if low - _LOWEST_TEST_PORT >= 1000:
        return range(_LOWEST_TEST_PORT, low)
    return range(high + 1, 65536)


def port_is_listening(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


class ProcessGroup:
    """Spawns processes into one fresh process group and tears that group down."""

    def __init__(self) -> None:
        self.pgid: int | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}
        # How each was spawned, so that stop_one()/respawn() can restart it alike.
        self._specs: dict[str, tuple[Any, ...]] = {}
        self._owner_pid = os.getpid()

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        log: Path,
        env: dict[str, str] | None = None,
        before_exec: Callable[[], None] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start argv in the group; `before_exec` runs in the child (e.g. to join a cgroup)."""
        pgid = self.pgid or 0
        owner = self._owner_pid
        libc = ctypes.CDLL(None, use_errno=True)

        def in_child() -> None:
            os.setpgid(0, pgid)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            # The owner may have died between fork and prctl; then nobody would signal us.
            if os.getppid() != owner:
                os._exit(1)
            if before_exec is not None:
                before_exec()

        with open(log, "ab") as out:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=in_child,
                env=env,
                cwd=cwd,
                close_fds=True,
            )
        if self.pgid is None:
            self.pgid = proc.pid
        self.procs[name] = proc
        self.logs[name] = log
        self._specs[name] = (argv, log, env, before_exec, cwd)
        return proc

    def stop_one(self, name: str, sig: int = signal.SIGTERM, grace: float = 30.0) -> int:
        """Signal one process, SIGKILL it after `grace`, reap it and forget it (wait_for no
        longer watches it); its exit status. respawn(name) starts it again."""
        proc = self.procs.pop(name)
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
        return proc.wait()

    def respawn(self, name: str) -> subprocess.Popen[bytes]:
        """Start `name` again as it was first spawned (after stop_one, or once it died)."""
        if name in self.procs and self.procs[name].poll() is None:
            raise RuntimeError(f"{name} is still running")
        self.procs.pop(name, None)
        if self.pgid is not None and not group_alive(self.pgid):
            self.pgid = None  # nobody left in the group to join: the next one leads a new one
        argv, log, env, before_exec, cwd = self._specs[name]
        return self.spawn(name, argv, log, env=env, before_exec=before_exec, cwd=cwd)

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.logs[name]
        text = path.read_text(errors="replace").splitlines() if path.exists() else []
        return f"--- last {lines} lines of {path} ---\n" + "\n".join(text[-lines:])

    def wait_for(
        self,
        what: str,
        deadline: float,
        check: Callable[[], object],
        retry_on: tuple[type[Exception], ...],
        error: type[Exception] = RuntimeError,
    ) -> None:
        """Poll `check` until it is truthy; raise `error` naming `what` at the deadline,
        or at once, with its log, when a process of the group has exited meanwhile."""
        last: object = None
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise error(
                        f"testenv: {name} exited with {proc.returncode} while waiting for "
                        f"{what}\n{self.log_tail(name)}"
                    )
            try:
                if check():
                    return
            except retry_on as e:
                last = e
            time.sleep(0.2)
        raise error(f"testenv: timed out waiting for {what} (last error: {last})")

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM each process, last spawned first, giving each up to `grace` seconds;
        then SIGKILL the group for anything left, grandchildren included.

        Reverse order lets clients go before the servers they hold watches on:
        an apiserver or etcd still serving clients drains for many seconds.
        """
        if self.pgid is None:
            return
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    pass
        _signal_group(self.pgid, signal.SIGKILL)
        for proc in self.procs.values():
            proc.wait()
        self.pgid = None


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _stat_fields(stat_path: Path) -> list[str]:
    """Fields after "pid (comm) " of a /proc stat file: state, ppid, pgrp, ...
    (comm itself may contain spaces and parentheses)."""
    stat = stat_path.read_text()
    return stat[stat.rindex(")") + 2 :].split()


def group_members(pgid: int) -> list[int]:
    """Processes of the group that still run any thread.

    A killed multi-threaded (Go) process shows its main thread as a zombie while
    other threads still exit and still hold its sockets; a true zombie holds
    nothing and may wait long for a reaper once its owner is gone.
    """
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int(_stat_fields(entry / "stat")[2]) != pgid:
                continue
            states = [_stat_fields(task / "stat")[0] for task in (entry / "task").iterdir()]
        except (OSError, ValueError):
            continue
        if any(state not in ("Z", "X") for state in states):
            members.append(int(entry.name))
    return members


def group_alive(pgid: int) -> bool:
    return bool(group_members(pgid))


def kill_group(pgid: int, grace: float = 10.0) -> None:
    """Stop a group this process did not spawn (e.g. one left by `up`), SIGKILL after grace."""
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    _signal_group(pgid, signal.SIGKILL)
    deadline = time.monotonic() + grace
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
