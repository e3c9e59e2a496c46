"""One daemon per device: an flock held for the daemon's lifetime.

flock is released by the kernel when the holder dies, so a killed daemon
never leaves a lock that blocks its successor. The lock file lives in the
daemon's private directory (:func:`lock_path`) and is opened with
``O_NOFOLLOW``: a symlink planted there would otherwise make the daemon
create or truncate whatever file it points at.
"""

from __future__ import annotations

import fcntl
import os
import stat

from weightcache.daemon.statedir import state_file


class DaemonAlreadyRunning(RuntimeError):
    pass


class LockFileError(RuntimeError):
    """The lock path holds something other than this uid's regular file."""


def lock_path(socket_path: str) -> str:
    return state_file(socket_path, ".lock")


class FileLock:
    """An flock on a regular file of this uid (``O_NOFOLLOW``), holder pid written into it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_acquire(self) -> str | None:
        """Take the lock: None once held, else the holder's pid as the file says it."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            raise LockFileError(
                f"cannot open lock {self.path} ({exc.strerror}); a symlink there is refused"
            ) from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            os.close(fd)
            raise LockFileError(
                f"lock {self.path} is not a regular file owned by uid {os.geteuid()}; "
                "refusing to use it"
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            return holder
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class DeviceLock(FileLock):
    def acquire(self) -> None:
        holder = self.try_acquire()
        if holder is not None:
            raise DaemonAlreadyRunning(
                f"another daemon (pid {holder}) already serves this device "
                f"(lock {self.path} is held)"
            )
