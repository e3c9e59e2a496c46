"""Bind-mount one cache's socket directory at a pod's volume path, and take it away (I/O).

The directory is reached by the socket-directory set-up's own walk
(`weightcache_operator.socketdir`): the socket root must be root's and
writable by root alone, and the cache's directory is opened below it with
`O_NOFOLLOW`, so a symlink is refused, never followed. The bind mount's
source is that open descriptor (`/proc/self/fd/N`), so what is mounted is the
directory that was checked, whatever is renamed in between. The mount is
`nosuid,nodev,noexec` (and read-only when the volume asks); engines need
write access to the `engines/` hand-back directory only, which its mode
already limits to the daemon's group.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from pathlib import Path

from weightcache_operator.socketdir import SetupError, open_cache_dir, open_root

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_void_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)


class MountError(RuntimeError):
    """The directory cannot be mounted safely or at all; the message says why."""


def _mount(source: str | None, target: str, flags: int) -> None:
    src = source.encode() if source is not None else None
    if _libc.mount(src, target.encode(), None, flags, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)


def mount_points() -> set[str]:
    """Mount points of this mount namespace (/proc/self/mountinfo, octal escapes undone)."""
    points = set()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" ")
        if len(fields) > 4:
            points.add(_unescape(fields[4]))
    return points


def _unescape(field: str) -> str:
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def is_mounted(target: str) -> bool:
    return os.path.realpath(target) in mount_points()


def publish(root: str, name: str, target: str, read_only: bool) -> bool:
    """Bind `root/name` at `target`; False if something is already mounted there (idempotent)."""
    os.makedirs(target, mode=0o750, exist_ok=True)
    if is_mounted(target):
        return False
    try:
        root_fd = open_root(root)
    except (SetupError, OSError) as exc:
        raise MountError(f"socket root {root}: {exc}") from None
    try:
        try:
            fd = open_cache_dir(root_fd, root, name, os.O_PATH)
        except FileNotFoundError:
            raise MountError(f"{root}/{name} does not exist yet: the cache's daemon has not "
                             "prepared it on this node") from None
        except SetupError as exc:
            raise MountError(str(exc)) from None
        try:
            _mount(f"/proc/self/fd/{fd}", target, MS_BIND)
        finally:
            os.close(fd)
    finally:
        os.close(root_fd)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | MS_NOEXEC
    try:
        _mount(None, target, flags | (MS_RDONLY if read_only else 0))
    except OSError:
        unpublish(target)
        raise
    return True


def unpublish(target: str) -> bool:
    """Unmount `target` and remove the directory; True if it was mounted. Idempotent."""
    was = False
    while is_mounted(target):
        if _libc.umount2(target.encode(), 0) != 0:
            err = ctypes.get_errno()
            if err in (errno.EINVAL, errno.ENOENT):
                break
            raise OSError(err, os.strerror(err), target)
        was = True
    try:
        os.rmdir(target)
    except FileNotFoundError:
        pass
    return was
