"""A restarting daemon takes its weights back from live engines instead of reading the disk.

On start, before any tensor byte is read: the manifest must exist and still
describe what this daemon would load (config from the checkpoint's headers
only); then each engine socket beside ours is asked in turn for its fds. The
first complete set whose every allocation matches the manifest's digest is
served as before. Sockets nobody listens on belong to dead engines and are
removed. Whatever happens, :class:`Readoption` says why, for the status.

Imported memory is never re-exported (the driver refuses to export an
imported VMM handle): the daemon serves the fds it received. ``torch_ipc``
cannot re-adopt: its memory dies with the daemon that allocated it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from weightcache.checkpoint import CheckpointError, cache_config, read_checkpoint
from weightcache.daemon.manifest import (
    Manifest,
    ManifestError,
    allocation_digests,
    manifest_path,
    read_manifest,
    stale_reason,
)
from weightcache.daemon.resident import ResidentWeights
from weightcache.daemon.server import PeerPolicy
from weightcache.handback import (
    EngineGone,
    ask_for_handback,
    engine_sockets,
    prepare_engines_dir,
)
from weightcache.layout import tensor_specs
from weightcache.protocol import ProtocolError, ShardSpec
from weightcache.transport import get_daemon_transport_backend
from weightcache.transport.base import (
    AllocationEntry,
    DaemonMemory,
    Export,
    ImportedMemory,
    WeightCacheTransportBackend,
)
from weightcache.wire import close_fds

log = logging.getLogger(__name__)


class AdoptedMemory(DaemonMemory):
    """Allocations an engine handed back, mapped read-only; their fds are what we serve."""

    def __init__(self, backend_name: str, imported: ImportedMemory, sizes: list[int], device):
        super().__init__(sizes, device)
        # One class for every fd transport; negotiation goes by this name.
        self.backend_name = backend_name  # type: ignore[misc]
        self._imported = imported
        self.buffers = imported.buffers
        self.fds = imported.fds

    def close(self) -> None:
        self.buffers = []
        self._imported.close()
        self.fds = []


@dataclass
class Readoption:
    resident: ResidentWeights | None
    reason: str


class ChecksumMismatch(RuntimeError):
    """An engine handed back allocations whose bytes differ from the manifest's."""


def try_readopt(
    socket_path: str,
    gpu: str,
    policy: PeerPolicy,
    model_dir: str | Path,
    device: torch.device,
    transport: str,
    dtype: torch.dtype | None = None,
    shard: ShardSpec | None = None,
    revision: str | None = None,
) -> Readoption:
    """Re-adopted weights, or None and why the daemon must load from disk.

    ``model_dir`` .. ``revision`` are :func:`load_from_disk`'s arguments.
    """
    started = time.perf_counter()
    backend = get_daemon_transport_backend(transport)
    if not backend.keeps_fds:
        return Readoption(
            None, f"transport {transport} cannot re-adopt: engines keep no fds to hand back"
        )
    try:
        prepare_engines_dir(socket_path)
    except OSError as exc:
        log.warning("cannot create the engines' hand-back directory: %s", exc)
    try:
        manifest = read_manifest(manifest_path(socket_path))
        checkpoint = read_checkpoint(model_dir)
    except (ManifestError, CheckpointError) as exc:
        return Readoption(None, str(exc))
    config = cache_config(checkpoint, device, dtype, shard, revision)
    stale = stale_reason(manifest, config=config, transport=transport, gpu=gpu)
    if stale is not None:
        return Readoption(None, stale)

    try:
        engines = engine_sockets(socket_path)
    except OSError as exc:
        return Readoption(None, f"cannot list the engines' sockets: {exc}")
    failures: list[str] = []
    gone = 0
    for engine in engines:
        name = os.path.basename(engine)
        try:
            memory, pid = _adopt_from(engine, socket_path, manifest, backend, device, policy)
        except EngineGone:
            gone += 1
            with contextlib.suppress(OSError):
                os.unlink(engine)
            continue
        except Exception as exc:  # whatever an engine does, the disk remains
            failures.append(f"{name}: {exc}")
            log.warning("engine %s did not hand the weights back: %s", name, exc)
            continue
        resident = ResidentWeights(
            config=manifest.config,
            fingerprint=manifest.fingerprint,
            layout=manifest.layout,
            memory=memory,
            export=Export(handles=None, fds=list(memory.fds)),
            expected_bytes=sum(spec.nbytes for spec, _, _ in tensor_specs(manifest.layout)),
            load_seconds=time.perf_counter() - started,
            load_source="readopted",
        )
        reason = (
            f"re-adopted {len(memory.sizes)} allocation(s) from engine pid {pid} ({name}), "
            "every checksum matching the manifest"
        )
        return Readoption(resident, "; ".join([reason, *failures]))
    if failures:
        return Readoption(None, "no engine handed back verified weights: " + "; ".join(failures))
    removed = f" ({gone} dead engine socket(s) removed)" if gone else ""
    return Readoption(None, f"no live engine to re-adopt from{removed}")


def _adopt_from(
    engine: str,
    socket_path: str,
    manifest: Manifest,
    backend: WeightCacheTransportBackend,
    device: torch.device,
    policy: PeerPolicy,
) -> tuple[AdoptedMemory, int]:
    """Import one engine's fds and verify them; raises with the reason otherwise."""
    sizes = manifest.layout.allocation_sizes
    handed = ask_for_handback(
        engine, os.path.basename(socket_path), manifest.fingerprint, len(sizes), policy
    )
    if handed.allocation_sizes != sizes:
        close_fds(handed.fds)
        raise ProtocolError(
            f"engine pid {handed.pid} holds allocations of {handed.allocation_sizes} bytes, "
            f"the manifest says {sizes}"
        )
    entries = [
        AllocationEntry(i, size, None, fd)
        for i, (size, fd) in enumerate(zip(sizes, handed.fds, strict=True))
    ]
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        # Maps read-only and checks what the transport checks for engines (memfd seals, sizes).
        imported = backend.import_tensors(entries)
        memory = AdoptedMemory(backend.name, imported, sizes, device)
        try:
            key = bytes.fromhex(manifest.checksum_key)
            digests = allocation_digests(memory.buffers, manifest.checksum, key)
            pairs = zip(digests, manifest.digests, strict=True)
            bad = [i for i, (got, want) in enumerate(pairs) if got != want]
            if bad:
                raise ChecksumMismatch(
                    f"checksum of allocation(s) {bad} does not match the manifest "
                    f"(engine pid {handed.pid} handed back other bytes)"
                )
        except BaseException:
            memory.close()
            raise
    return memory, handed.pid
