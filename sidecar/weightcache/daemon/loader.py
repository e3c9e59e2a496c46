"""Reading checkpoint tensors straight into the daemon's allocations.

The checkpoint is cut into pieces of at most ``PIECE_BYTES`` in file order and
read by a pool of threads (``preadv`` releases the GIL, so reads from several
shards, or several parts of one, proceed at once). With a tensor-parallel
shard spec only the rank's byte ranges of each tensor are read (see
:mod:`weightcache.shard`). Host memory is filled by reading into the
destination itself, so the model never exists twice. Device memory is filled
through one pinned buffer per worker: each worker reads a chunk, queues its
host-to-device copies on its own stream, and reads the next chunk while those
copies run.
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from weightcache.checkpoint import Checkpoint, TensorRecord
from weightcache.layout import TensorSpec
from weightcache.protocol import Layout, ShardSpec
from weightcache.shard import TensorShard, plan_shards

# Large enough that a read is a long sequential request, small enough that
# eight workers' pinned buffers stay modest (8 x 64 MiB).
PIECE_BYTES = 64 * 1024 * 1024
DEFAULT_WORKERS = min(8, os.cpu_count() or 1)


def target_dtype(source: torch.dtype, cast_to: torch.dtype | None) -> torch.dtype:
    """Floating-point tensors take the requested dtype; integer and bool tensors keep theirs."""
    if cast_to is not None and source.is_floating_point:
        return cast_to
    return source


def shards_for(checkpoint: Checkpoint, shard: ShardSpec | None) -> dict[str, TensorShard]:
    return plan_shards(checkpoint.tensors, shard or ShardSpec())


def tensor_specs_for(
    checkpoint: Checkpoint, cast_to: torch.dtype | None, shard: ShardSpec | None = None
) -> list[TensorSpec]:
    """What the daemon holds: every tensor, cast, cut to ``shard``'s rank."""
    shards = shards_for(checkpoint, shard)
    return [
        TensorSpec(t.name, target_dtype(t.dtype, cast_to), shards[t.name].shape)
        for t in checkpoint.tensors
    ]


def expected_bytes(specs: list[TensorSpec]) -> int:
    """Bytes the weights need, before alignment: the floor for what a daemon must hold."""
    return sum(s.nbytes for s in specs)


@dataclass(frozen=True)
class Piece:
    """A byte range of one tensor: ``[start, end)`` of its source bytes."""

    record: TensorRecord
    start: int
    end: int
    allocation: int
    dest_offset: int  # where the piece's first destination byte goes
    dest_dtype: torch.dtype


@dataclass(frozen=True)
class Chunk:
    """Consecutive pieces of one file, read with one ``preadv``."""

    path: Path
    file_start: int
    file_end: int
    pieces: tuple[Piece, ...]


def plan_chunks(
    checkpoint: Checkpoint,
    layout: Layout,
    cast_to: torch.dtype | None,
    piece_bytes: int = PIECE_BYTES,
    shard: ShardSpec | None = None,
) -> list[Chunk]:
    """Cut the rank's bytes of every file, in file order, into chunks spanning at most
    ``piece_bytes`` (pure)."""
    shards = shards_for(checkpoint, shard)
    where = {}
    for g in layout.groups:
        for i, name in enumerate(g.names):
            where[name] = (g.allocation, g.offset + i * g.step)
    chunks: list[Chunk] = []
    for f in checkpoint.files:
        pieces = []
        for record in sorted(f.tensors, key=lambda t: t.file_offset):
            allocation, offset = where[record.name]
            dest_dtype = target_dtype(record.dtype, cast_to)
            size = record.dtype.itemsize
            # Split at element boundaries so a cast converts whole elements.
            step = max(size, piece_bytes // size * size)
            written = 0  # source bytes already placed: the ranges fill the destination in order
            for first, last in shards[record.name].ranges:
                for start in range(first, last, step):
                    end = min(last, start + step)
                    dest = offset + (written + start - first) // size * dest_dtype.itemsize
                    pieces.append(Piece(record, start, end, allocation, dest, dest_dtype))
                written += last - first
        chunks += _group(f.path, pieces, piece_bytes)
    return chunks


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


def _group(path: Path, pieces: list[Piece], limit: int) -> list[Chunk]:
    """Consecutive pieces whose file span is at most ``limit`` bytes (a larger piece stands
    alone). The span, not the sum of the pieces, is what a GPU worker's pinned buffer holds:
    it includes the other ranks' bytes between a shard's ranges."""
    chunks: list[Chunk] = []
    current: list[Piece] = []
    for piece in pieces + [None]:  # type: ignore[list-item]
        if current:
            start = current[0].record.file_offset + current[0].start
            end = current[-1].record.file_offset + current[-1].end
            if piece is None or piece.record.file_offset + piece.end - start > limit:
                chunks.append(Chunk(path, start, end, tuple(current)))
                current = []
        if piece is not None:
            current.append(piece)
    return chunks


def load_into_buffers(
    checkpoint: Checkpoint,
    layout: Layout,
    buffers: list[torch.Tensor],
    cast_to: torch.dtype | None,
    workers: int = DEFAULT_WORKERS,
    piece_bytes: int = PIECE_BYTES,
    shard: ShardSpec | None = None,
) -> None:
    """Fill ``buffers`` (flat uint8, one per allocation) with every tensor of the checkpoint,
    or with ``shard``'s rank of each."""
    chunks = plan_chunks(checkpoint, layout, cast_to, piece_bytes, shard)
    with ExitStack() as stack:
        fds = {}
        for f in checkpoint.files:
            fd = os.open(f.path, os.O_RDONLY)
            stack.callback(os.close, fd)
            fds[f.path] = fd
        device = buffers[0].device if buffers else torch.device("cpu")
        if device.type == "cuda":
            reader = _DeviceReader(device, fds, buffers)
        else:
            reader = _HostReader(fds, buffers)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="load") as pool:
            # list() re-raises the first worker exception here.
            list(pool.map(reader.read, chunks))
        reader.finish()


