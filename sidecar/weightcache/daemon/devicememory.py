"""How much memory the daemon's device has, and how much of it is free.

What the daemon reports (``memoryTotalBytes``, ``memoryFreeBytes``) and what
``--rollout auto`` checks before a load beside kept generations
(:mod:`.generations`):

- CUDA: ``cudaMemGetInfo`` of the daemon's device (``torch.cuda.mem_get_info``):
  the whole GPU, every process's allocations counted. Not run in CI (no GPU
  there): :func:`cuda_memory` is the only CUDA path of this module.
- CPU: the daemon's own cgroup, found through ``/proc/self/cgroup``: the limit
  less the working set, as the kubelet counts it (v2 ``memory.max``, then
  ``memory.current`` less ``inactive_file`` of ``memory.stat``; v1
  ``memory.limit_in_bytes``, ``memory.usage_in_bytes`` less ``total_inactive_file``),
  the tightest of its cgroup and the cgroups above it that the container can see
  (a pod's limit may sit one level up); without any limit, the node's
  ``/proc/meminfo`` (``MemTotal``, ``MemAvailable``). Inactive page cache (a
  checkpoint just read from disk) is given back before the cgroup's OOM killer
  acts, so it is room; the weights' memfd pages are shmem, never on that list.

Inside a container the hierarchy is mounted at the container's own cgroup,
while ``/proc/self/cgroup`` names the host's path (cgroup v1, or v2 without a
cgroup namespace): the path is tried below the mount first, then the mount's
root is taken as the process's own cgroup.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# A cgroup v1 "no limit" is the largest page-aligned int64; anything this big is none.
_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class DeviceMemory:
    total: int
    free: int
    # Where the figures come from: "cuda", "cgroup v2 <dir>", "cgroup v1 <dir>", "meminfo".
    source: str


def sample(device: torch.device) -> DeviceMemory | None:
    """The device's memory now, or None where nothing can be read (logged once per cause)."""
    try:
        return cuda_memory(device) if device.type == "cuda" else cpu_memory()
    except (OSError, RuntimeError, ValueError) as exc:
        log.warning("cannot read the memory of %s: %s", device, exc)
        return None


def cuda_memory(device: torch.device) -> DeviceMemory:
    """``cudaMemGetInfo`` on ``device`` (the whole GPU: every process's memory counts)."""
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(int(total), int(free), "cuda")


def cpu_memory(
    proc_cgroup: Path = Path("/proc/self/cgroup"),
    root: Path = Path("/sys/fs/cgroup"),
    meminfo: Path = Path("/proc/meminfo"),
) -> DeviceMemory:
    """The daemon's cgroup's limit and what is left under it; the node's meminfo without one."""
    limited = cgroup_memory(proc_cgroup.read_text(), root)
    return limited if limited is not None else meminfo_memory(meminfo.read_text())


def cgroup_memory(proc_cgroup: str, root: Path) -> DeviceMemory | None:
    """The tightest memory limit over this process's cgroup and its visible ancestors, as
    (limit, limit − working set), or None when none of them has one."""
    best: DeviceMemory | None = None
    for version, directory in _cgroup_dirs(proc_cgroup, root):
        limit_file, usage_file, inactive_stat = (
            ("memory.max", "memory.current", "inactive_file") if version == 2
            else ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
        with contextlib.suppress(OSError, ValueError):
            raw = (directory / limit_file).read_text().strip()
            if raw == "max" or int(raw) >= _UNLIMITED:
                continue
            limit = int(raw)
            usage = int((directory / usage_file).read_text().strip())
            working_set = max(0, usage - _stat(directory / "memory.stat", inactive_stat))
            found = DeviceMemory(limit, max(0, limit - working_set),
                                 f"cgroup v{version} {directory}")
            if best is None or found.free < best.free:
                best = found
    return best


def _stat(path: Path, name: str) -> int:
    """One counter of a cgroup's ``memory.stat``; 0 where the file or the line is missing
    (the working set is then the whole usage, as before the kernel had the counter)."""
    try:
        text = path.read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return int(value)
    return 0


def _cgroup_dirs(proc_cgroup: str, root: Path) -> list[tuple[int, Path]]:
    """The memory cgroup directories to read, own first, then each ancestor still below the
    mount (v2 when the unified line is the only one, else the v1 memory controller)."""
    found: list[tuple[int, Path]] = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            version, base = 2, root
        elif "memory" in controllers.split(","):
            version, base = 1, root / "memory"
        else:
            continue
        own = base / path.lstrip("/")
        if not own.is_dir():
            own = base  # a container: the mount is its own cgroup
        found += [(version, d) for d in (own, *own.parents) if d == base or base in d.parents]
    # v1's memory controller decides where it is mounted (a v2 line may exist beside it).
    if any(v == 1 for v, _ in found):
        found = [(v, d) for v, d in found if v == 1]
    return list(dict.fromkeys(found))


def meminfo_memory(meminfo: str) -> DeviceMemory:
    """``MemTotal`` and ``MemAvailable`` of ``/proc/meminfo`` (kB), in bytes."""
    fields: dict[str, int] = {}
    for line in meminfo.splitlines():
        name, _, rest = line.partition(":")
        value = rest.split()
        if value and value[0].isdigit():
            fields[name] = int(value[0]) * 1024
    try:
        return DeviceMemory(fields["MemTotal"], fields["MemAvailable"], "meminfo")
    except KeyError as exc:
        raise ValueError(f"/proc/meminfo has no {exc.args[0]}") from None
