"""``memfd``: sealed anonymous memory files on the CPU, mapped read-only by engines.

The daemon writes the weights into a memfd, then seals it against writes,
growth and shrinking. An engine mapping a sealed memfd knows the bytes cannot
change (or vanish and SIGBUS) under it, whatever the daemon does next.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import warnings

import torch

from weightcache.transport.base import (
    AllocationEntry,
    DaemonMemory,
    Export,
    WeightCacheTransportBackend,
)

REQUIRED_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def map_read_only(fd: int, size: int) -> torch.Tensor:
    """A flat uint8 tensor over ``fd``'s first ``size`` bytes, mapped PROT_READ."""
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    with warnings.catch_warnings():
        # torch warns that the buffer is not writable: that is the point.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8)


class MemfdMemory(DaemonMemory):
    backend_name = "memfd"

    def __init__(self, sizes: list[int], device: torch.device) -> None:
        super().__init__(sizes, device)
        self.fds: list[int] = []
        self._writable: list[mmap.mmap] = []
        try:
            for i, size in enumerate(sizes):
                fd = os.memfd_create(f"weightcache-{i}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
                self.fds.append(fd)
                os.ftruncate(fd, size)
                if size:
                    self._writable.append(mmap.mmap(fd, size, mmap.MAP_SHARED))
                    self.buffers.append(torch.frombuffer(self._writable[-1], dtype=torch.uint8))
                else:
                    self.buffers.append(torch.empty(0, dtype=torch.uint8))
        except BaseException:
            self.close()
            raise

    def finish_load(self) -> None:
        # F_SEAL_WRITE is refused while a writable shared mapping exists, so the
        # loader's views must be gone before the mappings close.
        self.buffers = []
        for mapping in self._writable:
            mapping.close()
        self._writable = []
        for fd in self.fds:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS)
        pairs = zip(self.fds, self.sizes, strict=True)
        self.buffers = [map_read_only(fd, size) for fd, size in pairs]

    def close(self) -> None:
        self.buffers = []
        for mapping in self._writable:
            try:
                mapping.close()
            except BufferError:
                pass  # a view is still alive; the mapping goes with it
        self._writable = []
        for fd in self.fds:
            os.close(fd)
        self.fds = []


class MemfdBackend(WeightCacheTransportBackend):
    name = "memfd"
    uses_fds = True
    keeps_fds = True

    def allocate(self, sizes: list[int], device: torch.device) -> DaemonMemory:
        if device.type != "cpu":
            raise RuntimeError(
                f"memfd holds weights in CPU memory; the daemon's device is {device}"
            )
        return MemfdMemory(sizes, device)

    def prepare_export(self, memory: DaemonMemory) -> Export:
        assert isinstance(memory, MemfdMemory)
        return Export(handles=None, fds=list(memory.fds))

    def import_tensor(self, entry: AllocationEntry) -> torch.Tensor:
        assert entry.fd is not None
        seals = fcntl.fcntl(entry.fd, fcntl.F_GET_SEALS)
        if seals & REQUIRED_SEALS != REQUIRED_SEALS:
            raise RuntimeError(
                f"allocation {entry.index}: the daemon's memfd is not sealed "
                "(write/shrink/grow); refusing to map memory that may change"
            )
        actual = os.fstat(entry.fd).st_size
        if actual != entry.size:
            raise RuntimeError(
                f"allocation {entry.index}: memfd holds {actual} bytes, layout says {entry.size}"
            )
        return map_read_only(entry.fd, entry.size)
