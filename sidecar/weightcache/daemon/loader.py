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
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from weightcache.checkpoint import Checkpoint, TensorRecord
from weightcache.layout import TensorSpec
from weightcache.protocol import Layout, ShardSpec
from weightcache.shard import TensorShard, plan_shards

# Large enough that a read is a long sequential request, small enough that
# eight workers' pinned buffers stay modest (8 x 64 MiB).
PIECE_BYTES = 64 * 1024 * 1024
# The CPUs this process may run on (a container's limit), not the host's count.
DEFAULT_WORKERS = min(8, len(os.sched_getaffinity(0)))


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
    """``rows`` byte ranges of one tensor's source bytes, the first ``[start, end)``, each
    ``stride`` after the previous (a run of a row-parallel shard's rows; usually one range),
    placed back to back from ``dest_offset``."""

    record: TensorRecord
    start: int
    end: int
    allocation: int
    dest_offset: int  # where the piece's first destination byte goes
    dest_dtype: torch.dtype
    rows: int = 1
    stride: int = 0

    @property
    def span_end(self) -> int:
        """End of the source bytes the piece's rows lie in (other ranks' bytes between them)."""
        return self.start + (self.rows - 1) * self.stride + (self.end - self.start)

    @property
    def nbytes(self) -> int:
        return self.rows * (self.end - self.start)


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
            placed = Piece(record, 0, 0, allocation, offset, dest_dtype)
            pieces += _pieces(placed, shards[record.name], piece_bytes)
        chunks += _group(f.path, pieces, piece_bytes)
    return chunks


def _pieces(placed: Piece, shard: TensorShard, piece_bytes: int) -> list[Piece]:
    """The shard's ranges of one tensor as pieces spanning at most ``piece_bytes`` each."""
    size = placed.record.dtype.itemsize
    # Split at element boundaries so a cast converts whole elements.
    step = max(size, piece_bytes // size * size)

    def piece(start: int, end: int, written: int, rows: int = 1) -> Piece:
        # `written`: source bytes of the shard before this piece; they fill the destination.
        dest = placed.dest_offset + written // size * placed.dest_dtype.itemsize
        return replace(placed, start=start, end=end, dest_offset=dest, rows=rows,
                       stride=shard.stride if rows > 1 else 0)  # fmt: skip

    n = shard.length
    if shard.count > 1 and shard.stride <= step:
        # Row-parallel: whole runs of rows per piece, so a Llama-70B rank plans and copies
        # thousands of pieces, not a million rows.
        per = step // shard.stride
        out = []
        for first in range(0, shard.count, per):
            start = shard.start + first * shard.stride
            out.append(piece(start, start + n, first * n, min(per, shard.count - first)))
        return out
    out = []
    for i in range(shard.count):
        first = shard.start + i * shard.stride
        for start in range(first, first + n, step):
            out.append(piece(start, min(first + n, start + step), i * n + start - first))
    return out


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
            end = current[-1].record.file_offset + current[-1].span_end
            if piece is None or piece.record.file_offset + piece.span_end - start > limit:
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
    n = piece.nbytes // piece.record.dtype.itemsize * piece.dest_dtype.itemsize
    return buffers[piece.allocation][piece.dest_offset : piece.dest_offset + n]


def _copy_rows(dest: torch.Tensor, span: torch.Tensor, piece: Piece) -> None:
    """Gather (and cast) the piece's rows from ``span``, its source bytes, into ``dest``."""
    size = piece.record.dtype.itemsize
    row = (piece.end - piece.start) // size
    rows = span.view(piece.record.dtype).as_strided((piece.rows, row), (piece.stride // size, 1))
    dest.view(piece.dest_dtype).view(piece.rows, row).copy_(rows, non_blocking=True)


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
            if piece.rows == 1 and piece.dest_dtype == piece.record.dtype:
                _pread_into(fd, _host_view(dest), offset, chunk.path)
            else:
                # A cast, or rows with other ranks' bytes between them: through a temporary.
                span = torch.empty(piece.span_end - piece.start, dtype=torch.uint8)
                _pread_into(fd, _host_view(span), offset, chunk.path)
                _copy_rows(dest, span, piece)

    def finish(self) -> None:
        pass


class _WorkerState:
    """One loader thread's stream, pinned buffer and (row shards) device staging buffer."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream
        self.pinned = torch.empty(0, dtype=torch.uint8, pin_memory=True)
        self.staging: torch.Tensor | None = None
        self.done: torch.cuda.Event | None = None


class _DeviceReader:
    """GPU destination: each worker thread owns a pinned buffer and a stream (and, for
    row-parallel shards, a device staging buffer the rows are gathered from)."""

    def __init__(self, device: torch.device, fds: dict[Path, int], buffers: list[torch.Tensor]):
        self._device = device
        self._fds = fds
        self._buffers = buffers
        self._local = threading.local()
        self._states: list[_WorkerState] = []
        self._lock = threading.Lock()

    def _state(self) -> _WorkerState:
        state = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = _WorkerState(torch.cuda.Stream(device=self._device))
            with self._lock:
                self._states.append(state)  # finish() syncs every worker's stream
        return state

    def _staged(self, state: _WorkerState, host: torch.Tensor) -> torch.Tensor:
        """``host`` copied to this worker's device staging buffer (on its stream)."""
        size = host.numel()
        if state.staging is None or state.staging.numel() < size:
            # Allocated on the worker's stream: only its own later copies reuse the block.
            state.staging = torch.empty(size, dtype=torch.uint8, device=self._device)
        staged = state.staging[:size]
        staged.copy_(host, non_blocking=True)
        return staged

    def read(self, chunk: Chunk) -> None:
        state = self._state()
        if state.done is not None:
            state.done.synchronize()  # this worker's previous copies have left the buffer
        size = chunk.file_end - chunk.file_start
        if state.pinned.numel() < size:
            state.pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        host = state.pinned[:size]
        _pread_into(self._fds[chunk.path], _host_view(host), chunk.file_start, chunk.path)
        with torch.cuda.device(self._device), torch.cuda.stream(state.stream):
            for piece in chunk.pieces:
                at = piece.record.file_offset + piece.start - chunk.file_start
                src = host[at : at + piece.span_end - piece.start]
                dest = _dest_view(self._buffers, piece)
                if piece.rows > 1:
                    # One host-to-device copy of the span, then a strided gather on the GPU.
                    _copy_rows(dest, self._staged(state, src), piece)
                elif piece.dest_dtype == piece.record.dtype:
                    dest.copy_(src, non_blocking=True)
                else:
                    dest.view(piece.dest_dtype).copy_(
                        src.view(piece.record.dtype), non_blocking=True
                    )
            state.done = torch.cuda.Event()
            state.done.record(state.stream)

    def finish(self) -> None:
        staged = False
        for state in self._states:
            state.stream.synchronize()
            staged |= state.staging is not None
            state.staging = None
        if staged:
            torch.cuda.empty_cache()  # the staging buffers' memory goes back to the driver
