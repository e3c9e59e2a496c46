"""Executing a load plan: an engine's layout built from the daemon's verified bytes.

Each copy reads its source region from the checkpoint layout the daemon holds
where those bytes are resident (a tensor-parallel shard holds only its block;
:func:`weightcache.plan.rebase` says whether the region lies inside it, and a
cast layout serves only copies whose first cast is that one), device to
device or memory to memory; otherwise straight from the checkpoint file, in
pieces of at most ``PIECE_BYTES`` of file span. Then the fills. The result is
memory of the daemon's transport (sealed memfd, vmm_fd), ready to export.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import msgspec
import torch

from weightcache.checkpoint import Checkpoint, TensorRecord, dtype_from_name
from weightcache.daemon.loader import PIECE_BYTES, _host_view, _pread_into, target_dtype
from weightcache.daemon.provenance import stamp
from weightcache.daemon.resident import ResidentWeights
from weightcache.layout import plan_param_layout, tensor_specs
from weightcache.plan import LoadPlan, PlanSummary, Region, extent, narrow, numel, rebase
from weightcache.protocol import CacheConfig, fingerprint
from weightcache.shard import shard_tensor, split_dim
from weightcache.transport.base import DaemonMemory, WeightCacheTransportBackend


class _Resident(NamedTuple):
    """Where a checkpoint tensor sits in the checkpoint layout. ``box_*``: the block of the
    whole tensor its rank holds (a tensor-parallel shard); None: all of it."""

    allocation: int
    offset: int  # bytes
    dtype: torch.dtype  # as held (the daemon may hold it cast)
    box_start: list[int] | None
    box_shape: list[int] | None


class _Place(NamedTuple):
    """Where a parameter's dense storage sits in the engine layout."""

    allocation: int
    offset: int  # bytes
    dtype: torch.dtype
    numel: int


class _Typed:
    """Regions of a transport's buffers as tensors of a given element type. Each buffer is
    viewed once per type: a plan has thousands of copies, and slicing a device tensor for
    each cost more than the copies themselves (an MoE layout on the H200)."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.buffers = buffers
        self.views: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def region(self, allocation: int, offset: int, dtype: torch.dtype, r: Region) -> torch.Tensor:
        base = self.views.get((allocation, dtype))
        if base is None:
            base = self.views[allocation, dtype] = self.buffers[allocation].view(dtype)
        start = base.storage_offset() + offset // dtype.itemsize + r.offset
        return base.as_strided(r.shape, r.stride, start)


@dataclass
class BuildStats:
    copies_resident: int = 0
    copies_disk: int = 0
    bytes_from_disk: int = 0

    @property
    def source(self) -> str:
        if self.copies_disk and self.copies_resident:
            return "resident+disk"
        return "disk" if self.copies_disk else "resident"


def _residents(resident: ResidentWeights, checkpoint: Checkpoint) -> dict[str, _Resident]:
    """Every checkpoint tensor of the checkpoint layout, with its rank's box of the whole."""
    shard = resident.config.shard
    records = {t.name: t for t in checkpoint.tensors}
    out = {}
    for spec, allocation, offset in tensor_specs(resident.layout):
        record = records.get(spec.name)
        if record is None:
            continue
        box_start = box_shape = None
        if shard.tp_size > 1:
            dim = split_dim(shard.plan, record.name)
            cut = shard_tensor(record.name, record.shape, record.nbytes, dim, shard.tp_size,
                               shard.tp_rank)  # fmt: skip
            if cut.dim is not None:
                box_start = [0] * len(record.shape)
                box_start[cut.dim] = shard.tp_rank * cut.shape[cut.dim]
                box_shape = list(cut.shape)
        out[spec.name] = _Resident(allocation, offset, spec.dtype, box_start, box_shape)
    return out


