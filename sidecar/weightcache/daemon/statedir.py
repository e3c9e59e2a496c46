"""The daemon's private directory beside its sockets: ``<socket dir>/.daemon/``.

It holds what only the daemon's uid may read or write: the re-adoption
manifest with its checksum key, and the device lock. Engines share the socket
directory (0750, the daemon's group) and must not read the key, so the
manifest cannot sit beside the socket.

Every step is taken on directory fds opened with ``O_NOFOLLOW``: a symlink
planted at ``.daemon`` (by anyone who could ever write the socket directory)
is refused, never followed. The directory must be owned by this process's
uid and is kept at mode 0700.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator

STATE_DIR = ".daemon"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class StateDirError(RuntimeError):
    """The private directory is missing, a symlink, or not this daemon's; the message says which."""


def state_dir(socket_path: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(socket_path)), STATE_DIR)


def state_file(socket_path: str, suffix: str) -> str:
    """``<socket dir>/.daemon/<socket file name><suffix>``: one file per socket (per GPU)."""
    return os.path.join(state_dir(socket_path), os.path.basename(socket_path) + suffix)


def prepare_state_dir(socket_path: str) -> str:
    """Create ``.daemon`` 0700 beside the socket (tightening it); return its path."""
    parent = open_dir(os.path.dirname(os.path.abspath(socket_path)))
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(STATE_DIR, 0o700, dir_fd=parent)
        fd = _open_owned(parent, STATE_DIR, state_dir(socket_path))
        os.fchmod(fd, 0o700)
        os.close(fd)
    finally:
        os.close(parent)
    return state_dir(socket_path)


@contextlib.contextmanager
def opened_private_dir(path: str) -> Iterator[int]:
    """An fd of directory ``path``, which must be ours, not a symlink, and closed to others."""
    directory, name = os.path.split(os.path.abspath(path))
    parent = open_dir(directory)
    try:
        fd = _open_owned(parent, name, path)
    finally:
        os.close(parent)
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        if mode & 0o077:
            raise StateDirError(f"{path} has mode {mode:04o}: others may enter it; it must be 0700")
        yield fd
    finally:
        os.close(fd)


def open_dir(path: str) -> int:
    """An fd of directory ``path``; its last component must not be a symlink."""
    try:
        return os.open(path, _DIR_FLAGS)
    except OSError as exc:
        raise StateDirError(_why(path, exc)) from None


def _open_owned(parent: int, name: str, path: str) -> int:
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        raise StateDirError(_why(path, exc)) from None
    owner = os.fstat(fd).st_uid
    if owner != os.geteuid():
        os.close(fd)
        raise StateDirError(
            f"{path} is owned by uid {owner}, not this daemon's ({os.geteuid()}); "
            "refusing to keep the manifest or lock there"
        )
    return fd


def _why(path: str, exc: OSError) -> str:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return f"{path} is a symlink or not a directory; refusing to follow it"
    return f"cannot open {path}: {exc.strerror}"
