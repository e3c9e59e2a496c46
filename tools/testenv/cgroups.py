"""The real node's own cgroup subtree: everything it starts lives under one name.

kubelet gets `cgroupRoot: /<name>` (its pods go below it) and containerd
joins `/<name>/runtime` before exec, so its shims do too. Teardown then
reaches every process the node ever started, reparented shims and container
processes included, by walking one subtree; and two nodes on one machine
never share a cgroup.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

RUNTIME = "runtime"


def hierarchies() -> list[Path]:
    """Mount points of every cgroup hierarchy (each v1 controller, or the v2 tree)."""
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype = right.split()[0]
        if fstype in ("cgroup", "cgroup2"):
            mounts.append(Path(left.split()[4]))
    return mounts


def _dirs(name: str) -> list[Path]:
    return [h / name.strip("/") for h in hierarchies()]


def create(name: str) -> None:
    """/<name> and /<name>/runtime in every hierarchy (cpusets seeded from the parent)."""
    for top in _dirs(name):
        for d in (top, top / RUNTIME):
            d.mkdir(exist_ok=True)
            for knob in ("cpuset.cpus", "cpuset.mems"):
                if (d / knob).exists() and not (d / knob).read_text().strip():
                    (d / knob).write_text((d.parent / knob).read_text())
        controllers = top.parent / "cgroup.subtree_control"
        if (top / "cgroup.controllers").exists() and controllers.exists():
            # cgroup v2: hand the node's subtree every controller its parent delegates.
            wanted = " ".join(f"+{c}" for c in (top / "cgroup.controllers").read_text().split())
            if wanted:
                (top / "cgroup.subtree_control").write_text(wanted)


def join_runtime(name: str) -> None:
    """Move the calling process into /<name>/runtime (runs in a child before exec)."""
    pid = str(os.getpid())
    for top in _dirs(name):
        (top / RUNTIME / "cgroup.procs").write_text(pid)


def processes(name: str) -> set[int]:
    pids: set[int] = set()
    for top in _dirs(name):
        if not top.is_dir():
            continue
        for procs in top.rglob("cgroup.procs"):
            try:
                pids.update(int(p) for p in procs.read_text().split())
            except OSError:
                continue
    return pids


def kill_all(name: str, timeout: float = 30.0) -> set[int]:
    """SIGKILL every process in the subtree until none is left; return those that would not go."""
    deadline = time.monotonic() + timeout
    while (pids := processes(name)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    return processes(name)


def remove(name: str) -> list[Path]:
    """rmdir the subtree bottom-up in every hierarchy; return what could not be removed."""
    left = []
    for top in _dirs(name):
        if not top.is_dir():
            continue
        dirs = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
        for d in [*dirs, top]:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                left.append(d)
    return left
