"""Prepare one cache's socket directory on the node: the daemon pod's only privileged step.

    python -m weightcache_operator.socketdir ROOT NAME UID GID [OWNER]

Runs as the daemon pod's init container, from the operator's own image (never
from the image a WeightCache names), as root with CAP_CHOWN alone. `ROOT` is
the mount of the admin-allowed socket directory (`spec.socketDir`); `NAME` is
the cache's `<namespace>.<name>`; `OWNER` is the WeightCache's uid. It creates
`ROOT/NAME` if missing, hands it to the daemon's uid and gid, and changes
nothing else:

- `ROOT` must be owned by root and not writable by group or others, so that
  no one but root can have put anything at `ROOT/NAME`;
- `NAME` must be a single path component, opened relative to `ROOT` with
  `O_NOFOLLOW`: a symlink there is refused, never followed;
- ownership and mode are changed through the opened descriptor (`fchown`,
  `fchmod`), so nothing can be swapped in between the check and the change.

Who a directory was made for is recorded in `ROOT/.weightcache/NAME` (root
only): the cache's uid, the daemon's uid and gid. A directory made for another
cache of the same name (deleted, then created again) or for another uid or gid
is not reused: its daemon's re-adoption key, manifest and sockets would be
inherited, and with CAP_CHOWN alone root cannot even enter a directory of the
old uid (a changed runAsUser once wedged the init container on EACCES). It is
renamed aside (`ROOT/.retired-NAME-<random>`, in the same directory, which
needs no access to it), a fresh one is made, and retired directories are
removed: each is handed to root first (CAP_CHOWN), then entered and emptied
as its owner, never following a symlink. A directory without a record (made
before records were kept) that already belongs to the daemon's uid and gid is
kept and recorded, so an upgrade reloads nothing.

The CSI node plugin (csi/weightcache_csi) reaches a cache's directory by the
same walk (`open_root`, `open_cache_dir`) before it bind-mounts it into a pod.
"""

from __future__ import annotations

import os
import secrets
import stat
import sys

MODE = 0o750
# In ROOT: who each cache directory was made for (root only), and directories set aside.
RECORDS = ".weightcache"
RETIRED_PREFIX = ".retired-"


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


def prepare(root: str, name: str, uid: int, gid: int, owner: str = "") -> None:
    check_name(name)
    if uid < 1 or gid < 1:
        raise SetupError(f"refusing to hand {name} to uid {uid} / gid {gid} (root)")
    wanted = f"{owner or '-'} {uid} {gid}"
    root_fd = open_root(root)
    try:
        records = _open_records(root_fd, root)
        try:
            _prepare(root_fd, records, root, name, uid, gid, owner, wanted)
        finally:
            os.close(records)
        _remove_retired(root_fd)
    finally:
        os.close(root_fd)


def _prepare(root_fd: int, records: int, root: str, name: str, uid: int, gid: int,
             owner: str, wanted: str) -> None:
    try:
        st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        record = _read_record(records, name)
        if (st.st_uid, st.st_gid) == (uid, gid) and _made_for(record, owner, uid, gid):
            # A restart: root without CAP_DAC_READ_SEARCH cannot open the daemon's 0750
            # directory, and there is nothing to change if it is already this daemon's.
            if record != wanted and owner:
                _write_record(records, name, wanted)
            return
        if st.st_uid != 0:
            # Made for another cache of this name, or another uid or gid: set aside (a
            # rename within ROOT needs no access to the directory itself).
            os.rename(name, f"{RETIRED_PREFIX}{name}-{secrets.token_hex(4)}",
                      src_dir_fd=root_fd, dst_dir_fd=root_fd)
    try:
        os.mkdir(name, MODE, dir_fd=root_fd)
    except FileExistsError:
        pass  # root's own, from a start cut short: handed over below
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
    _write_record(records, name, wanted)


def _made_for(record: str | None, owner: str, uid: int, gid: int) -> bool:
    """Whether the record says the directory was made for this cache and daemon ids; one
    from before records were kept (None), or recorded without a cache, is taken as made
    for them."""
    if record is None:
        return True
    made_for, _, ids = record.partition(" ")
    return ids == f"{uid} {gid}" and (not owner or made_for in ("-", owner))


def _open_records(root_fd: int, root: str) -> int:
    try:
        os.mkdir(RECORDS, 0o700, dir_fd=root_fd)
    except FileExistsError:
        pass
    fd = open_cache_dir(root_fd, root, RECORDS)
    st = os.fstat(fd)
    if st.st_uid != 0 or st.st_mode & 0o077:
        os.close(fd)
        raise SetupError(f"{root}/{RECORDS} must belong to root with mode 0700")
    return fd


def _read_record(records: int, name: str) -> str | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=records)
    except FileNotFoundError:
        return None
    with os.fdopen(fd) as f:
        return f.read(512).strip()


def _write_record(records: int, name: str, record: str) -> None:
    tmp = f".{name}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=records)
    with os.fdopen(fd, "w") as f:
        f.write(record + "\n")
    os.rename(tmp, name, src_dir_fd=records, dst_dir_fd=records)


def _remove_retired(root_fd: int) -> None:
    """Empty and remove the directories set aside (best effort: a failure waits for the
    next start)."""
    for entry in os.listdir(root_fd):
        if entry.startswith(RETIRED_PREFIX):
            try:
                _remove_tree(root_fd, entry)
            except OSError as exc:
                print(f"weightcache socket directory: cannot remove {entry} yet: {exc}",
                      file=sys.stderr)


def _remove_tree(parent: int, name: str) -> None:
    """Remove `name` below `parent` with CAP_CHOWN alone: each directory is handed to root
    (no access needed for that), made root's 0700, entered without following a symlink,
    emptied and removed. Files and sockets go with their directory's owner's right."""
    st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=parent)
        return
    os.chown(name, 0, 0, dir_fd=parent, follow_symlinks=False)
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                 dir_fd=parent)
    try:
        os.fchmod(fd, 0o700)
        for entry in os.listdir(fd):
            _remove_tree(fd, entry)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (4, 5) or not args[2].isdigit() or not args[3].isdigit():
        print("usage: python -m weightcache_operator.socketdir ROOT NAME UID GID [OWNER]",
              file=sys.stderr)
        return 2
    root, name, uid, gid = args[0], args[1], int(args[2]), int(args[3])
    owner = args[4] if len(args) == 5 else ""
    try:
        prepare(root, name, uid, gid, owner)
    except (SetupError, OSError) as exc:
        print(f"weightcache socket directory: {exc}", file=sys.stderr)
        return 1
    print(f"{root}/{name} belongs to {uid}:{gid}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
