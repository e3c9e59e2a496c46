"""Peer seeding: copy the weights from a neighbour daemon on this node instead of reading disk.

Daemons of one cache on one node share a socket directory. A daemon that has
to load (re-adoption gave it nothing) first looks there for a neighbour that
is ready and holds the same weights: the same CacheConfig fingerprint
(checkpoint identity, dtype, shard, device capability, torch version), the
same transport; only the device differs. It then:

1. reads the neighbour's manifest (``.daemon/``, the same uid) and checks that
   it describes the same fingerprint, transport, GPU and layout;
2. on a GPU, checks that it can reach the neighbour's GPU at all: visible to
   this process (not with one GPU per container) and peer-accessible;
3. attaches to it as an engine would (``vmm_fd`` or ``memfd``): the listener
   must run as this daemon's uid, and the neighbour compares our whole config
   before it hands out fds;
4. copies every allocation into memory of its own (device to device over
   NVLink/PCIe for ``vmm_fd``: the neighbour's allocation is mapped with
   access for this GPU; plain memory copies for ``memfd``) and drops the
   neighbour's mapping;
5. digests its copy under the neighbour's key, which must give the
   neighbour's manifest digests (a neighbour whose bytes changed since it
   loaded is caught here), and in the same pass under a fresh key of its
   own, for the manifest it writes for its own successor.

A neighbour that dies once its fds are in hand cannot spoil the copy: the
imported memory lives while it is mapped here, and the checksums decide. One
that dies before (or never answers, or fails any check) is passed over, with
the reason kept for the status.

Coordination (:func:`obtain_weights`): several daemons starting together must
not all read the same bytes from one disk. The daemon that takes
``.daemon/load-<fingerprint>.lock`` (an flock: the kernel drops it when the
holder dies) reads the disk and holds the lock until it serves; the others
poll every ``POLL_SECONDS`` for a ready neighbour, and seed from it. A waiter
reads the disk itself when the lock comes free without a ready neighbour (the
loader died), when every ready neighbour failed, or after ``wait_seconds``.
The lock is per fingerprint, so tensor-parallel ranks (different shards)
never wait for each other.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import secrets
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch

from weightcache.checkpoint import cache_config, read_checkpoint
from weightcache.client import ConfigMismatch, attach, attach_by_hash, daemon_status
from weightcache.daemon.loader import expected_bytes, tensor_specs_for
from weightcache.daemon.lock import FileLock
from weightcache.daemon.manifest import (
    Manifest,
    ManifestError,
    algorithm_for,
    daemon_spec_hash,
    digests_under,
    manifest_path,
    not_written,
    read_manifest,
    save_manifest,
    write_manifest,
)
from weightcache.daemon.provenance import Source, difference, stamp
from weightcache.daemon.resident import ResidentWeights, load_from_disk
from weightcache.daemon.statedir import state_dir
from weightcache.layout import plan_layout, tensor_specs
from weightcache.protocol import CacheConfig, DaemonStatus, Layout, ShardSpec, fingerprint
from weightcache.transport import get_daemon_transport_backend
from weightcache.transport.base import DaemonMemory, WeightCacheTransportBackend

log = logging.getLogger(__name__)

# How long a daemon waits for a neighbour that is reading the same weights from disk.
WAIT_SECONDS = 300.0
POLL_SECONDS = 0.2


class SeedUnavailable(RuntimeError):
    """This neighbour cannot seed us; the message says why."""


class CopyMismatch(SeedUnavailable):
    """The copy's digests under the neighbour's key differ from the neighbour's manifest."""


@dataclass
class Obtained:
    """Weights a daemon obtained (from a peer or the disk), why, and the load lock it holds.
    ``resident`` is the checkpoint layout (None when a neighbour held only engine layouts,
    which ``layouts`` holds by plan hash)."""

    resident: ResidentWeights | None
    reason: str
    turn: FileLock | None = None
    layouts: dict[str, ResidentWeights] = field(default_factory=dict)

    def release(self) -> None:
        """Once the daemon serves: waiters may now find it ready."""
        if self.turn is not None:
            self.turn.release()
            self.turn = None


@dataclass(frozen=True)
class Neighbour:
    socket_path: str
    status: DaemonStatus

    @property
    def name(self) -> str:
        return os.path.basename(self.socket_path)


