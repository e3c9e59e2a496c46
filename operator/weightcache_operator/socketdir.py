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
needs no access to it) and a fresh one is made. A directory without a record
(made before records were kept) that already belongs to the daemon's uid and
gid is kept and recorded, so an upgrade reloads nothing.

The set-up step never enters a retired directory, nor anything else an engine
or a daemon could fill: its work is a few system calls whatever the node
holds. Retired directories are removed apart from any cache's start, by the
sweeper (`python -m weightcache_operator.socketdir sweep ROOT...`, the chart's
sweeper DaemonSet, CAP_CHOWN alone), in passes bounded in time and entries:
each directory is handed to root and made root's 0700 (then nobody else can
change what is in it), its files are unlinked and each subdirectory is moved
up to ROOT as a retired directory of its own. No recursion, no path longer
than one name, never a symlink followed, at most two descriptors held, and
every pass makes progress however deep a tree an engine nested in `engines/`
(1,500 levels once crashed every cache's set-up step on the node with
RecursionError). An entry that cannot be removed is logged and left for the
next pass; nothing else waits on it.

The CSI node plugin (csi/weightcache_csi) reaches a cache's directory by the
same walk (`open_root`, `open_cache_dir`) before it bind-mounts it into a pod.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

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


def is_retired(name: str) -> bool:
    """Whether an entry of ROOT is a directory set aside (by the set-up step or a sweep)."""
    return name.startswith(RETIRED_PREFIX) and len(name) > len(RETIRED_PREFIX)


def moved_name(retired: str, token: str) -> str:
    """The name in ROOT for a subdirectory moved up out of `retired`: retired itself, with
    its cache's name kept (so a log says whose it was) and its length bounded however deep
    the subdirectory was."""
    cache = retired[len(RETIRED_PREFIX):].rpartition("-")[0] or "x"
    return f"{RETIRED_PREFIX}{cache}-{token}"


@dataclass
class Budget:
    """What one sweep may spend: a deadline (monotonic seconds) and a number of entries."""

    deadline: float
    entries: int

    def spend(self, now: float) -> bool:
        """Take one entry; False once the entries or the time are spent."""
        if self.entries <= 0 or now >= self.deadline:
            return False
        self.entries -= 1
        return True


@dataclass
class Sweep:
    """What a sweep did; `complete` when no retired directory is left."""

    removed: int = 0  # files, sockets, links and directories unlinked
    moved: int = 0  # subdirectories moved up to ROOT
    failures: list[str] = field(default_factory=list)  # the first MAX_FAILURES, "name: error"
    failed: int = 0
    complete: bool = False

    def fail(self, name: str, exc: OSError) -> None:
        self.failed += 1
        if len(self.failures) < MAX_FAILURES:
            self.failures.append(f"{name}: {exc.strerror or exc}")

    def summary(self) -> str:
        text = f"removed {self.removed} entries, moved {self.moved} directories up"
        if self.failed:
            text += f"; {self.failed} could not be removed: " + "; ".join(self.failures)
        return text + ("" if self.complete else "; more left for the next pass")


MAX_FAILURES = 20


def sweep(root_fd: int, budget: Budget, clock: Callable[[], float] = time.monotonic) -> Sweep:
    """Remove retired directories below `root_fd` (ROOT, already checked by `open_root`)
    until none is left or `budget` is spent; an entry that cannot be removed is counted in
    the result and skipped until the next sweep."""
    result = Sweep()
    skipped: set[str] = set()
    while True:
        found = False
        # Subdirectories moved up during this scan may or may not show in it: the next
        # scan takes them.
        with os.scandir(root_fd) as entries:
            for entry in entries:
                if not is_retired(entry.name) or entry.name in skipped:
                    continue
                found = True
                if not budget.spend(clock()):
                    return result
                if not _clear(root_fd, entry.name, budget, result, clock):
                    skipped.add(entry.name)
        if not found:
            result.complete = not skipped
            return result


