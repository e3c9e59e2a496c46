"""The daemon's manifest: what it holds, written for its successor.

After a load the daemon writes ``<socket dir>/.daemon/<socket name>.manifest``
(directory 0700 and file 0600, both owned by the daemon's uid, see
:mod:`.statedir`; atomically: temporary file, fsync, rename, fsync of the
directory): the config and its
fingerprint, the transport, the GPU, the layout and one keyed digest per
allocation. A restarted daemon re-adopts memory handed back by an engine only
if the manifest still matches what it would load (see
:func:`stale_reason`) and every allocation's digest matches.

Digests are keyed: a 32-byte key, fresh at every load, lives only in the
manifest. Engines run with other uids and cannot read it, so they cannot
build a different allocation of the same size that passes. (An engine under
the daemon's own uid can: it is as trusted as the daemon.)

- CPU memory (memfd): keyed BLAKE2b-256 over the mapping.
- GPU memory (vmm_fd): hashing on the host would first copy the whole model
  over PCIe, so the digest is a keyed linear hash computed on the GPU
  (``m31-linear-x2``, :func:`linear_digest`; by one fused kernel where NVRTC
  can build it, :mod:`.digest_cuda`, else by torch ops). The allocation is read as
  unsigned 16-bit halfwords ``h`` (each below the prime, so no two different
  allocations are congruent) in chunks of ``CHUNK_HALFWORDS``; per lane ``l``
  in {0, 1}, chunk ``j`` gives ``s = sum_i k_l[i] * h[j, i] mod (2^31 - 1)``
  with a key vector ``k_l`` shared by all chunks, and the lane digest is
  ``sum_j c_l[j] * s_j mod (2^61 - 1)`` with per-chunk keys ``c_l[j]``. For
  two different allocations and a key their builder does not know, a lane
  collides with probability at most 2^-31 + 2^-61; the two lanes use
  independent keys, about 2^-62 together. The work is a handful of
  elementwise int64 kernels per 8 MiB chunk with about 100 MiB of
  temporaries, handed back to the driver afterwards: the engines' KV caches
  fill the rest of the GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import re
import secrets
import stat
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import msgspec
import torch

from weightcache.daemon.provenance import FileStamp, Source
from weightcache.daemon.resident import ResidentWeights
from weightcache.daemon.statedir import StateDirError, opened_private_dir, state_dir, state_file
from weightcache.layout import check_layout
from weightcache.protocol import (
    CacheConfig,
    Fingerprint,
    Layout,
    Name,
    config_differences,
    fingerprint,
)
from weightcache.report import SPEC_HASH_ENV
from weightcache.transport import get_daemon_transport_backend

log = logging.getLogger(__name__)

BLAKE2B = "blake2b-256-keyed"
LINEAR = "m31-linear-x2"
Algorithm = Literal["blake2b-256-keyed", "m31-linear-x2"]

M31 = (1 << 31) - 1
M61 = (1 << 61) - 1
CHUNK_HALFWORDS = 1 << 22
# Products are summed in groups this long before reducing mod M31, so int64
# never overflows: 128 * (2^16 - 1) * (2^31 - 2) < 2^54. Allocations are
# multiples of 256 bytes (layout.ALIGNMENT), i.e. of 128 halfwords.
GROUP_HALFWORDS = 128
LANES = 2
BLAKE2B_SLICE = 16 << 20

HexKey = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
SpecHash = Annotated[str, msgspec.Meta(pattern="^([0-9a-f]{64})?$")]
Digest = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32,64}$")]


class ManifestError(RuntimeError):
    """The manifest is missing, unreadable or inconsistent; the message says which."""


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    v: Literal[1]
    fingerprint: Fingerprint
    config: CacheConfig
    transport: Name
    gpu: Annotated[str, msgspec.Meta(max_length=128)]
    layout: Layout
    checksum: Algorithm
    checksum_key: HexKey
    # One per allocation, in layout.allocation_sizes order.
    digests: list[Digest]
    # The checkpoint files' stamps before the disk read these bytes descend from
    # (provenance.py); None in manifests of daemons from before it was kept.
    source: list[FileStamp] | None = None
    # The generation (the operator's spec hash, WEIGHTCACHE_SPEC_HASH) of the daemon that
    # wrote it: a successor of another generation keeps these weights as that one
    # (generations.py). "" outside Kubernetes and from daemons before it was kept. An older
    # daemon refuses a manifest with it (unknown field) and reloads from disk once.
    spec_hash: SpecHash = ""


LAYOUT_MANIFEST = re.compile(r"\.layout-([0-9a-f]{64})\.manifest$")
RETAINED_MANIFEST = re.compile(r"\.retained-([0-9a-f]{64})\.manifest$")


def daemon_spec_hash(env: Mapping[str, str] = os.environ) -> str:
    """This daemon's generation, for its manifests: ``WEIGHTCACHE_SPEC_HASH`` when it is a
    spec hash (64 lowercase hex digits), else "" (logged)."""
    value = env.get(SPEC_HASH_ENV, "")
    if value and not re.fullmatch(r"[0-9a-f]{64}", value):
        log.warning("%s=%r is not a spec hash; manifests name no generation", SPEC_HASH_ENV,
                    value[:80])
        return ""
    return value


def manifest_path(socket_path: str, plan: str | None = None) -> str:
    """``<socket dir>/.daemon/<socket name>.manifest``: where engines cannot read the key;
    an engine layout's (``plan``: its load plan's hash) ``….layout-<hash>.manifest``."""
    return state_file(socket_path, ".manifest" if plan is None else f".layout-{plan}.manifest")


def layout_plans(socket_path: str) -> list[str]:
    """The plan hashes of the engine layouts this socket's daemon wrote manifests for."""
    return _listed(socket_path, LAYOUT_MANIFEST)


