"""Unix-socket security both sides share: peers, directories and listeners (torch-free).

The daemon serves engines on ``<dir>/<socket>`` and engines offer their fds
back to a restarting daemon on ``<dir>/engines/<name>.sock``; both sides check
who is on the other end (``SO_PEERCRED``, and the supplementary groups from
``SO_PEERGROUPS``) against a :class:`PeerPolicy`, and
both publish a listener only once it has its final mode
(:func:`listen_unix`). The daemon's side of re-adoption lives in
``weightcache.daemon.readopt``, the engine's in ``weightcache.handback``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import secrets
import socket
import stat
import struct
from dataclasses import dataclass

log = logging.getLogger(__name__)

_PEERCRED = struct.Struct("3i")
# Linux >= 4.13; Python names no constant for it. The peer's supplementary groups
# as they were at connect(): how an engine pod whose primary group is its own
# reaches the daemon through the group the webhook adds (supplementalGroups).
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
MAX_PEER_GROUPS = 256
# Directories are opened, never followed: a symlink planted there is refused.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
SOCKET_MODE = 0o660
SOCKET_DIR_MODE = 0o750
# Engines' hand-back sockets, beside the daemon's socket.
ENGINES_DIR = "engines"
# The most entries a daemon reads from a directory others may write (engines/): a start
# costs the same however many an engine made.
MAX_LISTED = 4096


@dataclass(frozen=True)
class PeerPolicy:
    """Who may connect: a peer passes if its uid, its gid or one of its supplementary groups
    is listed."""

    uids: frozenset[int]
    gids: frozenset[int] = frozenset()

    def allows(self, uid: int, gid: int, groups: tuple[int, ...] = ()) -> bool:
        return uid in self.uids or gid in self.gids or not self.gids.isdisjoint(groups)


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process on the other end, from the kernel."""
    pid, uid, gid = _PEERCRED.unpack(
        conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    )
    return pid, uid, gid


def peer_groups(conn: socket.socket) -> tuple[int, ...]:
    """The peer's supplementary groups from the kernel; () where SO_PEERGROUPS is missing."""
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * MAX_PEER_GROUPS)
    except OSError:
        return ()  # an old kernel, or more groups than we read: primary gid and uid only
    return struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4])


def engines_dir(daemon_socket_path: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(daemon_socket_path)), ENGINES_DIR)


def prepare_socket_dir(path: str) -> None:
    """Create the socket's directory 0750 (tightening it if we own it).

    Engines reach the socket through the directory's group (the daemon's
    gid); nobody else may enter, and only the owner may add or replace files.
    A directory others may write is left alone but logged: engines refuse
    such a directory by default (see :func:`weightcache.client.attach`).
    """
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=SOCKET_DIR_MODE, exist_ok=True)
    try:
        fd = os.open(directory, DIR_FLAGS)
    except OSError as exc:
        message = f"socket directory unusable ({exc.strerror}; a symlink is refused)"
        raise OSError(exc.errno, message, directory) from None
    try:
        info = os.fstat(fd)
        if info.st_uid == os.geteuid():
            os.fchmod(fd, SOCKET_DIR_MODE)
        elif stat.S_IMODE(info.st_mode) & 0o022:
            log.warning(
                "socket directory %s (owner uid %d, mode %04o) is writable by others than "
                "its owner; engines will refuse it",
                directory, info.st_uid, stat.S_IMODE(info.st_mode),
            )
    finally:
        os.close(fd)


def listen_unix(path: str, backlog: int) -> socket.socket:
    """Listen on ``path`` (mode 0660), published only once it accepts.

    Bound under a temporary name and renamed into place, so the path never
    exists with another mode, a stale socket is replaced in one step, and a
    ``.sock`` that refuses connections is always a dead process's. No umask
    change: the umask is the whole process's, and its other threads would
    create their files under ours.
    """
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{secrets.token_hex(4)}.tmp")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(tmp)
        os.chmod(tmp, SOCKET_MODE)
        listener.listen(backlog)
        os.rename(tmp, path)
    except BaseException:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return listener


def socket_files(directory: str, limit: int = MAX_LISTED) -> list[str]:
    """The ``*.sock`` sockets among the first ``limit`` entries of ``directory``, by name;
    symlinks and other files are skipped, nothing below is read."""
    try:
        fd = os.open(directory, DIR_FLAGS)
    except FileNotFoundError:
        return []
    try:
        with os.scandir(fd) as entries:
            names = sorted(e.name for e in itertools.islice(entries, limit)
                           if e.name.endswith(".sock"))
        return [os.path.join(directory, n) for n in names if _is_socket(n, fd)]
    finally:
        os.close(fd)


def _is_socket(name: str, directory: int) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False
