"""Fault injection for the real-node tests: a daemon pushes itself over its memory limit.

An OOM kill is what a platform team meets when a limit is set too low; the
tests need the kernel to do it, at a moment they choose, to the daemon in its
container. The trigger is a file, ``<socket dir>/.daemon/<socket name>.inject-oom``:
:func:`watch` checks for it every second and, on finding it, removes it (so
the restarted container does not do it again), logs, and
:func:`exhaust_memory` allocates memory, touching every page, until the
kernel's OOM killer ends the process at the cgroup's limit. Without a limit
it refuses and keeps serving: it would exhaust the node instead.

Who can trigger it: whoever can create a file in ``.daemon/``, which is 0700
and owned by the daemon's uid (:mod:`.statedir`): that uid and root on the
node, who can already kill the daemon and read its re-adoption key. Engines
(other uids, in the daemon's group) cannot enter the directory, and nothing
the daemon receives over its socket or HTTP reaches this path.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path

from weightcache.daemon.statedir import StateDirError, opened_private_dir, state_dir

log = logging.getLogger(__name__)

OOM_TRIGGER_SUFFIX = ".inject-oom"
POLL_SECONDS = 1.0
# A cgroup v1 "no limit" is the largest page-aligned int64; anything this big is none.
_UNLIMITED = 1 << 60


class FaultRefused(RuntimeError):
    """The fault cannot be injected safely here; the message says why."""


def memory_limit(proc_cgroup: str = "/proc/self/cgroup",
                 root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """This process's cgroup memory limit in bytes, or None when it has none.

    cgroup v2: ``memory.max``; v1: ``memory/memory.limit_in_bytes``. Inside a
    container the hierarchy is mounted at the container's own cgroup, so the
    path /proc/self/cgroup names (the host's) is tried first, then the mount's
    root.
    """
    candidates = []
    for line in Path(proc_cgroup).read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            candidates += [root / path.lstrip("/") / "memory.max", root / "memory.max"]
        elif "memory" in controllers.split(","):
            base = root / "memory"
            candidates += [base / path.lstrip("/") / "memory.limit_in_bytes",
                           base / "memory.limit_in_bytes"]
    for candidate in candidates:
        with contextlib.suppress(OSError):
            value = candidate.read_text().strip()
            if value == "max" or int(value) >= _UNLIMITED:
                return None
            return int(value)
    return None


def exhaust_memory(chunk_bytes: int = 16 << 20) -> None:
    """Allocate and touch memory until the OOM killer ends this process.

    Raises :class:`FaultRefused` without a memory limit, and RuntimeError if
    twice the limit was allocated and the process still lives.
    """
    limit = memory_limit()
    if limit is None:
        raise FaultRefused(
            "this process's cgroup has no memory limit: pushing past it would exhaust the node"
        )
    page = os.sysconf("SC_PAGE_SIZE")
    held = []
    log.warning("fault injection: allocating memory past the cgroup limit of %d bytes", limit)
    while len(held) * chunk_bytes < 2 * limit:
        block = bytearray(chunk_bytes)
        block[::page] = b"\x01" * len(range(0, chunk_bytes, page))  # every page resident
        held.append(block)
    raise RuntimeError(f"allocated {2 * limit} bytes past a limit of {limit} and still alive")


def oom_trigger_name(socket_path: str) -> str:
    return os.path.basename(socket_path) + OOM_TRIGGER_SUFFIX


def take_oom_trigger(socket_path: str) -> bool:
    """Whether the trigger was there; it is removed (and the removal made durable) if so."""
    name = oom_trigger_name(socket_path)
    with opened_private_dir(state_dir(socket_path)) as directory:
        try:
            os.unlink(name, dir_fd=directory)
        except FileNotFoundError:
            return False
        os.fsync(directory)
    return True


def watch(socket_path: str, stop: threading.Event, poll_seconds: float = POLL_SECONDS) -> None:
    """Start the trigger's watcher thread; it ends with ``stop``."""

    def run() -> None:
        while not stop.wait(poll_seconds):
            try:
                if not take_oom_trigger(socket_path):
                    continue
                exhaust_memory()
            except (OSError, StateDirError, FaultRefused, RuntimeError, MemoryError) as exc:
                log.error("fault injection (%s) not done: %s", OOM_TRIGGER_SUFFIX, exc)

    threading.Thread(target=run, name="fault-injection", daemon=True).start()