def _listed(socket_path: str, pattern: re.Pattern[str]) -> list[str]:
    prefix = os.path.basename(socket_path)
    try:
        with opened_private_dir(state_dir(socket_path)) as directory:
            names = os.listdir(directory)
    except StateDirError:
        return []
    found = (pattern.match(n[len(prefix) :]) for n in names if n.startswith(prefix))
    return sorted(m.group(1) for m in found if m)


def retained_manifest_path(socket_path: str, fingerprint: str) -> str:
    """``….retained-<fingerprint>.manifest``: a kept layout of an earlier generation."""
    return state_file(socket_path, f".retained-{fingerprint}.manifest")


def retained_fingerprints(socket_path: str) -> list[str]:
    """The fingerprints of the kept layouts this socket's daemon wrote manifests for."""
    return _listed(socket_path, RETAINED_MANIFEST)


def remove_retained_manifest(socket_path: str, fingerprint: str) -> None:
    _remove(retained_manifest_path(socket_path, fingerprint))


def move_manifest(source: str, target: str) -> None:
    """Rename a manifest within ``.daemon/`` (atomically, replacing ``target``)."""
    directory = os.path.dirname(source)
    if os.path.dirname(target) != directory:
        raise ValueError(f"{source} and {target} are not in one directory")
    if source == target:
        return
    with opened_private_dir(directory) as fd:
        os.rename(os.path.basename(source), os.path.basename(target), src_dir_fd=fd,
                  dst_dir_fd=fd)
        os.fsync(fd)


def remove_manifest(socket_path: str, plan: str | None) -> None:
    """Forget a layout nobody can hand back any more (a failure is only logged)."""
    _remove(manifest_path(socket_path, plan))


def _remove(path: str) -> None:
    try:
        with opened_private_dir(os.path.dirname(path)) as directory:
            os.unlink(os.path.basename(path), dir_fd=directory)
    except FileNotFoundError:
        pass
    except (OSError, StateDirError) as exc:
        log.warning("cannot remove manifest %s: %s", path, exc)


# --------------------------------------------------------------------------- digests


def algorithm_for(device: torch.device) -> Algorithm:
    return LINEAR if device.type == "cuda" else BLAKE2B


def _host_bytes(buffer: torch.Tensor) -> memoryview:
    """The bytes of a flat uint8 CPU tensor, without a copy (read-only mappings too)."""
    if buffer.numel() == 0:
        return memoryview(b"")
    raw = (ctypes.c_char * buffer.numel()).from_address(buffer.data_ptr())
    return memoryview(raw).cast("B")