def warm_batched_copy(device: torch.device) -> None:
    """Load the batched copy's kernel now, not during the first engine's build: CUDA loads a
    module on its first use (13 ms on the H200, more than a 16 GB layout's copies take)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            bits = torch.zeros(1, dtype=torch.int16, device=device)
            torch._foreach_copy_([bits], [bits.clone()])


def _places(layout) -> dict[str, _Place]:
    out = {}
    for g in layout.groups:
        dtype = dtype_from_name(g.dtype)
        for i, name in enumerate(g.names):
            out[name] = _Place(g.allocation, g.offset + i * g.step, dtype, math.prod(g.shape))
    return out


def build_layout(
    plan: LoadPlan,
    plan_hash: str,
    summary: PlanSummary,
    base_config: CacheConfig,
    checkpoint: Checkpoint,
    backend: WeightCacheTransportBackend,
    device: torch.device,
    resident: ResidentWeights | None,
) -> tuple[ResidentWeights, BuildStats]:
    """The engine layout ``plan`` describes, in fresh memory of ``backend``'s kind."""
    started = time.perf_counter()
    read_at = stamp(checkpoint.model_dir)  # before any disk read (provenance.py)
    layout = plan_param_layout(plan.params, backend.allocation_alignment(device))
    memory = backend.allocate(layout.allocation_sizes, device)
    stats = BuildStats()
    try:
        on_gpu = device.type == "cuda"
        with torch.cuda.device(device) if on_gpu else contextlib.nullcontext():
            _execute(plan, summary, layout, memory, checkpoint, resident, stats, on_gpu)
        memory.finish_load()
        export = backend.prepare_export(memory)
    except BaseException:
        memory.close()
        raise
    config = msgspec.structs.replace(base_config, plan=plan_hash)
    built = ResidentWeights(
        config=config,
        fingerprint=fingerprint(config),
        layout=layout,
        memory=memory,
        export=export,
        expected_bytes=summary.param_bytes,
        load_seconds=time.perf_counter() - started,
        load_source=stats.source,
        # Bytes copied from the checkpoint layout descend from its disk read: its stamps (if
        # the files changed since, successors then find them differ and read the disk).
        source=read_at if resident is None or not stats.copies_resident else resident.source,
    )
    return built, stats


def _execute(plan, summary, layout, memory: DaemonMemory, checkpoint, resident, stats, on_gpu):
    places = _places(layout)
    out = _Typed(memory.buffers)

    def target(place: _Place, r: Region, dtype: torch.dtype | None = None) -> torch.Tensor:
        return out.region(place.allocation, place.offset, dtype or place.dtype, r)

    if on_gpu:  # fresh device memory holds anything; memfd pages start zeroed
        for name, p in summary.params.items():
            if not p.complete:
                place = places[name]
                target(place, Region(0, [place.numel], [1])).zero_()
    residents = _residents(resident, checkpoint) if resident is not None else {}
    held = _Typed(resident.memory.buffers) if resident is not None else None
    cast_to = dtype_from_name(resident.config.dtype) if resident and resident.config.dtype else None
    records = {t.name: t for t in checkpoint.tensors}
    fds: dict[Path, int] = {}
    batch = _CopyBatch()
    try:
        for c in plan.copies:
            place = places[c.param]
            chain = [dtype_from_name(d) for d in c.casts]
            record = records[c.source]
            found = residents.get(c.source)
            resolved = _resident_region(found, record, c.src, chain, place.dtype, cast_to)
            if resolved is not None:
                assert found is not None and held is not None
                region, rest = resolved
                nbytes = numel(region.shape) * place.dtype.itemsize
                if rest or found.dtype != place.dtype or nbytes >= _CopyBatch.DIRECT_BYTES:
                    source = held.region(found.allocation, found.offset, found.dtype, region)
                    _copy(target(place, c.dst), source, rest)
                else:
                    bits = _BITS[place.dtype.itemsize]
                    source = held.region(found.allocation, found.offset, bits, region)
                    batch.add(target(place, c.dst, bits), source)
                stats.copies_resident += 1
                continue
            if record.file not in fds:
                fds[record.file] = os.open(record.file, os.O_RDONLY | os.O_CLOEXEC)
            for src, dst in _pieces(c.src, c.dst, record.dtype.itemsize):
                lo, hi = extent(src)  # type: ignore[misc]
                span = _read(fds[record.file], record, lo, hi, on_gpu)
                if on_gpu:
                    span = span.to(memory.buffers[place.allocation].device)
                view = span.as_strided(src.shape, src.stride, src.offset - lo)
                _copy(target(place, dst), view, chain)
                stats.bytes_from_disk += (hi - lo + 1) * record.dtype.itemsize
            stats.copies_disk += 1
        batch.flush()
        for f in plan.fills:
            target(places[f.param], f.dst).fill_(f.value)
        if on_gpu:
            torch.cuda.synchronize()
    finally:
        for fd in fds.values():
            os.close(fd)


