"""A restarting daemon takes its weights back from live engines instead of reading the disk.

On start, before any tensor byte is read: the manifest must exist and still
describe what this daemon would load (config from the checkpoint's headers
only); then each engine socket beside ours is asked in turn for its fds. The
first complete set whose every allocation matches the manifest's digest is
served as before. Sockets nobody listens on belong to dead engines and are
removed. Asking is bounded (:class:`ReadoptBudget`): per engine, one
deadline for the whole exchange; overall, a budget after which the daemon
stops asking and loads from disk. Whatever happens, :class:`Readoption`
says why, for the status.

Imported memory is never re-exported (the driver refuses to export an
imported VMM handle): the daemon serves the fds it received. ``torch_ipc``
cannot re-adopt: its memory dies with the daemon that allocated it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch

from weightcache.checkpoint import CheckpointError, cache_config, read_checkpoint
from weightcache.daemon.manifest import (
    Manifest,
    ManifestError,
    allocation_digests,
    layout_plans,
    manifest_path,
    move_manifest,
    read_manifest,
    retained_fingerprints,
    retained_manifest_path,
    stale_reason,
)
from weightcache.daemon.provenance import Source, difference, stamp
from weightcache.daemon.resident import ResidentWeights
from weightcache.daemon.statedir import StateDirError, opened_private_dir
from weightcache.layout import tensor_specs
from weightcache.protocol import (
    READOPT_MAX_FRAME,
    CacheConfig,
    ProtocolError,
    ReadoptRequest,
    ShardSpec,
    decode_readopt_reply,
    fingerprint,
)
from weightcache.sockets import (
    DIR_FLAGS,
    MAX_LISTED,
    PeerPolicy,
    engines_dir,
    peer_credentials,
    peer_groups,
    socket_files,
)
from weightcache.transport import get_daemon_transport_backend
from weightcache.transport.base import (
    AllocationEntry,
    DaemonMemory,
    Export,
    ImportedMemory,
    WeightCacheTransportBackend,
)
from weightcache.wire import close_fds, recv_frame, send_message

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


@dataclass(frozen=True)
class ReadoptBudget:
    """How long re-adoption may ask: each engine's whole exchange, and all of them together.

    Past the total the daemon stops asking and loads from disk, so a crowd of
    slow (or hostile) engines can delay a restart by ``total_seconds`` at most.
    """

    exchange_seconds: float = 10.0
    total_seconds: float = 60.0


@dataclass
class Readoption:
    """The layouts taken back (the checkpoint's under None, engines' by plan hash), and why;
    ``kept``: layouts of earlier generations taken back to keep (generations.py), each with
    its manifest (now ``.retained-<fingerprint>.manifest``)."""

    residents: dict[str | None, ResidentWeights]
    reason: str
    kept: list[tuple[ResidentWeights, Manifest]] = field(default_factory=list)

    @property
    def resident(self) -> ResidentWeights | None:
        """The checkpoint layout, if re-adopted."""
        return self.residents.get(None)


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
    *,
    budget: ReadoptBudget | None = None,
    progress: Callable[[], None] = lambda: None,
) -> Readoption:
    """Every layout an engine hands back verified (the checkpoint's, engines' own), and why
    the others are not.

    ``model_dir`` .. ``revision`` are :func:`load_from_disk`'s arguments.
    ``budget`` bounds each engine's exchange and the asking as a whole;
    ``progress`` is called after each engine is dealt with (the liveness
    probe's progress clock).
    """
    budget = budget or ReadoptBudget()
    started = time.perf_counter()
    deadline = time.monotonic() + budget.total_seconds
    backend = get_daemon_transport_backend(transport)
    if not backend.keeps_fds:
        return Readoption(
            {}, f"transport {transport} cannot re-adopt: engines keep no fds to hand back"
        )
    try:
        prepare_engines_dir(socket_path)
    except OSError as exc:
        return Readoption({}, f"cannot prepare the engines' hand-back directory: {exc}")
    manifests, notes = _manifests(socket_path)
    if not manifests:
        return Readoption({}, "; ".join(notes))  # before touching the checkpoint at all
    try:
        checkpoint = read_checkpoint(model_dir)
    except CheckpointError as exc:
        return Readoption({}, str(exc))
    base = cache_config(checkpoint, device, dtype, shard, revision)
    wanted, others = _classify(socket_path, manifests, base, transport, gpu, stamp(model_dir),
                               notes)
    if not wanted and not others:
        return Readoption({}, "; ".join(notes))

    try:
        engines = engine_sockets(socket_path)
    except OSError as exc:
        return Readoption({}, f"cannot list the engines' sockets: {exc}")
    # What to take back: this generation's layouts (by plan), then earlier generations'
    # (by fingerprint), each from the first engine that hands it back verified.
    targets: dict[Target, tuple[str, Manifest]] = {
        **{("current", plan): found for plan, found in wanted.items()},
        **{("kept", fp): found for fp, found in others.items()},
    }
    adopted: dict[Target, ResidentWeights] = {}
    reasons: list[str] = []
    failures: list[str] = []
    gone = 0
    for asked, engine in enumerate(engines):
        if len(adopted) == len(targets):
            break
        name = os.path.basename(engine)
        refusals = []
        for target, (_, manifest) in targets.items():
            if target in adopted:
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                memory, pid = adopt_from(
                    engine, socket_path, manifest, backend, device, policy,
                    min(budget.exchange_seconds, remaining),
                )  # fmt: skip
            except EngineGone:
                gone += 1
                with contextlib.suppress(OSError):
                    os.unlink(engine)
                refusals = []
                break
            except Refused as exc:  # it holds another layout: ask it for the next
                refusals.append(str(exc))
                continue
            except Exception as exc:  # whatever an engine does, the disk remains
                failures.append(f"{name}: {exc}")
                log.warning("engine %s did not hand the weights back: %s", name, exc)
                refusals = []
                break
            adopted[target] = ResidentWeights(
                config=manifest.config,
                fingerprint=manifest.fingerprint,
                layout=manifest.layout,
                memory=memory,
                export=Export(handles=None, fds=list(memory.fds)),
                expected_bytes=sum(spec.nbytes for spec, _, _ in tensor_specs(manifest.layout)),
                load_seconds=time.perf_counter() - started,
                load_source="readopted",
                source=None if manifest.source is None else tuple(manifest.source),
            )
            reasons.append(
                f"{_what(target, manifest)}re-adopted {len(memory.sizes)} allocation(s) from "
                f"engine pid {pid} ({name}), every checksum matching the manifest"
            )
            break
        else:
            failures += [f"{name}: {r}" for r in refusals[:1]]
        progress()
        unasked = len(engines) - asked - 1
        if deadline - time.monotonic() <= 0 and len(adopted) < len(targets) and unasked:
            failures.append(
                f"re-adoption budget of {budget.total_seconds:g} s spent; "
                f"{unasked} engine socket(s) not asked"
            )
            break
    kept = _settle_manifests(socket_path, targets, adopted)
    residents = {t[1]: r for t, r in adopted.items() if t[0] == "current"}
    if kept and not residents:
        # Earlier generations kept; this one's own weights were not taken back.
        why = "; ".join(failures) or (
            "no engine handed back this generation's weights" if wanted
            else "; ".join(notes) or "no manifest of this generation")
        return Readoption({}, "; ".join([*reasons, why]), kept)
    if residents:
        return Readoption(residents, "; ".join([*reasons, *failures]), kept)
    # Why this generation's own manifest did not count (stale: an earlier generation's).
    why = [n for n in notes if not wanted]
    if failures:
        return Readoption({}, "; ".join(
            [*why, "no engine handed back verified weights: " + "; ".join(failures)]))
    removed = f" ({gone} dead engine socket(s) removed)" if gone else ""
    return Readoption({}, "; ".join([*why, f"no live engine to re-adopt from{removed}"]))


# ("current", plan hash or None) for this generation's layouts, ("kept", fingerprint) for
# an earlier generation's.
Target = tuple[str, "str | None"]


def _what(target: Target, manifest: Manifest) -> str:
    if target[0] == "kept":
        generation = manifest.spec_hash[:12] or "<unknown>"
        return f"kept layout {manifest.fingerprint[:12]} of generation {generation}: "
    return "" if target[1] is None else f"layout {target[1][:12]}: "


def _settle_manifests(
    socket_path: str, targets: dict[Target, tuple[str, Manifest]],
    adopted: dict[Target, ResidentWeights],
) -> list[tuple[ResidentWeights, Manifest]]:
    """Put each manifest where what it describes now lives: kept layouts under
    ``.retained-<fingerprint>``, this generation's under its own name (a rollback finds them
    kept); those of layouts no engine handed back go (their memory is gone). Kept ones move
    first: this generation's may take the name an earlier one had."""
    kept = []
    for (kind, key), (path, manifest) in sorted(targets.items(), key=lambda t: t[0][0] != "kept"):
        resident = adopted.get((kind, key))
        try:
            if resident is None:
                if path != manifest_path(socket_path, None) or kind == "kept":
                    _remove_file(path)
                continue
            target = (retained_manifest_path(socket_path, manifest.fingerprint)
                      if kind == "kept" else manifest_path(socket_path, key))
            move_manifest(path, target)
        except (OSError, StateDirError, ValueError) as exc:
            log.warning("cannot move manifest %s: %s", path, exc)
        if resident is not None and kind == "kept":
            kept.append((resident, manifest))
    return kept


