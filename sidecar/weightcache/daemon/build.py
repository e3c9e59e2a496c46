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


@dataclass(frozen=True)
class _Resident:
    """Where a checkpoint tensor sits in the checkpoint layout: its (shard's) elements."""

    flat: torch.Tensor  # 1-D, the resident dtype
    box_start: list[int]
    box_shape: list[int]


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
    """Every checkpoint tensor of the checkpoint layout, as its rank's box of the whole."""
    shard = resident.config.shard
    records = {t.name: t for t in checkpoint.tensors}
    out = {}
    for spec, allocation, offset in tensor_specs(resident.layout):
        record = records.get(spec.name)
        if record is None:
            continue
        buffer = resident.memory.buffers[allocation]
        flat = buffer[offset : offset + spec.nbytes].view(spec.dtype)
        dim = split_dim(shard.plan, record.name)
        cut = shard_tensor(record.name, record.shape, record.nbytes, dim, shard.tp_size,
                           shard.tp_rank)  # fmt: skip
        start = [0] * len(record.shape)
        if cut.dim is not None:
            start[cut.dim] = shard.tp_rank * cut.shape[cut.dim]
        out[spec.name] = _Resident(flat, start, list(cut.shape))
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


def param_storages(layout, buffers: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each parameter's dense storage as a 1-D tensor of its dtype over ``buffers``."""
    out = {}
    for g in layout.groups:
        dtype = dtype_from_name(g.dtype)
        size = math.prod(g.shape) * dtype.itemsize
        buffer = buffers[g.allocation]
        for i, name in enumerate(g.names):
            start = g.offset + i * g.step
            out[name] = buffer[start : start + size].view(dtype)
    return out


def _execute(plan, summary, layout, memory: DaemonMemory, checkpoint, resident, stats, on_gpu):
    storages = param_storages(layout, memory.buffers)
    if on_gpu:  # fresh device memory holds anything; memfd pages start zeroed
        for name, p in summary.params.items():
            if not p.complete:
                storages[name].zero_()
    residents = _residents(resident, checkpoint) if resident is not None else {}
    cast_to = dtype_from_name(resident.config.dtype) if resident and resident.config.dtype else None
    records = {t.name: t for t in checkpoint.tensors}
    fds: dict[Path, int] = {}
    batch = _CopyBatch()
    try:
        for c in plan.copies:
            dst_flat = storages[c.param]
            chain = [dtype_from_name(d) for d in c.casts]
            record = records[c.source]
            source = _resident_view(
                residents.get(c.source), record, c.src, chain, dst_flat.dtype, cast_to
            )
            if source is not None:
                view, rest = source
                if rest or view.dtype != dst_flat.dtype:
                    _copy(dst_flat, c.dst, view, rest)
                else:
                    batch.add(_target(dst_flat, c.dst), view)
                stats.copies_resident += 1
                continue
            if record.file not in fds:
                fds[record.file] = os.open(record.file, os.O_RDONLY | os.O_CLOEXEC)
            for src, dst in _pieces(c.src, c.dst, record.dtype.itemsize):
                lo, hi = extent(src)  # type: ignore[misc]
                span = _read(fds[record.file], record, lo, hi, on_gpu)
                if on_gpu:
                    span = span.to(dst_flat.device)
                view = span.as_strided(src.shape, src.stride, src.offset - lo)
                _copy(dst_flat, dst, view, chain)
                stats.bytes_from_disk += (hi - lo + 1) * record.dtype.itemsize
            stats.copies_disk += 1
        batch.flush()
        for f in plan.fills:
            d = storages[f.param]
            d.as_strided(f.dst.shape, f.dst.stride, d.storage_offset() + f.dst.offset).fill_(
                f.value
            )
        if on_gpu:
            torch.cuda.synchronize()
    finally:
        for fd in fds.values():
            os.close(fd)


def _resident_view(
    found: _Resident | None, record: TensorRecord, src: Region, chain, to: torch.dtype, cast_to
):
    """The copy's source as a view of the checkpoint layout, and the casts still to apply
    (before the one to ``to``, the parameter's dtype); None where those bytes are not
    resident (another rank's, or cast otherwise)."""
    if found is None:
        return None
    held = found.flat.dtype
    rest = list(chain)
    if held != record.dtype:
        # The layout holds the tensor cast; that serves copies whose first cast is the same.
        if target_dtype(record.dtype, cast_to) != held or [*rest, to][0] != held:
            return None
        rest = rest[1:]
    if found.box_shape == list(record.shape):
        moved = src  # the whole tensor is resident (check_plan kept src inside it)
    else:
        moved = rebase(src, record.shape, found.box_start, found.box_shape)
        if moved is None:
            return None
    flat = found.flat
    view = flat.as_strided(moved.shape, moved.stride, flat.storage_offset() + moved.offset)
    return view, rest


def _target(dst_flat: torch.Tensor, dst: Region) -> torch.Tensor:
    return dst_flat.as_strided(dst.shape, dst.stride, dst_flat.storage_offset() + dst.offset)


def _copy(dst_flat: torch.Tensor, dst: Region, src: torch.Tensor, chain) -> None:
    for dtype in chain:
        src = src.to(dtype)
    _target(dst_flat, dst).copy_(src)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _CopyBatch:
    """Resident copies that change no dtype, issued together: an MoE plan has thousands of
    whole-expert copies, and one ``copy_`` each costs a kernel launch and its Python round
    trip apiece (on the H200 that was most of an MoE layout's build time). The plan writes
    no element twice, so the order they run in does not matter. They are copied as integers
    of the same width: ``_foreach_copy_`` passes floats through float32, which would rewrite
    a NaN's payload bits (the daemon serves the checkpoint's bits, NaNs included)."""

    LIMIT = 4096  # pairs held at once (a plan may have 2**22 copies)

    def __init__(self) -> None:
        self.targets: list[torch.Tensor] = []
        self.sources: list[torch.Tensor] = []

    def add(self, target: torch.Tensor, source: torch.Tensor) -> None:
        bits = _BITS[target.element_size()]
        self.targets.append(target.view(bits))
        self.sources.append(source.view(bits))
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