def blake2b_digest(buffer: torch.Tensor, key: bytes) -> str:
    return blake2b_digests(buffer, [key])[0]


def blake2b_digests(buffer: torch.Tensor, keys: Sequence[bytes]) -> list[str]:
    """Keyed BLAKE2b-256 under each key; the hashes take the mapping in 16 MiB slices, so
    every slice is read from memory once for all of them."""
    hashes = [hashlib.blake2b(key=key, digest_size=32) for key in keys]
    data = _host_bytes(buffer)
    for start in range(0, len(data), BLAKE2B_SLICE):
        piece = data[start : start + BLAKE2B_SLICE]
        for h in hashes:
            h.update(piece)
    return [h.hexdigest() for h in hashes]


def _prf(key: bytes, label: str, index: int, modulus: int) -> int:
    digest = hashlib.blake2b(
        index.to_bytes(8, "little"), key=key, person=label.encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little") % modulus


def inner_keys(key: bytes, lane: int, length: int) -> torch.Tensor:
    """Lane ``lane``'s key vector: ``length`` values uniform in [0, M31), int32 on the CPU.

    Drawn from a seeded CPU generator: the same key gives the same vector on
    any machine with this torch version (which the CacheConfig pins).
    """
    generator = torch.Generator().manual_seed(_prf(key, f"wc-inner-{lane}", 0, 1 << 63))
    return torch.randint(0, M31, (length,), generator=generator, dtype=torch.int32)


def outer_key(key: bytes, lane: int, chunk: int) -> int:
    return _prf(key, f"wc-outer-{lane}", chunk, M61)


def linear_digest(buffer: torch.Tensor, key: bytes, chunk_halfwords: int = CHUNK_HALFWORDS) -> str:
    """The ``m31-linear-x2`` digest (module docstring) of a flat uint8 tensor, on its device."""
    return linear_digests(buffer, [key], chunk_halfwords)[0]


def linear_digests(
    buffer: torch.Tensor, keys: Sequence[bytes], chunk_halfwords: int = CHUNK_HALFWORDS
) -> list[str]:
    """One ``m31-linear-x2`` digest per key, in one pass over the buffer (a seeded daemon
    checks its copy under its peer's key and digests it under a fresh one of its own)."""
    size = buffer.numel()
    if size % (2 * GROUP_HALFWORDS) or chunk_halfwords % GROUP_HALFWORDS:
        raise ValueError(
            f"linear digest needs sizes in multiples of {2 * GROUP_HALFWORDS} bytes; got {size}"
        )
    halfwords = buffer.view(torch.int16)
    total = halfwords.numel()
    length = min(chunk_halfwords, total)
    lanes = [(key, lane) for key in keys for lane in range(LANES)]
    # Each lane's vector comes from its own sequential CPU generator: draw them on threads
    # (torch releases the GIL), the bulk of the host's share of a GPU digest.
    with ThreadPoolExecutor(max_workers=len(lanes) or 1) as pool:
        drawn = pool.map(lambda kl: inner_keys(kl[0], kl[1], length), lanes)
        vectors = [v.to(buffer.device) for v in drawn]
    chunks = -(-total // chunk_halfwords)
    fused = None
    if buffer.is_cuda and total:
        from weightcache.daemon.digest_cuda import chunk_sums

        fused = chunk_sums(halfwords, torch.stack(vectors), chunk_halfwords)
    if fused is None:
        product = torch.empty(length, dtype=torch.int64, device=buffer.device)
        sums: list[torch.Tensor] = []
        for start in range(0, total, chunk_halfwords):
            n = min(chunk_halfwords, total - start)
            words = halfwords[start : start + n].to(torch.int64).bitwise_and_(0xFFFF)
            for vector in vectors:
                torch.mul(words, vector[:n], out=product[:n])
                groups = product[:n].view(-1, GROUP_HALFWORDS).sum(1).remainder_(M31)
                sums.append(groups.sum())
    # While the GPU works: the outer keys, per lane and chunk.
    outer = [[outer_key(key, lane, c) for c in range(chunks)] for key, lane in lanes]
    if fused is not None:
        per_lane = fused.tolist()  # (lanes, chunks)
    else:
        # One device-to-host transfer for all chunk sums (chunk-major).
        values = torch.stack(sums).tolist() if sums else []
        per_lane = [values[which :: len(lanes)] for which in range(len(lanes))]
    accumulated = [
        sum(o * (v % M31) for o, v in zip(outer[which], per_lane[which], strict=True)) % M61
        for which in range(len(lanes))
    ]
    return [
        "".join(f"{h:016x}" for h in accumulated[k * LANES : (k + 1) * LANES])
        for k in range(len(keys))
    ]


def allocation_digests(buffers: list[torch.Tensor], algorithm: str, key: bytes) -> list[str]:
    """One digest per allocation; GPU temporaries are returned to the driver afterwards."""
    return [per_key[0] for per_key in digests_under(buffers, algorithm, [key])]


def digests_under(
    buffers: list[torch.Tensor], algorithm: str, keys: Sequence[bytes]
) -> list[list[str]]:
    """Per allocation, its digest under each of ``keys`` (one pass over each allocation)."""
    on_cuda = any(b.device.type == "cuda" for b in buffers)
    if algorithm == LINEAR:
        digests = []
        for b in buffers:
            with torch.cuda.device(b.device) if b.is_cuda else contextlib.nullcontext():
                digests.append(linear_digests(b, keys))
    elif algorithm == BLAKE2B:
        if on_cuda:
            raise ValueError(f"{BLAKE2B} digests CPU memory; these allocations are on the GPU")
        digests = [blake2b_digests(b, keys) for b in buffers]
    else:
        raise ValueError(f"unknown checksum algorithm {algorithm!r}")
    if on_cuda:
        # Each buffer's own device: a bare synchronize() acts on the current device (0 in a
        # daemon pinned to another GPU) and would create a CUDA context there.
        for device in {b.device for b in buffers if b.is_cuda}:
            torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return digests


# --------------------------------------------------------------------------- build, write, read


def build_manifest(
    *, config: CacheConfig, transport: str, gpu: str, layout: Layout, buffers: list[torch.Tensor],
    source: Source | None = None, spec_hash: str | None = None,
) -> Manifest:
    """Digest every allocation under a fresh key."""
    key = secrets.token_bytes(32)
    device = buffers[0].device if buffers else torch.device("cpu")
    algorithm = algorithm_for(device)
    return Manifest(
        v=1,
        fingerprint=fingerprint(config),
        config=config,
        transport=transport,
        gpu=gpu,
        layout=layout,
        checksum=algorithm,
        checksum_key=key.hex(),
        digests=allocation_digests(buffers, algorithm, key),
        source=None if source is None else list(source),
        spec_hash=daemon_spec_hash() if spec_hash is None else spec_hash,
    )


def write_manifest(path: str, manifest: Manifest) -> None:
    """Atomically replace ``path``: a reader sees the old manifest or the new, never a mix.

    ``path``'s directory must be private to this uid (see :mod:`.statedir`);
    every step goes through its fd, so no symlink is followed.
    """
    data = msgspec.json.encode(manifest)
    name = os.path.basename(path)
    tmp = f"{name}.tmp-{os.getpid()}"
    with opened_private_dir(os.path.dirname(path)) as directory:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=directory)  # left by a crashed predecessor with our pid
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600, dir_fd=directory)
        try:
            os.fchmod(fd, 0o600)  # the umask can only narrow it; make it exact
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp, dir_fd=directory)
            raise
        os.close(fd)
        os.rename(tmp, name, src_dir_fd=directory, dst_dir_fd=directory)
        os.fsync(directory)