def _dest_view(buffers: list[torch.Tensor], piece: Piece) -> torch.Tensor:
    n = (piece.end - piece.start) // piece.record.dtype.itemsize * piece.dest_dtype.itemsize
    return buffers[piece.allocation][piece.dest_offset : piece.dest_offset + n]


class _HostReader:
    """CPU destination: read straight into it (into a temporary only to cast)."""

    def __init__(self, fds: dict[Path, int], buffers: list[torch.Tensor]) -> None:
        self._fds = fds
        self._buffers = buffers

    def read(self, chunk: Chunk) -> None:
        fd = self._fds[chunk.path]
        for piece in chunk.pieces:
            dest = _dest_view(self._buffers, piece)
            offset = piece.record.file_offset + piece.start
            if piece.dest_dtype == piece.record.dtype:
                _pread_into(fd, _host_view(dest), offset, chunk.path)
            else:
                src = torch.empty(piece.end - piece.start, dtype=torch.uint8)
                _pread_into(fd, _host_view(src), offset, chunk.path)
                dest.view(piece.dest_dtype).copy_(src.view(piece.record.dtype))

    def finish(self) -> None:
        pass


class _DeviceReader:
    """GPU destination: each worker thread owns a pinned buffer and a stream."""

    def __init__(self, device: torch.device, fds: dict[Path, int], buffers: list[torch.Tensor]):
        self._device = device
        self._fds = fds
        self._buffers = buffers
        self._local = threading.local()
        self._streams: list[torch.cuda.Stream] = []
        self._lock = threading.Lock()

    def _state(self):
        local = self._local
        if not hasattr(local, "stream"):
            local.stream = torch.cuda.Stream(device=self._device)
            local.pinned = torch.empty(0, dtype=torch.uint8).pin_memory()
            local.done = None
            with self._lock:
                self._streams.append(local.stream)
        return local

    def read(self, chunk: Chunk) -> None:
        state = self._state()
        if state.done is not None:
            state.done.synchronize()  # this worker's previous copies have left the buffer
        size = chunk.file_end - chunk.file_start
        if state.pinned.numel() < size:
            state.pinned = torch.empty(size, dtype=torch.uint8).pin_memory()
        host = state.pinned[:size]
        _pread_into(self._fds[chunk.path], _host_view(host), chunk.file_start, chunk.path)
        with torch.cuda.device(self._device), torch.cuda.stream(state.stream):
            for piece in chunk.pieces:
                at = piece.record.file_offset + piece.start - chunk.file_start
                src = host[at : at + piece.end - piece.start]
                dest = _dest_view(self._buffers, piece)
                if piece.dest_dtype == piece.record.dtype:
                    dest.copy_(src, non_blocking=True)
                else:
                    dest.view(piece.dest_dtype).copy_(
                        src.view(piece.record.dtype), non_blocking=True
                    )
            state.done = torch.cuda.Event()
            state.done.record(state.stream)

    def finish(self) -> None:
        for stream in self._streams:
            stream.synchronize()