def _clear(root_fd: int, name: str, budget: Budget, result: Sweep,
           clock: Callable[[], float]) -> bool:
    """Empty and remove one retired directory; False if something in it stays (failed, or
    the budget ran out)."""
    try:
        fd = _take(root_fd, name)
    except NotADirectoryError:
        return _unlink(root_fd, name, name, result)
    except FileNotFoundError:
        return True
    except OSError as exc:
        result.fail(name, exc)
        return False
    kept = False
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                if not budget.spend(clock()):
                    return False
                where = f"{name}/{entry.name}"
                if entry.is_dir(follow_symlinks=False):
                    kept |= not _move_up(fd, entry.name, root_fd, moved_name(name, _token()),
                                         where, result)
                else:
                    kept |= not _unlink(fd, entry.name, where, result)
    finally:
        os.close(fd)
    if kept:
        return False
    try:
        os.rmdir(name, dir_fd=root_fd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        result.fail(name, exc)
        return False
    result.removed += 1
    return True


def _take(parent: int, name: str) -> int:
    """Make directory `name` below `parent` root's, mode 0700, without following a symlink,
    and open it for reading. With CAP_CHOWN alone: the owner may chmod, and once root owns
    it with 0700 nobody else may add, remove or rename anything in it. `parent` is ROOT or
    a directory already taken, so nobody can swap `name` for something else meanwhile."""
    os.chown(name, 0, 0, dir_fd=parent, follow_symlinks=False)
    handle = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC,
                     dir_fd=parent)
    try:
        # fchmod refuses an O_PATH descriptor; its /proc link reaches the same inode.
        os.chmod(f"/proc/self/fd/{handle}", 0o700)
        return os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=handle)
    finally:
        os.close(handle)


def _move_up(parent: int, name: str, root_fd: int, new_name: str, where: str,
             result: Sweep) -> bool:
    """Move directory `name` out of `parent` into ROOT as `new_name`: a later turn empties
    it, and no walk ever goes deeper than one level. Moving a directory needs write access
    to it (its `..` changes): it is taken first."""
    try:
        os.close(_take(parent, name))
        os.rename(name, new_name, src_dir_fd=parent, dst_dir_fd=root_fd)
    except FileNotFoundError:
        return True
    except OSError as exc:
        result.fail(where, exc)
        return False
    result.moved += 1
    return True


def _unlink(parent: int, name: str, where: str, result: Sweep) -> bool:
    try:
        os.unlink(name, dir_fd=parent)
    except FileNotFoundError:
        return True
    except OSError as exc:
        result.fail(where, exc)
        return False
    result.removed += 1
    return True


def _token() -> str:
    return secrets.token_hex(8)


# One pass every minute, of at most 10 s and 100,000 entries: a flood of retired
# entries costs the sweeper a sixth of a core at most and never anyone's start.
SWEEP_EVERY = 60.0
SWEEP_SECONDS = 10.0
SWEEP_ENTRIES = 100_000


def sweep_roots(roots: list[str], seconds: float = SWEEP_SECONDS,
                entries: int = SWEEP_ENTRIES) -> bool:
    """One pass over each root, each with its own budget; logs what it did or could not do.
    True when every root was swept clean."""
    clean = True
    for root in roots:
        try:
            root_fd = open_root(root)
        except (SetupError, OSError) as exc:
            print(f"weightcache sweeper: {root}: {exc}", file=sys.stderr, flush=True)
            clean = False
            continue
        try:
            result = sweep(root_fd, Budget(time.monotonic() + seconds, entries))
        except OSError as exc:  # ROOT itself unreadable: the next pass tries again
            print(f"weightcache sweeper: {root}: {exc}", file=sys.stderr, flush=True)
            clean = False
            continue
        finally:
            os.close(root_fd)
        if result.removed or result.moved or not result.complete:
            print(f"weightcache sweeper: {root}: {result.summary()}", file=sys.stderr,
                  flush=True)
        clean &= result.complete
    return clean


def _sweep_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m weightcache_operator.socketdir sweep",
        description="Remove the socket roots' retired directories, in bounded passes.")
    parser.add_argument("roots", nargs="+", metavar="ROOT")
    parser.add_argument("--every", type=float, default=SWEEP_EVERY,
                        help="seconds between passes; 0: one pass, then exit (1 if "
                             "anything is left)")
    parser.add_argument("--seconds", type=float, default=SWEEP_SECONDS,
                        help="the most one pass over a root may take")
    parser.add_argument("--entries", type=int, default=SWEEP_ENTRIES,
                        help="the most entries one pass over a root may remove")
    args = parser.parse_args(argv)
    if args.every <= 0:
        return 0 if sweep_roots(args.roots, args.seconds, args.entries) else 1
    # PID 1 of a container ignores SIGTERM unless it handles it: end at once, between two
    # system calls (an interrupted pass leaves nothing half done that the next cannot take).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"weightcache sweeper: every {args.every:g} s: {', '.join(args.roots)}",
          file=sys.stderr, flush=True)
    while True:
        sweep_roots(args.roots, args.seconds, args.entries)
        time.sleep(args.every)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["sweep"]:
        return _sweep_main(args[1:])
    if len(args) not in (4, 5) or not args[2].isdigit() or not args[3].isdigit():
        print("usage: python -m weightcache_operator.socketdir ROOT NAME UID GID [OWNER]\n"
              "       python -m weightcache_operator.socketdir sweep [--every S] ROOT...",
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