def read_manifest(path: str) -> Manifest:
    """The manifest at ``path``, checked for internal consistency; ManifestError says why not.

    Only a regular file owned by this uid and closed to group and others, in a
    directory of the same kind, reached without following a symlink: anything
    else may have been written by someone who could read the key.
    """
    try:
        with opened_private_dir(os.path.dirname(path)) as directory:
            data = _read_private_file(directory, os.path.basename(path), path)
    except StateDirError as exc:
        raise ManifestError(str(exc)) from None
    try:
        manifest = msgspec.json.decode(data, type=Manifest)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ManifestError(f"manifest {path} is not valid: {exc}") from None
    if fingerprint(manifest.config) != manifest.fingerprint:
        raise ManifestError(f"manifest {path}: fingerprint does not match its config")
    if len(manifest.digests) != len(manifest.layout.allocation_sizes):
        raise ManifestError(
            f"manifest {path}: {len(manifest.digests)} digests for "
            f"{len(manifest.layout.allocation_sizes)} allocations"
        )
    try:
        check_layout(manifest.layout)
    except ValueError as exc:
        raise ManifestError(f"manifest {path}: bad layout: {exc}") from None
    return manifest


def _read_private_file(directory: int, name: str, path: str) -> bytes:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=directory)
    except FileNotFoundError:
        raise ManifestError(
            f"no manifest at {path} (first start, or the last daemon never finished a load)"
        ) from None
    except OSError as exc:
        raise ManifestError(f"cannot open manifest {path}: {exc.strerror}") from None
    # Checked on the fd before wrapping it: a directory there made fdopen raise
    # IsADirectoryError, which stopped the daemon instead of sending it to the disk.
    problem = _file_problem(os.fstat(fd), path)
    if problem is not None:
        os.close(fd)
        raise ManifestError(problem)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _file_problem(info: os.stat_result, path: str) -> str | None:
    """Why the file is no manifest of ours: not regular, another owner, open to others."""
    if not stat.S_ISREG(info.st_mode):
        return f"manifest {path} is not a regular file"
    if info.st_uid != os.getuid():
        return f"manifest {path} is owned by uid {info.st_uid}, not this daemon's"
    if stat.S_IMODE(info.st_mode) & 0o077:
        return (f"manifest {path} has mode {stat.S_IMODE(info.st_mode):04o}: others may "
                "have read its key; it must be 0600")
    return None