@dataclass
class Survey:
    """The neighbours that could seed us, and why each other one cannot."""

    candidates: list[Neighbour] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class Seeded:
    # The layouts copied: the checkpoint's under None, engines' by plan hash.
    residents: dict[str | None, ResidentWeights]
    copy_seconds: float
    verify_seconds: float

    def summary(self, neighbour: Neighbour) -> str:
        nbytes = sum(r.preloaded_weights_bytes for r in self.residents.values())
        rate = nbytes / self.copy_seconds / 1e9 if self.copy_seconds > 0 else 0.0
        layouts = sorted(p[:12] for p in self.residents if p is not None)
        which = f" and engine layout(s) {', '.join(layouts)}" if layouts else ""
        if None not in self.residents:
            which = f" engine layout(s) {', '.join(layouts)} (it holds no checkpoint layout)"
        return (
            f"seeded from {neighbour.status.gpu} ({neighbour.name}, pid "
            f"{neighbour.status.pid}){which}: copied {nbytes / 1e9:.2f} GB in "
            f"{self.copy_seconds:.3f} s ({rate:.1f} GB/s), verified in "
            f"{self.verify_seconds:.3f} s, every checksum matching its manifest"
        )


@dataclass(frozen=True)
class Target:
    """What this daemon must end up holding."""

    socket_path: str
    gpu: str
    device: torch.device
    backend: WeightCacheTransportBackend
    config: CacheConfig
    fingerprint: str
    layout: Layout
    expected_bytes: int
    # The checkpoint files' stamps as this daemon finds them (provenance.py).
    source: Source = ()


# --------------------------------------------------------------------------- decisions (pure)


def unfit_reason(status: DaemonStatus, fingerprint: str, transport: str) -> str | None:
    """Why a neighbour's status rules it out as a seed (None: it may seed us)."""
    if status.state != "ready":
        return f"not ready ({status.state})"
    if status.fingerprint != fingerprint:
        return f"holds other weights (fingerprint {(status.fingerprint or 'none')[:12]}…)"
    if status.transport_backend != transport:
        return f"serves transport {status.transport_backend}, not {transport}"
    return None


def manifest_problem(
    manifest: Manifest, *, fingerprint: str, transport: str, gpu: str, layout: Layout
) -> str | None:
    """Why a neighbour's manifest cannot vouch for the weights we would copy (None: it can)."""
    if manifest.fingerprint != fingerprint:
        return "its manifest is for other weights (fingerprint differs)"
    if manifest.transport != transport:
        return f"its manifest is for transport {manifest.transport}"
    if manifest.gpu != gpu:
        return f"its manifest is for {manifest.gpu}, it serves {gpu}"
    if manifest.layout != layout:
        return "its manifest's layout differs from the one this daemon plans"
    return None


def peer_ordinal(
    own: int, peer_gpu: str, visible: Mapping[str, int], can_access: Callable[[int, int], bool]
) -> int:
    """The CUDA ordinal of the neighbour's GPU, if this process can copy from it.

    ``visible``: UUID -> ordinal of the GPUs this process sees. With one GPU
    per container (``gpuAccess.mode: device-plugin``) the neighbour's is not
    among them.
    """
    ordinal = visible.get(peer_gpu)
    if ordinal is None:
        raise SeedUnavailable(
            f"its GPU {peer_gpu} is not visible to this daemon (one GPU per container, as "
            "device-plugin access gives?)"
        )
    if ordinal != own and not can_access(own, ordinal):
        raise SeedUnavailable(f"no peer access from cuda:{own} to cuda:{ordinal} ({peer_gpu})")
    return ordinal


# --------------------------------------------------------------------------- the neighbourhood


def neighbour_sockets(socket_path: str) -> list[str]:
    """The other ``*.sock`` sockets in our socket directory (no symlinks), in name order."""
    directory = os.path.dirname(os.path.abspath(socket_path))
    own = os.path.basename(socket_path)
    found = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name == own or not entry.name.endswith(".sock"):
                continue
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                    found.append(entry.path)
    return sorted(found)


def survey(target: Target, timeout: float) -> Survey:
    """Ask every neighbour for its status; only daemons of our own uid are asked at all."""
    result = Survey()
    for path in neighbour_sockets(target.socket_path):
        name = os.path.basename(path)
        try:
            status = daemon_status(path, timeout, daemon_uids=[os.geteuid()])
        except (OSError, RuntimeError) as exc:  # gone, stale socket, other uid, busy
            result.notes.append(f"{name}: {exc}")
            continue
        why = unfit_reason(status, target.fingerprint, target.backend.name)
        if why is None and status.pid == os.getpid():
            why = "this daemon itself"
        if why is None:
            result.candidates.append(Neighbour(path, status))
        else:
            result.notes.append(f"{name} (pid {status.pid}): {why}")
    return result


