"""Undo a real node: its processes, mounts, cgroups, namespace, sysctls and containers.

The node records what it sets up in a state file as it goes (node.py); the
functions here read that file, so the owner's stop(), the guard process (the
owner died without stopping) and `python -m tools.testenv down` all tear down
the same way, and each step is idempotent.

    python -m tools.testenv.nodeclean {guard STATE FD | teardown STATE}
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tools.testenv import cgroups, netns
from tools.testenv.nodeconfig import Layout, containerd_config, ctr_argv

# containerd's v2 shims put their sockets here whatever containerd's state dir is.
SHIM_SOCKET_DIR = Path("/run/containerd/s")
CONTAINER_LOG_LINKS = Path("/var/log/containers")


def write_state(layout: Layout, record: dict[str, Any]) -> None:
    tmp = layout.state_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.rename(layout.state_file)


def run_ctr(layout: Layout, *args: str, input: bytes | None = None,
         check: bool = True) -> subprocess.CompletedProcess[bytes]:
    result = subprocess.run([*ctr_argv(layout), *args], input=input, capture_output=True,
                            timeout=600)
    if check and result.returncode != 0:
        raise RuntimeError(f"ctr {' '.join(args)}: {result.stderr.decode(errors='replace')}")
    return result


def mount_points(mountinfo: str | None = None) -> list[str]:
    """Every mount point of /proc/self/mountinfo (or `mountinfo`), its octal escapes
    (space, tab, newline, backslash) decoded."""
    if mountinfo is None:
        mountinfo = Path("/proc/self/mountinfo").read_text()
    return [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
            for line in mountinfo.splitlines()]


def mounts_under(*roots: str, mountinfo: str | None = None) -> list[str]:
    """Mount points at or below any root, deepest first. The table names resolved paths:
    so must the roots (Layout's are)."""
    points = [p for p in mount_points(mountinfo)
              if any(p == r or p.startswith(r.rstrip("/") + "/") for r in roots)]
    return sorted(points, key=lambda p: -p.count("/"))


def unmount_all(*roots: str, keep: Sequence[str] = ()) -> list[str]:
    """Unmount everything below the roots (stacked mounts included) but the mount points in
    `keep`; return what is left."""

    def points() -> list[str]:
        return [p for p in mounts_under(*roots) if p not in keep]

    for _ in range(10):
        if not points():
            break
        for point in points():
            netns.umount(point)
    return points()


@contextlib.contextmanager
def offline_containerd(layout: Layout) -> Iterator[Callable[..., subprocess.CompletedProcess]]:
    """A containerd of our own on the store, CRI off (it would try to recover the dead
    containers), outside the node's namespace; yields a `ctr` runner for it."""
    scrub_dir = Path(layout.run, "scrub")
    scrub = Layout(run=str(scrub_dir), store=layout.store, name=layout.name,
                   cgroup=layout.cgroup, cluster_ip=layout.cluster_ip,
                   sockets=tempfile.mkdtemp(prefix="wc-scrub-", dir="/tmp"))
    scrub.containerd_state.mkdir(parents=True, exist_ok=True)
    config = scrub_dir / "containerd.toml"
    config.write_text(containerd_config(scrub, "unused", cri=False))
    with open(scrub_dir / "containerd.log", "ab") as out:
        proc = subprocess.Popen(["containerd", f"--config={config}"], stdout=out, umask=0o022,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while run_ctr(scrub, "version", check=False).returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"testenv: containerd on {layout.store} did not start: "
                    + (scrub_dir / "containerd.log").read_text(errors="replace")[-2000:]
                )
            time.sleep(0.1)
        yield lambda *args, check=True: run_ctr(scrub, *args, check=check)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        unmount_all(str(scrub_dir), layout.store)
        shutil.rmtree(scrub_dir, ignore_errors=True)
        shutil.rmtree(scrub.sockets, ignore_errors=True)


def stored_containers(layout: Layout) -> list[str]:
    """Ids of the containers the store records (a scrubbed store has none)."""
    with offline_containerd(layout) as ctr:
        return ctr("containers", "list", "--quiet").stdout.decode().split()


def scrub_store(layout: Layout) -> None:
    """Delete every container (and its snapshot) from the store, keeping the images."""
    with offline_containerd(layout) as ctr:
        for cid in ctr("containers", "list", "--quiet").stdout.decode().split():
            ctr("tasks", "delete", "--force", cid, check=False)
            ctr("containers", "delete", cid, check=False)
    # CRI's own records of the containers just deleted.
    for sub in ("sandboxes", "containers"):
        shutil.rmtree(Path(layout.store, "root", "io.containerd.grpc.v1.cri", sub),
                      ignore_errors=True)
    layout.dirty_marker.unlink(missing_ok=True)


def _dead_socket(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(path))
        except OSError:
            return True
    return False


def remove_dead_shim_sockets() -> None:
    """Shim sockets nobody listens on (a node's, once its shims are dead; the directory is
    shared with any other node on the machine, whose live sockets stay)."""
    if SHIM_SOCKET_DIR.is_dir():
        for sock in SHIM_SOCKET_DIR.iterdir():
            if sock.is_socket() and _dead_socket(sock):
                sock.unlink(missing_ok=True)


def teardown(state_file: Path) -> list[str]:
    """Undo everything a node recorded in its state file; return what could not be undone."""
    if not state_file.exists():
        return []
    record = json.loads(state_file.read_text())
    layout = Layout(**record["layout"])
    problems: list[str] = []
    Path(layout.dirty_marker).touch()
    stuck = cgroups.kill_all(layout.cgroup)
    if stuck:
        problems.append(f"processes that would not die: {sorted(stuck)}")
    # kubelet's root lies in `sockets`: pods' volumes are mounted there.
    left = unmount_all(layout.run, layout.store, layout.sockets)
    if layout.socket_root:
        left += unmount_all(layout.socket_root)
        with contextlib.suppress(OSError):
            Path(layout.socket_root).rmdir()
    if left:
        problems.append(f"mounts left: {left}")
    if not stuck and not left:
        try:
            scrub_store(layout)
        except (OSError, RuntimeError) as e:
            problems.append(str(e))
    problems += [f"cgroup left: {d}" for d in cgroups.remove(layout.cgroup)]
    remove_dead_shim_sockets()
    if CONTAINER_LOG_LINKS.is_dir():
        for link in CONTAINER_LOG_LINKS.iterdir():
            if link.is_symlink() and os.readlink(link).startswith(str(layout.pod_logs)):
                link.unlink()
    for d in reversed(record["created_dirs"]):
        with contextlib.suppress(OSError):
            Path(d).rmdir()  # only when empty: another node may still use it
    netns.delete(layout.netns)  # unpinned with the mounts above; this removes the file
    for name, value in record["sysctls"].items():
        try:
            Path("/proc/sys", name).write_text(value)
        except OSError as e:
            problems.append(f"sysctl {name}: {e}")
    if left:
        # Removing a tree that still holds mounts would delete what they show (a pod's
        # hostPath included): it stays, with the state file, for another teardown.
        return problems
    shutil.rmtree(layout.sockets, ignore_errors=True)
    # "kubelet": its root lay in `run` in state files written before it moved to `sockets`.
    for sub in ("kubelet", "containerd", "runc", "pod-logs", "store", "pki", "cni-ipam"):
        shutil.rmtree(Path(layout.run, sub), ignore_errors=True)
    state_file.unlink(missing_ok=True)
    return problems


def guard(state_file: Path, pipe: int) -> int:
    """Wait for the owner: a clean stop says "done"; anything else (EOF) means tear down."""
    data = b""
    while chunk := os.read(pipe, 16):
        data += chunk
    if data == b"done":
        return 0
    problems = teardown(state_file)
    for problem in problems:
        print(f"testenv guard: {problem}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) == 3 and args[0] == "guard":
        return guard(Path(args[1]), int(args[2]))
    if len(args) == 2 and args[0] == "teardown":
        problems = teardown(Path(args[1]))
        for problem in problems:
            print(f"testenv: {problem}", file=sys.stderr)
        return 1 if problems else 0
    print("usage: python -m tools.testenv.nodeclean {guard STATE FD | teardown STATE}",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