def _remove_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError), opened_private_dir(os.path.dirname(path)) as fd:
        os.unlink(os.path.basename(path), dir_fd=fd)


def _manifests(socket_path: str) -> tuple[dict[str, Manifest], list[str]]:
    """Every readable manifest of this socket by path: the checkpoint layout's, each engine
    layout's and each kept layout's; and why the checkpoint layout's is not among them."""
    found: dict[str, Manifest] = {}
    notes: list[str] = []
    paths = [manifest_path(socket_path, plan) for plan in [None, *layout_plans(socket_path)]]
    paths += [retained_manifest_path(socket_path, fp) for fp in retained_fingerprints(socket_path)]
    for path in paths:
        try:
            found[path] = read_manifest(path)
        except ManifestError as exc:
            if path == paths[0]:
                notes.append(str(exc))
    return found, notes


def _classify(
    socket_path: str,
    manifests: dict[str, Manifest],
    base: CacheConfig,
    transport: str,
    gpu: str,
    files: Source,
    notes: list[str],
) -> tuple[dict[str | None, tuple[str, Manifest]], dict[str, tuple[str, Manifest]]]:
    """This generation's manifests that still describe what this daemon serves, by plan
    (``base`` is its config from the checkpoint's headers, ``files`` the checkpoint files'
    stamps now), and earlier generations' on the same transport and GPU, by fingerprint:
    their weights are taken back to be kept. Why the others count for nothing goes to
    ``notes`` (their files are removed, but the checkpoint layout's own, which the next
    load replaces)."""
    wanted: dict[str | None, tuple[str, Manifest]] = {}
    others: dict[str, tuple[str, Manifest]] = {}
    ours = manifest_path(socket_path, None)
    for path, manifest in manifests.items():
        plan = manifest.config.plan
        expected = msgspec.structs.replace(base, plan=plan)
        stale = stale_reason(manifest, config=expected, transport=transport, gpu=gpu)
        if stale is None and manifest.source is not None:
            # Same headers, but the files were rewritten since these bytes were read: the
            # engines' copies may no longer be what the disk holds.
            changed = difference(tuple(manifest.source), files)
            if changed is not None:
                stale = f"the checkpoint changed since these bytes were read from disk ({changed})"
        which = "" if plan is None else f"layout {plan[:12]}: "
        if stale is None and plan not in wanted:
            wanted[plan] = (path, manifest)
            continue
        if (stale is not None and manifest.fingerprint != fingerprint(expected)
                and manifest.transport == transport and manifest.gpu == gpu):
            # Another config: an earlier generation's weights, kept if an engine maps them.
            others.setdefault(manifest.fingerprint, (path, manifest))
            if path == ours:
                notes.append(f"{stale} (an earlier generation: kept if an engine hands it back)")
            continue
        notes.append(f"{which}{stale or 'a second manifest of this layout'}")
        if path != ours:
            _remove_file(path)
    return wanted, others