def _resident_region(
    found: _Resident | None, record: TensorRecord, src: Region, chain, to: torch.dtype, cast_to
) -> tuple[Region, list[torch.dtype]] | None:
    """The copy's source as a region of the tensor as the checkpoint layout holds it, and
    the casts still to apply (before the one to ``to``, the parameter's dtype); None where
    those bytes are not resident (another rank's, or cast otherwise)."""
    if found is None:
        return None
    rest = list(chain)
    if found.dtype != record.dtype:
        # The layout holds the tensor cast; that serves copies whose first cast is the same.
        if target_dtype(record.dtype, cast_to) != found.dtype or [*rest, to][0] != found.dtype:
            return None
        rest = rest[1:]
    if found.box_shape is None:
        return src, rest  # the whole tensor is held (check_plan kept src inside it)
    moved = rebase(src, record.shape, found.box_start, found.box_shape)
    return None if moved is None else (moved, rest)


def _copy(target: torch.Tensor, src: torch.Tensor, chain) -> None:
    for dtype in chain:
        src = src.to(dtype)
    target.copy_(src)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _CopyBatch:
    """Small resident copies that change no dtype, issued together: an MoE plan has
    thousands of whole-expert copies, and one ``copy_`` each costs a kernel launch and a
    Python round trip. The plan writes no element twice, so their order does not matter.
    They are given as integers of the same width: ``_foreach_copy_`` passes floats through
    float32, which rewrote NaN payloads on the H200 (the daemon serves the checkpoint's
    bits). Copies of ``DIRECT_BYTES`` or more go alone: ``copy_`` moves them at memcpy
    speed, the batched kernel slower (benchmarks/README.md)."""

    LIMIT = 4096  # pairs held at once (a plan may have 2**22 copies)
    DIRECT_BYTES = 8 << 20

    def __init__(self) -> None:
        self.targets: list[torch.Tensor] = []
        self.sources: list[torch.Tensor] = []

    def add(self, target: torch.Tensor, source: torch.Tensor) -> None:
        self.targets.append(target)
        self.sources.append(source)
        if len(self.targets) >= self.LIMIT:
            self.flush()

    def flush(self) -> None:
        if self.targets:
            torch._foreach_copy_(self.targets, self.sources)
        self.targets, self.sources = [], []


def _pieces(src: Region, dst: Region, itemsize: int) -> Iterator[tuple[Region, Region]]:
    """The copy cut along its outer dims until each piece's source span is at most
    PIECE_BYTES (or a single element row)."""
    span = extent(src)
    if span is None:
        return
    lo, hi = span
    if (hi - lo + 1) * itemsize <= PIECE_BYTES or numel(src.shape) <= 1:
        yield src, dst
        return
    m = max((k for k, s in enumerate(src.shape) if s > 1), key=lambda k: src.stride[k])
    step = max(1, PIECE_BYTES // max(1, src.stride[m] * itemsize))
    for start in range(0, src.shape[m], step):
        n = min(step, src.shape[m] - start)
        yield from _pieces(narrow(src, m, start, n), narrow(dst, m, start, n), itemsize)


def _read(fd: int, record: TensorRecord, lo: int, hi: int, pinned: bool) -> torch.Tensor:
    """Elements ``[lo, hi]`` of a checkpoint tensor, from its file, as a 1-D host tensor."""
    size = record.dtype.itemsize
    raw = torch.empty((hi - lo + 1) * size, dtype=torch.uint8, pin_memory=pinned)
    _pread_into(fd, _host_view(raw), record.file_offset + lo * size, record.file)
    return raw.view(record.dtype)
