"""The real node's network namespace: loopback only, with the node's address on `lo`.

The namespace is pinned by a bind mount on a file of the run directory (not
under /run/netns, so `ip netns` leaves no trace), and has no device but `lo`:
nothing inside can reach anything but itself. kubelet refuses a loopback node
IP, so the node's address (10.250.0.1) sits on `lo` beside 127.0.0.1, and so
does the `kubernetes` Service's ClusterIP, behind which bridge.py forwards to
the API server (there is no kube-proxy).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path

CLONE_NEWNET = 0x40000000
MNT_DETACH = 2

_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns(CLONE_NEWNET): {os.strerror(errno)}")


def umount(path: Path | str) -> None:
    """Lazy unmount; an already-unmounted path is fine."""
    if _libc.umount2(str(path).encode(), MNT_DETACH) != 0:
        errno = ctypes.get_errno()
        if errno not in (22, 2):  # EINVAL: not a mount point; ENOENT: gone
            raise OSError(errno, f"umount {path}: {os.strerror(errno)}")


def create(path: Path, addresses: Iterable[str]) -> None:
    """A new network namespace pinned at `path`, `lo` up, each address (/32) on `lo`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    # unshare(1) binds the new namespace onto `path`; the file keeps it alive.
    subprocess.run(["unshare", f"--net={path}", "true"], check=True, capture_output=True)
    run_in(path, ["ip", "link", "set", "lo", "up"])
    for address in addresses:
        run_in(path, ["ip", "addr", "add", f"{address}/32", "dev", "lo"])


def run_in(path: Path, argv: list[str]) -> str:
    result = subprocess.run(
        ["nsenter", f"--net={path}", *argv], capture_output=True, text=True
    )
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} in {path}: {result.stderr.strip()}")
    return result.stdout


def delete(path: Path) -> None:
    """Unpin and remove; the namespace goes when its last process has exited."""
    umount(path)
    path.unlink(missing_ok=True)


@contextlib.contextmanager
def entered(path: Path) -> Iterator[None]:
    """Run the body with this thread in the namespace (sockets made there stay there)."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(path, os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(home)
    finally:
        os.close(target)
        os.close(home)


def enter_for_good(path: Path) -> None:
    """Move this thread into the namespace (a worker thread that only dials in there)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        _setns(fd)
    finally:
        os.close(fd)
