"""The weights a daemon holds, and how it came to hold them."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from weightcache.checkpoint import cache_config, read_checkpoint
from weightcache.daemon.loader import expected_bytes, load_into_buffers, tensor_specs_for
from weightcache.daemon.provenance import Source, stamp
from weightcache.layout import plan_layout
from weightcache.protocol import CacheConfig, Layout, ShardSpec, fingerprint
from weightcache.transport import get_daemon_transport_backend
from weightcache.transport.base import DaemonMemory, Export


@dataclass
class ResidentWeights:
    config: CacheConfig
    fingerprint: str
    layout: Layout
    memory: DaemonMemory
    export: Export
    expected_bytes: int
    load_seconds: float
    load_source: str  # disk | readopted | peer
    # load_source "peer": the GPU (UUID, or "cpu") the weights were copied from.
    seeded_from: str | None = None
    # Why no manifest describes these weights (set by whoever failed to write it): a
    # restarted daemon cannot re-adopt them and reloads.
    manifest_error: str | None = None
    # The checkpoint files' stamps before the disk read these bytes descend from
    # (provenance.py); None when unknown (re-adopted under a manifest that kept none).
    source: Source | None = None

    @property
    def transport(self) -> str:
        return self.memory.backend_name

    @property
    def preloaded_weights_bytes(self) -> int:
        return self.memory.preloaded_weights_bytes

    def close(self) -> None:
        self.memory.close()


def planned_bytes(
    model_dir: str | Path,
    device: torch.device,
    transport: str,
    dtype: torch.dtype | None = None,
    shard: ShardSpec | None = None,
    revision: str | None = None,
) -> int:
    """What :func:`load_from_disk` would allocate, from the checkpoint's headers alone."""
    specs = tensor_specs_for(read_checkpoint(model_dir), dtype, shard)
    backend = get_daemon_transport_backend(transport)
    return sum(plan_layout(specs, backend.allocation_alignment(device)).allocation_sizes)


def load_from_disk(
    model_dir: str | Path,
    device: torch.device,
    transport: str,
    dtype: torch.dtype | None = None,
    shard: ShardSpec | None = None,
    revision: str | None = None,
) -> ResidentWeights:
    """Read the checkpoint (``shard``'s rank of it) into memory of ``transport``'s kind and
    prepare it for export."""
    started = time.perf_counter()
    source = stamp(model_dir)  # before reading: a file changed meanwhile shows later
    checkpoint = read_checkpoint(model_dir)
    config = cache_config(checkpoint, device, dtype, shard, revision)
    backend = get_daemon_transport_backend(transport)
    specs = tensor_specs_for(checkpoint, dtype, shard)
    layout = plan_layout(specs, backend.allocation_alignment(device))
    memory = backend.allocate(layout.allocation_sizes, device)
    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            load_into_buffers(checkpoint, layout, memory.buffers, dtype, shard=shard)
        memory.finish_load()
        export = backend.prepare_export(memory)
    except BaseException:
        memory.close()
        raise
    return ResidentWeights(
        config=config,
        fingerprint=fingerprint(config),
        layout=layout,
        memory=memory,
        export=export,
        expected_bytes=expected_bytes(specs),
        load_seconds=time.perf_counter() - started,
        load_source="disk",
        source=source,
    )