# --------------------------------------------------------------------------- one copy


def visible_gpus() -> dict[str, int]:
    from weightcache.devices import gpu_uuid

    return {gpu_uuid(i): i for i in range(torch.cuda.device_count())}


def held_plans(status: DaemonStatus) -> list[str | None]:
    """The layouts a neighbour holds ready: the checkpoint's (None) and engines' hashes.
    A daemon that reports no layouts (an older one) holds the checkpoint layout alone."""
    if not status.layouts:
        return [None]
    return [s.plan for s in status.layouts if s.state == "ready"]


def seed_from(
    neighbour: Neighbour,
    target: Target,
    *,
    timeout: float,
    progress: Callable[[str], None] = lambda phase: None,
) -> Seeded:
    """Copy every layout ``neighbour`` holds (its checkpoint layout, engines' layouts) into
    memory of our own and verify each; raises why not (having released what it copied)."""
    peer_gpu = neighbour.status.gpu
    if target.device.type == "cuda":
        own = target.device.index or 0
        peer_ordinal(own, peer_gpu, visible_gpus(), torch.cuda.can_device_access_peer)
    plans = held_plans(neighbour.status)
    if not plans:
        raise SeedUnavailable("holds no layout ready")
    copied: dict[str | None, ResidentWeights] = {}
    copy_seconds = verify_seconds = 0.0
    try:
        for plan in plans:
            resident, copy, verify = _copy_layout(neighbour, target, plan, timeout, progress)
            copied[plan] = resident
            copy_seconds += copy
            verify_seconds += verify
    except BaseException:
        for resident in copied.values():
            resident.close()
        raise
    return Seeded(copied, copy_seconds, verify_seconds)


def _copy_layout(
    neighbour: Neighbour,
    target: Target,
    plan: str | None,
    timeout: float,
    progress: Callable[[str], None],
) -> tuple[ResidentWeights, float, float]:
    """One layout of ``neighbour`` (the checkpoint's, or the engine layout ``plan``),
    copied and verified: (our copy, copy seconds, verify seconds)."""
    started = time.perf_counter()
    peer_gpu = neighbour.status.gpu
    config = msgspec.structs.replace(target.config, plan=plan)
    what = "its weights" if plan is None else f"its layout {plan[:12]}"
    try:
        manifest = read_manifest(manifest_path(neighbour.socket_path, plan))
    except ManifestError as exc:
        of = "" if plan is None else f" of layout {plan[:12]}"
        raise SeedUnavailable(f"cannot verify a copy{of}: {exc}") from None
    problem = manifest_problem(
        manifest,
        fingerprint=fingerprint(config),
        transport=target.backend.name,
        gpu=peer_gpu,
        # An engine layout is planned from its load plan, which only the neighbour has;
        # its manifest's layout (checked when read) is the one the copy must fill.
        layout=target.layout if plan is None else manifest.layout,
    )
    if problem is not None:
        raise SeedUnavailable(problem)
    # Its bytes descend from a disk read of the files as they were then: were they changed
    # since (a poisoned file repaired), only the disk has what the files now say.
    if manifest.source is None:
        raise SeedUnavailable("its manifest does not say which files its bytes were read from")
    changed = difference(tuple(manifest.source), target.source)
    if changed is not None:
        raise SeedUnavailable(f"the checkpoint changed since its bytes were read from disk "
                              f"({changed})")
    layout = manifest.layout
    on_gpu = target.device.type == "cuda"

    progress(f"asking {neighbour.name} for {what}")
    with torch.cuda.device(target.device) if on_gpu else contextlib.nullcontext():
        # As an engine: the listener must run as our uid; the neighbour compares our whole
        # config before it sends fds. Mapped read-only, for this device (vmm_fd: the
        # neighbour's memory over peer access).
        options = dict(watchdog=False, handback=False, timeout=timeout,
                       daemon_uids=[os.geteuid()])  # fmt: skip
        try:
            if plan is None:
                attached = attach(
                    neighbour.socket_path, target.config, [target.backend.name], **options
                )
            else:
                attached = attach_by_hash(
                    neighbour.socket_path, target.config, plan, [target.backend.name], **options
                )
        except ConfigMismatch as exc:
            raise SeedUnavailable(f"holds other weights ({', '.join(exc.fields)})") from None
        memory: DaemonMemory | None = None
        try:
            source = attached.allocations()
            sizes = [b.numel() for b in source]
            if sizes != layout.allocation_sizes:
                raise SeedUnavailable(
                    f"serves allocations of {sizes} bytes, the layout says "
                    f"{layout.allocation_sizes}"
                )
            memory = target.backend.allocate(sizes, target.device)
            layout_of = "" if plan is None else f" layout {plan[:12]}"
            progress(f"copying{layout_of} from {neighbour.name}")
            copy_started = time.perf_counter()
            for mine, theirs in zip(memory.buffers, source, strict=True):
                mine.copy_(theirs)
            if on_gpu:
                torch.cuda.synchronize(target.device)
            copy_seconds = time.perf_counter() - copy_started
            del source
        except BaseException:
            if memory is not None:
                memory.close()
            raise
        finally:
            attached.close()  # the neighbour's mapping goes with its last view
        try:
            memory.finish_load()
            progress("verifying the copy" if plan is None else f"verifying layout {plan[:12]}")
            verify_started = time.perf_counter()
            own_key = secrets.token_bytes(32)
            peer_key = bytes.fromhex(manifest.checksum_key)
            per_allocation = digests_under(memory.buffers, manifest.checksum, [peer_key, own_key])
            pairs = zip(per_allocation, manifest.digests, strict=True)
            bad = [i for i, (digests, want) in enumerate(pairs) if digests[0] != want]
            if bad:
                of = "" if plan is None else f" of layout {plan[:12]}"
                raise CopyMismatch(
                    f"checksum of allocation(s) {bad}{of} does not match its manifest "
                    "(its memory holds other bytes than it loaded)"
                )
            verify_seconds = time.perf_counter() - verify_started
            export = target.backend.prepare_export(memory)
        except BaseException:
            memory.close()
            raise
    resident = ResidentWeights(
        config=config,
        fingerprint=fingerprint(config),
        layout=layout,
        memory=memory,
        export=export,
        expected_bytes=target.expected_bytes
        if plan is None
        else sum(spec.nbytes for spec, _, _ in tensor_specs(layout)),
        load_seconds=time.perf_counter() - started,
        load_source="peer",
        seeded_from=peer_gpu,
        source=target.source,  # equal to the neighbour's: checked before the copy
    )
    _save_own_manifest(target, resident, own_key, [d[1] for d in per_allocation])
    return resident, copy_seconds, verify_seconds


