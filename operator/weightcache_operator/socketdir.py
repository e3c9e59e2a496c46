"""Prepare one cache's socket directory on the node: the daemon pod's only privileged step.

    python -m weightcache_operator.socketdir ROOT NAME UID GID

Runs as the daemon pod's init container, from the operator's own image (never
from the image a WeightCache names), as root with CAP_CHOWN alone. `ROOT` is
the mount of the admin-allowed socket directory (`spec.socketDir`); `NAME` is
the cache's `<namespace>.<name>`. It creates `ROOT/NAME` if missing, hands it
to the daemon's uid and gid, and changes nothing else:

- `ROOT` must be owned by root and not writable by group or others, so that
  no one but root can have put anything at `ROOT/NAME`;
- `NAME` must be a single path component, opened relative to `ROOT` with
  `O_NOFOLLOW`: a symlink there is refused, never followed;
- ownership and mode are changed through the opened descriptor (`fchown`,
  `fchmod`), so nothing can be swapped in between the check and the change.

The CSI node plugin (csi/weightcache_csi) reaches a cache's directory by the
same walk (`open_root`, `open_cache_dir`) before it bind-mounts it into a pod.
"""

from __future__ import annotations

import os
import stat
import sys

MODE = 0o750


class SetupError(RuntimeError):
    """The directory cannot be prepared safely; the message says why."""


def check_name(name: str) -> None:
    """`name` must be one directory name: nothing that could walk elsewhere."""
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise SetupError(f"{name!r} is not a single directory name")


def open_root(root: str) -> int:
    """A descriptor of `root`, refused unless root owns it and nobody else may write it.

    Then no one but root can have put anything at `root/<name>`.
    """
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    st = os.fstat(root_fd)
    if st.st_uid != 0 or st.st_mode & 0o022:
        os.close(root_fd)
        raise SetupError(
            f"{root} is owned by uid {st.st_uid} with mode {stat.filemode(st.st_mode)}: "
            "the socket directory must be owned by root and writable by root alone"
        )
    return root_fd


def open_cache_dir(root_fd: int, root: str, name: str, flags: int = os.O_RDONLY) -> int:
    """Open `name` below `root_fd` as a directory, never following a symlink.

    `FileNotFoundError` if there is nothing; `SetupError` if it is anything but a directory.
    """
    check_name(name)
    try:
        return os.open(
            name, flags | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd
        )
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise SetupError(
            f"{root}/{name} is not a directory (a symlink or another file: {exc.strerror}); "
            "refusing to follow it"
        ) from None


def prepare(root: str, name: str, uid: int, gid: int) -> None:
    check_name(name)
    if uid < 1 or gid < 1:
        raise SetupError(f"refusing to hand {name} to uid {uid} / gid {gid} (root)")
    root_fd = open_root(root)
    try:
        try:
            os.mkdir(name, MODE, dir_fd=root_fd)
        except FileExistsError:
            # A restart: root without CAP_DAC_READ_SEARCH cannot open the daemon's
            # 0750 directory, and there is nothing to change if it is already the daemon's.
            st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode) and (st.st_uid, st.st_gid) == (uid, gid):
                return
        fd = open_cache_dir(root_fd, root, name)
        try:
            st = os.fstat(fd)
            # Root may change the mode only while it owns the directory (no CAP_FOWNER);
            # afterwards the daemon, as owner, keeps it 0750 itself.
            if st.st_uid == 0:
                os.fchmod(fd, MODE)
            if (st.st_uid, st.st_gid) != (uid, gid):
                os.fchown(fd, uid, gid)
        finally:
            os.close(fd)
    finally:
        os.close(root_fd)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 4 or not args[2].isdigit() or not args[3].isdigit():
        print("usage: python -m weightcache_operator.socketdir ROOT NAME UID GID", file=sys.stderr)
        return 2
    root, name, uid, gid = args[0], args[1], int(args[2]), int(args[3])
    try:
        prepare(root, name, uid, gid)
    except (SetupError, OSError) as exc:
        print(f"weightcache socket directory: {exc}", file=sys.stderr)
        return 1
    print(f"{root}/{name} belongs to {uid}:{gid}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