def adopt_from(
    engine: str,
    socket_path: str,
    manifest: Manifest,
    backend: WeightCacheTransportBackend,
    device: torch.device,
    policy: PeerPolicy,
    timeout: float,
) -> tuple[AdoptedMemory, int]:
    """Import one engine's fds and verify them; raises with the reason otherwise."""
    sizes = manifest.layout.allocation_sizes
    handed = ask_for_handback(
        engine, os.path.basename(socket_path), manifest.fingerprint, len(sizes), policy, timeout
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


ENGINES_DIR_MODE = 0o3770  # setgid + sticky, rwx for the daemon and its group


def prepare_engines_dir(daemon_socket_path: str) -> str:
    """Create ``engines/`` with mode 3770 and our group, keep only sockets in it; return
    its path.

    Engines run under their own uids with the daemon's gid as primary group:
    group write lets them add their sockets, setgid gives every socket the
    daemon's group (so the daemon may connect to it), sticky stops one engine
    removing or renaming another's. A symlink there is refused; a directory
    owned by another uid is used as it is, with a warning.

    Engines may write their hand-back sockets there and nothing else. Write
    access to a directory cannot be narrowed to sockets, so whatever else an
    engine left (files, links, directories) the daemon, the directory's owner,
    removes at start where it can (a directory only when empty: it may not
    enter another uid's), logging what stays. It reads at most
    ``MAX_LISTED`` entries and never descends: no engine can make a daemon's
    start walk a tree of its making.
    """
    directory = engines_dir(daemon_socket_path)
    parent = os.open(os.path.dirname(directory), DIR_FLAGS)
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(os.path.basename(directory), 0o700, dir_fd=parent)  # widened once ours
        try:
            fd = os.open(os.path.basename(directory), DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            message = f"{exc.strerror} (a symlink there is refused)"
            raise OSError(exc.errno, message, directory) from None
    finally:
        os.close(parent)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            log.warning(
                "engines' directory %s is owned by uid %d, not this daemon; leaving its mode",
                directory, info.st_uid,
            )
            return directory
        if info.st_gid != os.getegid():
            os.fchown(fd, -1, os.getegid())
        os.fchmod(fd, ENGINES_DIR_MODE)
        _keep_only_sockets(fd, directory)
    finally:
        os.close(fd)
    return directory


def _keep_only_sockets(fd: int, directory: str) -> None:
    removed, kept = 0, []
    with os.scandir(fd) as entries:
        for entry in itertools.islice(entries, MAX_LISTED):
            try:
                mode = entry.stat(follow_symlinks=False).st_mode
                if stat.S_ISSOCK(mode):
                    continue
                if stat.S_ISDIR(mode):
                    os.rmdir(entry.name, dir_fd=fd)
                else:
                    os.unlink(entry.name, dir_fd=fd)
                removed += 1
            except FileNotFoundError:
                continue
            except OSError:
                kept.append(entry.name)
    if removed or kept:
        log.warning(
            "engines' directory %s: removed %d entries that are not hand-back sockets%s; "
            "engines may create only their sockets there", directory, removed,
            f", kept {len(kept)} it cannot remove (e.g. {kept[0]!r})" if kept else "",
        )


def engine_sockets(daemon_socket_path: str) -> list[str]:
    """Every engine's hand-back socket beside ``daemon_socket_path``, in name order."""
    return socket_files(engines_dir(daemon_socket_path))


# --------------------------------------------------------------------------- asking engines


@dataclass
class HandedBack:
    pid: int
    allocation_sizes: list[int]
    fds: list[int]


class Refused(RuntimeError):
    """The engine answered and declined (another layout, another daemon socket, ...)."""


class EngineGone(ConnectionRefusedError):
    """Nobody listens on the engine socket (its engine died without removing it), or it is gone."""


def ask_for_handback(
    engine_socket: str,
    daemon_socket_name: str,
    fingerprint: str,
    max_allocations: int,
    policy: PeerPolicy,
    timeout: float = 5.0,
) -> HandedBack:
    """Ask one engine for its fds; raises with the reason on refusal or a bad reply.

    The engine must run as a peer ``policy`` allows, the same rule the daemon
    applies to the engines it serves. ``timeout`` bounds the whole exchange
    (connect, send, the whole reply): an engine that answers a byte at a time
    gets TimeoutError, not a daemon stuck loading.
    """
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.settimeout(timeout)
            try:
                sock.connect(engine_socket)
            except (ConnectionRefusedError, FileNotFoundError):
                raise EngineGone(f"{engine_socket}: nobody listens (engine gone)") from None
            pid, uid, gid = peer_credentials(sock)
            if not policy.allows(uid, gid, peer_groups(sock)):
                raise PermissionError(
                    f"engine pid {pid} runs as uid {uid} / gid {gid}: not allowed"
                )
            request = ReadoptRequest(v=1, socket_name=daemon_socket_name, fingerprint=fingerprint)
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            send_message(sock, request)
            body, fds = recv_frame(
                sock, READOPT_MAX_FRAME, max_fds=max_allocations, deadline=deadline
            )
        except TimeoutError:
            raise TimeoutError(
                f"the engine did not complete the hand-back within {round(timeout, 1):g} s"
            ) from None
    try:
        reply = decode_readopt_reply(body)
        if reply.status != "ok":
            raise Refused(f"engine pid {reply.pid} refused: {reply.error}")
        if len(fds) != len(reply.allocation_sizes):
            raise ProtocolError(
                f"engine pid {reply.pid} sent {len(fds)} fds for "
                f"{len(reply.allocation_sizes)} allocations"
            )
    except BaseException:
        close_fds(fds)
        raise
    return HandedBack(reply.pid, reply.allocation_sizes, fds)