def _save_own_manifest(
    target: Target, resident: ResidentWeights, key: bytes, digests: list[str]
) -> None:
    """Our successor's manifest, under our own key; a failure only costs that successor."""
    path = manifest_path(target.socket_path, resident.config.plan)
    manifest = Manifest(
        v=1,
        fingerprint=resident.fingerprint,
        config=resident.config,
        transport=target.backend.name,
        gpu=target.gpu,
        layout=resident.layout,
        checksum=algorithm_for(target.device),
        checksum_key=key.hex(),
        digests=digests,
        source=None if resident.source is None else list(resident.source),
        spec_hash=daemon_spec_hash(),
    )
    try:
        write_manifest(path, manifest)
    except (OSError, RuntimeError, ValueError) as exc:
        resident.manifest_error = not_written(path, exc)
        log.error("%s", resident.manifest_error)


# --------------------------------------------------------------------------- coordination


def load_lock_path(socket_path: str, fingerprint: str) -> str:
    """``.daemon/load-<fingerprint>.lock``: held by the daemon reading these weights from disk."""
    return os.path.join(state_dir(socket_path), f"load-{fingerprint}.lock")


def plan_target(
    socket_path: str,
    gpu: str,
    model_dir: str | Path,
    device: torch.device,
    transport: str,
    dtype: torch.dtype | None,
    shard: ShardSpec | None,
    revision: str | None,
) -> Target:
    """What this daemon would hold, from the checkpoint's headers alone."""
    source = stamp(model_dir)
    checkpoint = read_checkpoint(model_dir)
    config = cache_config(checkpoint, device, dtype, shard, revision)
    backend = get_daemon_transport_backend(transport)
    specs = tensor_specs_for(checkpoint, dtype, shard)
    return Target(
        socket_path=socket_path,
        gpu=gpu,
        device=device,
        backend=backend,
        config=config,
        fingerprint=fingerprint(config),
        layout=plan_layout(specs, backend.allocation_alignment(device)),
        expected_bytes=expected_bytes(specs),
        source=source,
    )