def stale_reason(
    manifest: Manifest, *, config: CacheConfig, transport: str, gpu: str
) -> str | None:
    """Why the manifest does not describe what this daemon would load now (None: it does).

    ``config`` comes from the checkpoint's headers alone, so this costs no
    tensor bytes. The layout needs no check of its own: the config pins
    everything it is planned from (tensors, dtype, shard, layout version), and
    the digests bind the bytes to the manifest's layout.
    """
    if manifest.fingerprint != fingerprint(config):
        fields = config_differences(manifest.config, config)
        return f"manifest is stale: the config differs in {', '.join(fields)}"
    if manifest.transport != transport:
        return f"manifest is for transport {manifest.transport}, this daemon serves {transport}"
    if manifest.gpu != gpu:
        return f"manifest is for {manifest.gpu}, this daemon serves {gpu}"
    return None


def save_manifest(socket_path: str, gpu: str, resident: ResidentWeights) -> str | None:
    """Digest and write ``resident``'s manifest (its layout's: the checkpoint's, or an
    engine's by plan hash); the path, or None where none was written.

    None for transports that cannot re-adopt (their memory dies with the
    daemon), and on failure, logged: a daemon without a manifest still
    serves; only its successor pays, by reloading from disk.
    """
    if not get_daemon_transport_backend(resident.transport).keeps_fds:
        return None
    path = manifest_path(socket_path, resident.config.plan)
    try:
        manifest = build_manifest(
            config=resident.config,
            transport=resident.transport,
            gpu=gpu,
            layout=resident.layout,
            buffers=resident.memory.buffers,
            source=resident.source,
        )
        write_manifest(path, manifest)
    except (OSError, RuntimeError, ValueError) as exc:
        resident.manifest_error = not_written(path, exc)
        log.error("%s", resident.manifest_error)
        return None
    return path


def not_written(path: str, exc: BaseException) -> str:
    """The warning a daemon shows when its successor will find no manifest."""
    return f"manifest {path} not written (a restart will reload from disk): {exc}"
