"""One daemon per device: an flock held for the daemon's lifetime.

flock is released by the kernel when the holder dies, so a killed daemon
never leaves a lock that blocks its successor.
"""

from __future__ import annotations

import fcntl
import os


class DaemonAlreadyRunning(RuntimeError):
    pass


class DeviceLock:
    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DaemonAlreadyRunning(
                f"another daemon (pid {holder}) already serves this device "
                f"(lock {self.path} is held)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