def obtain_weights(
    socket_path: str,
    gpu: str,
    model_dir: str | Path,
    device: torch.device,
    transport: str,
    dtype: torch.dtype | None = None,
    shard: ShardSpec | None = None,
    revision: str | None = None,
    *,
    seed: bool = True,
    wait_seconds: float = WAIT_SECONDS,
    timeout: float = 10.0,
    progress: Callable[[str], None] = lambda phase: None,
    keep_checkpoint: bool = False,
) -> Obtained:
    """The weights, from a ready neighbour or else from disk (see the module docstring).

    ``model_dir`` .. ``revision`` are :func:`load_from_disk`'s arguments;
    ``timeout`` bounds each exchange with a neighbour; ``progress`` is called
    with the phase at every step and every poll (the liveness probe's clock:
    the wait is bounded by ``wait_seconds``, so marking it never hides a hang).
    """
    disk = (model_dir, device, transport, dtype, shard, revision)
    if not seed:
        return _from_disk(socket_path, gpu, disk, "peer seeding is off", None, progress)
    if not get_daemon_transport_backend(transport).keeps_fds:
        why = f"transport {transport} cannot seed: its memory has no fds to copy from"
        return _from_disk(socket_path, gpu, disk, why, None, progress)
    progress("loading from disk: the checkpoint's headers")
    target = plan_target(socket_path, gpu, *disk)
    turn = FileLock(load_lock_path(socket_path, target.fingerprint))
    deadline = time.monotonic() + wait_seconds
    waited_for: str | None = None
    tried: set[tuple[str, int]] = set()  # a neighbour that failed once is not asked again
    failures: list[str] = []
    while True:
        found = survey(target, timeout)
        fresh = [n for n in found.candidates if (n.socket_path, n.status.pid) not in tried]
        # In random order: several daemons seeding at once spread over the ready ones.
        for neighbour in random.sample(fresh, len(fresh)):
            tried.add((neighbour.socket_path, neighbour.status.pid))
            try:
                seeded = seed_from(neighbour, target, timeout=timeout, progress=progress)
            except Exception as exc:  # whatever a neighbour does, the disk remains
                log.warning("%s could not seed this daemon: %s", neighbour.name, exc)
                failures.append(f"{neighbour.name} (pid {neighbour.status.pid}): {exc}")
                continue
            reason = seeded.summary(neighbour)
            log.info("%s", reason)
            layouts = {p: r for p, r in seeded.residents.items() if p is not None}
            checkpoint = seeded.residents.get(None)
            if checkpoint is None and keep_checkpoint:
                reason = f"{reason}; the checkpoint layout kept as well"
                obtained = _from_disk(socket_path, gpu, disk, reason, None, progress)
                obtained.layouts = layouts
                return obtained
            return Obtained(checkpoint, "; ".join([reason, *failures]), layouts=layouts)
        holder = turn.try_acquire()
        if holder is None:
            why = _disk_reason(found, failures, waited_for)
        elif time.monotonic() >= deadline:
            why = "; ".join([
                f"pid {holder} was still reading these weights from disk after the "
                f"{wait_seconds:g} s peer wait",
                *failures,
            ])  # fmt: skip
        else:
            if waited_for != holder:
                log.info("pid %s is reading these weights from disk; waiting for it", holder)
                waited_for = holder
            progress(f"waiting for pid {holder} to load these weights from disk")
            time.sleep(POLL_SECONDS)
            continue
        return _from_disk(socket_path, gpu, disk, why, turn if turn.held else None, progress)


def _disk_reason(found: Survey, failures: list[str], waited_for: str | None) -> str:
    if failures:
        return "no neighbour's weights could be used: " + "; ".join(failures)
    if waited_for is not None:
        return f"pid {waited_for} stopped loading without serving"
    return "; ".join(["no neighbour holds these weights", *found.notes])


def _from_disk(
    socket_path: str,
    gpu: str,
    disk: tuple,
    why: str,
    turn: FileLock | None,
    progress: Callable[[str], None],
) -> Obtained:
    log.info("loading from disk: %s", why)
    try:
        progress("loading from disk")
        resident = load_from_disk(*disk)
        progress("writing the manifest")
        save_manifest(socket_path, gpu, resident)
    except BaseException:
        if turn is not None:
            turn.release()
        raise
    return Obtained(resident, f"read from disk: {why}", turn)
