"""Reading checkpoint tensors straight into the daemon's allocations.

Host memory is filled with ``preadv`` into the destination itself, so the
model never exists twice. Device memory is filled through a pinned staging
buffer, the host read of one tensor overlapping the copy of the previous.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch

from weightcache.checkpoint import Checkpoint, TensorRecord
from weightcache.layout import TensorSpec
from weightcache.protocol import Layout


def target_dtype(source: torch.dtype, cast_to: torch.dtype | None) -> torch.dtype:
    """Floating-point tensors take the requested dtype; integer and bool tensors keep theirs."""
    if cast_to is not None and source.is_floating_point:
        return cast_to
    return source


def tensor_specs_for(checkpoint: Checkpoint, cast_to: torch.dtype | None) -> list[TensorSpec]:
    return [TensorSpec(t.name, target_dtype(t.dtype, cast_to), t.shape) for t in checkpoint.tensors]


def expected_bytes(specs: list[TensorSpec]) -> int:
    """Bytes the weights need, before alignment: the floor for what a daemon must hold."""
    return sum(s.nbytes for s in specs)


def _host_view(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU tensor's bytes (no numpy needed)."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def _pread_into(fd: int, view: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(f"{path}: unexpected end of file at byte {offset + done}")
        done += n


def _destinations(
    checkpoint: Checkpoint, layout: Layout
) -> Iterator[tuple[TensorRecord, int, int]]:
    """(record, allocation index, byte offset) in file order, for sequential reads."""
    where = {}
    for g in layout.groups:
        for i, name in enumerate(g.names):
            where[name] = (g.allocation, g.offset + i * g.step)
    for record in checkpoint.tensors:
        allocation, offset = where[record.name]
        yield record, allocation, offset


def load_into_buffers(
    checkpoint: Checkpoint,
    layout: Layout,
    buffers: list[torch.Tensor],
    cast_to: torch.dtype | None,
) -> None:
    """Fill ``buffers`` (flat uint8, one per allocation) with every tensor of the checkpoint."""
    with ExitStack() as stack:
        fds = {}
        for f in checkpoint.files:
            fd = os.open(f.path, os.O_RDONLY)
            stack.callback(os.close, fd)
            fds[f.path] = fd
        on_device = any(b.device.type != "cpu" for b in buffers)
        staging = _Staging() if on_device else None
        for record, allocation, offset in _destinations(checkpoint, layout):
            if record.nbytes == 0:
                continue
            dest_dtype = target_dtype(record.dtype, cast_to)
            dest_bytes = record.nbytes // record.dtype.itemsize * dest_dtype.itemsize
            dest = buffers[allocation][offset : offset + dest_bytes]
            fd = fds[record.file]
            if staging is not None:
                staging.copy(fd, record, dest, dest_dtype)
            elif dest_dtype == record.dtype:
                _pread_into(fd, _host_view(dest), record.file_offset, record.file)
            else:
                src = torch.empty(record.nbytes, dtype=torch.uint8)
                _pread_into(fd, _host_view(src), record.file_offset, record.file)
                dest.view(dest_dtype).copy_(src.view(record.dtype))
        if staging is not None:
            staging.finish()


class _Staging:
    """Two pinned host buffers: read the next tensor while the last one is copied."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def _buffer(self, nbytes: int) -> torch.Tensor:
        i = self._turn
        event = self._events[i]
        if event is not None:
            event.synchronize()  # the copy out of this buffer has finished
        while len(self._buffers) <= i:
            self._buffers.append(torch.empty(0, dtype=torch.uint8).pin_memory())
        if self._buffers[i].numel() < nbytes:
            self._buffers[i] = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        return self._buffers[i][:nbytes]

    def copy(
        self, fd: int, record: TensorRecord, dest: torch.Tensor, dest_dtype: torch.dtype
    ) -> None:
        host = self._buffer(record.nbytes)
        _pread_into(fd, _host_view(host), record.file_offset, record.file)
        if dest_dtype == record.dtype:
            dest.copy_(host, non_blocking=True)
        else:
            dest.view(dest_dtype).copy_(host.view(record.dtype), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._events[self._turn] = event
        self._turn ^= 1

    def finish(self) -> None:
        torch.cuda.synchronize()
