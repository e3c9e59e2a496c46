"""The engine's IPC loader: attach to a daemon's weights and load them into a module.

    with meta_parameters():
        model = BertModel(config)            # parameters on meta, buffers real
    attached = attach(socket_path, expected_config)
    load_into(model, attached)               # no copies; nothing left on meta

``attached.preloaded_weights_bytes`` is what the KV-cache sizing must add
back (see :mod:`weightcache.kv`).

Before anything is sent or mapped, the engine checks who serves the socket:
its SO_PEERCRED uid must be an expected daemon uid (:func:`expected_daemon`),
so a process of another uid listening on the daemon's path is refused
(:class:`UntrustedDaemon`).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch
from torch import nn

from weightcache.handback import HandbackServer, offer_handback
from weightcache.layout import build_views, check_layout
from weightcache.plan import LoadPlan, plan_hash
from weightcache.protocol import (
    DEFAULT_MAX_FRAME,
    CacheConfig,
    DaemonStatus,
    ErrorReply,
    FetchLayoutRequest,
    FetchStateReply,
    FetchStateRequest,
    PingReply,
    PingRequest,
    ProtocolError,
    StatusReply,
    StatusRequest,
    decode_reply,
    fingerprint,
    validated_preloaded_bytes,
)
from weightcache.sockets import PeerPolicy, peer_credentials
from weightcache.transport import default_client_transports, get_client_transport_backend
from weightcache.transport.base import (
    ImportedMemory,
    TransportMismatch,
    WeightCacheTransportBackend,
)
from weightcache.wire import recv_frame, send_message

log = logging.getLogger(__name__)

# Exit code of a torch_ipc engine whose daemon died (EX_TEMPFAIL: restart me).
DAEMON_DIED_EXIT_CODE = 75
# Consecutive failed liveness checks before the watchdog declares the daemon dead.
WATCHDOG_MISSES = 3
# Comma-separated uids a daemon may run as; unset: the owner of the socket's directory.
DAEMON_UIDS_ENV = "WEIGHTCACHE_DAEMON_UIDS"


class DaemonError(RuntimeError):
    """The daemon answered with an error (loading, busy, no common transport, ...)."""


class DaemonNotReady(DaemonError):
    """The daemon is loading or busy; the same request may succeed later."""


def _daemon_error(socket_path: str, reply: ErrorReply | FetchStateReply) -> DaemonError:
    # The daemon flags transient refusals (still loading, busy) as retryable.
    kind = DaemonNotReady if reply.retryable else DaemonError
    return kind(f"daemon at {socket_path}: {reply.error}")


class UntrustedDaemon(DaemonError):
    """The socket is served by a uid we do not expect (or its directory cannot vouch
    for one); nothing was sent to it and nothing mapped from it."""


@dataclass(frozen=True)
class DaemonIdentity:
    """The uids a daemon may run as, and where that expectation came from (for errors)."""

    uids: frozenset[int]
    source: str


def expected_daemon(socket_path: str, daemon_uids: Iterable[int] | None = None) -> DaemonIdentity:
    """Who may serve ``socket_path``: ``daemon_uids``, else ``$WEIGHTCACHE_DAEMON_UIDS``,
    else the owner of the socket's directory.

    The last is sound only where nobody else can have put a socket there: the
    directory must not be a symlink nor writable by group or others, and each
    directory above it must belong to root, that owner or us and, if others
    may write it, be sticky. Anything else raises :class:`UntrustedDaemon`
    saying what to fix.
    """
    if daemon_uids is not None:
        uids = frozenset(daemon_uids)
        if not uids or any(u < 0 for u in uids):
            raise ValueError(f"daemon_uids must be non-negative uids, got {sorted(uids)}")
        return DaemonIdentity(uids, "daemon_uids")
    configured = os.environ.get(DAEMON_UIDS_ENV, "").strip()
    if configured:
        try:
            uids = frozenset(int(part) for part in configured.split(","))
        except ValueError:
            uids = frozenset({-1})
        if any(u < 0 for u in uids):
            raise ValueError(
                f"{DAEMON_UIDS_ENV}={configured!r}: expected comma-separated non-negative uids"
            )
        return DaemonIdentity(uids, DAEMON_UIDS_ENV)
    directory = os.path.dirname(os.path.abspath(socket_path))
    return DaemonIdentity(frozenset({_vouching_owner(directory)}), f"owner of {directory}")


def _vouching_owner(directory: str) -> int:
    """The owner of ``directory``, if the directory and those above it let nobody else in."""
    hint = f"; or name the daemon's uid in {DAEMON_UIDS_ENV} / attach(daemon_uids=...)"
    try:
        info = os.lstat(directory)
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT,
            "no weightcache daemon socket directory (daemon not started yet?)",
            directory,
        ) from None
    mode = stat.S_IMODE(info.st_mode)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UntrustedDaemon(
            f"socket directory {directory} is a symlink or not a directory: its owner "
            f"cannot vouch for the daemon{hint}"
        )
    if mode & 0o022:
        raise UntrustedDaemon(
            f"socket directory {directory} (uid {info.st_uid}, mode {mode:04o}) is writable "
            f"by group or others, so anyone of them could have put the socket there; "
            f"make it 0750{hint}"
        )
    owner = info.st_uid
    trusted = {0, owner, os.geteuid()}
    above = os.path.dirname(os.path.realpath(directory))
    while True:
        up = os.stat(above)
        up_mode = stat.S_IMODE(up.st_mode)
        if up.st_uid not in trusted or (up_mode & 0o022 and not up_mode & stat.S_ISVTX):
            raise UntrustedDaemon(
                f"{above} (uid {up.st_uid}, mode {up_mode:04o}), above the socket directory, "
                f"could be changed by others than root and uid {owner}: the socket "
                f"directory's owner cannot vouch for the daemon{hint}"
            )
        if above == os.path.dirname(above):
            return owner
        above = os.path.dirname(above)


class ConfigMismatch(DaemonError):
    """The daemon holds other weights than the engine expects."""

    def __init__(self, fields: list[str], message: str) -> None:
        super().__init__(message)
        self.fields = fields


@dataclass
class AttachedWeights:
    tensors: dict[str, torch.Tensor]
    preloaded_weights_bytes: int
    transport: str
    daemon_pid: int
    fingerprint: str
    config: CacheConfig | None
    socket_path: str | None
    # The daemon's uid, checked (SO_PEERCRED) before anything was mapped.
    daemon_uid: int | None = None
    # Why this engine does not offer its fds to a restarting daemon (None: it does, or the
    # transport keeps none); the daemon cannot see it, so engines should say it.
    handback_error: str | None = None
    _memory: ImportedMemory | None = field(default=None, repr=False)
    _watchdog: DaemonWatchdog | None = field(default=None, repr=False)
    _handback: HandbackServer | None = field(default=None, repr=False)

    def ping(self, timeout: float) -> int:
        """The pid serving our socket, which must run as the daemon uid we attached to."""
        assert self.socket_path is not None and self.daemon_uid is not None
        return ping(self.socket_path, timeout, daemon_uids=[self.daemon_uid])

    def daemon_alive(self, timeout: float = 2.0) -> bool:
        """Whether the daemon that served these weights still answers (same pid)."""
        if self.socket_path is None:
            return False
        try:
            return self.ping(timeout) == self.daemon_pid
        except (OSError, RuntimeError):
            return False

    def allocations(self) -> list[torch.Tensor]:
        """The mapped allocations themselves (flat uint8), in layout order; empty once closed."""
        return list(self._memory.buffers) if self._memory is not None else []

    def degraded(self, timeout: float = 2.0) -> bool:
        """vmm_fd/memfd engines keep serving after their daemon dies; this asks and says so."""
        return not self.daemon_alive(timeout)

    def close(self) -> None:
        """Drop this engine's references; memory is released once no tensor uses it."""
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self._handback is not None:
            self._handback.close()  # before its fds are closed below
            self._handback = None
        self.tensors = {}
        if self._memory is not None:
            self._memory.close()
            self._memory = None


def fail_stop(attached: AttachedWeights) -> None:
    """torch_ipc on CUDA: the memory died with the daemon, so the engine must not go on."""
    log.critical(
        "weightcache daemon pid %d at %s is gone; torch_ipc weights are no longer valid; "
        "exiting with code %d so the engine restarts",
        attached.daemon_pid,
        attached.socket_path,
        DAEMON_DIED_EXIT_CODE,
    )
    os._exit(DAEMON_DIED_EXIT_CODE)


class DaemonWatchdog:
    """Polls the daemon; calls ``on_death(attached)`` once when it stops answering."""

    def __init__(self, attached: AttachedWeights, interval: float, on_death) -> None:
        self._attached = attached
        self._interval = interval
        self._on_death = on_death
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="weightcache-watchdog")
        self._thread.start()

    def _run(self) -> None:
        misses = 0
        while not self._stopped.wait(self._interval):
            misses = misses + 1 if self._daemon_gone() else 0
            # Several in a row: one missed ping (a stall) must not kill a healthy engine.
            if misses >= WATCHDOG_MISSES:
                self._on_death(self._attached)
                return

    def _daemon_gone(self) -> bool:
        """True only for evidence of death: no socket, nobody listening, or a new pid."""
        attached = self._attached
        try:
            return attached.ping(timeout=self._interval * 2) != attached.daemon_pid
        except (FileNotFoundError, ConnectionRefusedError, UntrustedDaemon):
            return True  # UntrustedDaemon: someone else now holds the socket
        except (OSError, RuntimeError):
            return False  # busy or slow: alive as far as we can tell

    def stop(self) -> None:
        self._stopped.set()


def _connect(socket_path: str, timeout: float, identity: DaemonIdentity) -> socket.socket:
    """A connection to ``socket_path``, whose listener must run as one of ``identity.uids``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(socket_path)
        pid, uid, _ = peer_credentials(sock)
    except OSError as exc:
        sock.close()
        if exc.errno is None:
            raise
        # "Connection refused" alone does not say which daemon is down (or restarting).
        raise type(exc)(
            exc.errno, f"no weightcache daemon answering ({exc.strerror})", socket_path
        ) from None
    except BaseException:
        sock.close()
        raise
    if uid not in identity.uids:
        sock.close()
        raise UntrustedDaemon(
            f"{socket_path} is served by pid {pid} running as uid {uid}, not by the daemon: "
            f"expected uid {', '.join(map(str, sorted(identity.uids)))} ({identity.source}); "
            "refused before sending or mapping anything"
        )
    return sock


def _send(sock: socket.socket, request, socket_path: str, max_frame: int) -> None:
    """Send a request; if the daemon hung up first, raise the reason it gave.

    A daemon refusing a connection (busy, peer not allowed) answers at once and
    closes without reading, so our send can fail with EPIPE while its error
    reply waits in our receive queue.
    """
    try:
        send_message(sock, request)
    except (BrokenPipeError, ConnectionResetError):
        try:
            body, _ = recv_frame(sock, max_frame, max_fds=0)
            reply = decode_reply(body)
        except (OSError, EOFError, ProtocolError):
            reply = None
        if isinstance(reply, ErrorReply):
            raise _daemon_error(socket_path, reply) from None
        raise


def _request(
    socket_path: str,
    request,
    timeout: float,
    daemon_uids: Iterable[int] | None,
    max_frame: int = DEFAULT_MAX_FRAME,
):
    identity = expected_daemon(socket_path, daemon_uids)
    with _connect(socket_path, timeout, identity) as sock:
        _send(sock, request, socket_path, max_frame)
        body, _ = recv_frame(sock, max_frame, max_fds=0)
    reply = decode_reply(body)
    if isinstance(reply, ErrorReply):
        raise _daemon_error(socket_path, reply)
    return reply


def ping(
    socket_path: str, timeout: float = 5.0, *, daemon_uids: Iterable[int] | None = None
) -> int:
    """The daemon's pid, if it answers (as an expected uid: see :func:`expected_daemon`)."""
    reply = _request(socket_path, PingRequest(v=1), timeout, daemon_uids)
    if not isinstance(reply, PingReply):
        raise ProtocolError(f"expected a ping reply, got {type(reply).__name__}")
    return reply.pid


def daemon_status(
    socket_path: str, timeout: float = 5.0, *, daemon_uids: Iterable[int] | None = None
) -> DaemonStatus:
    reply = _request(socket_path, StatusRequest(v=1), timeout, daemon_uids)
    if not isinstance(reply, StatusReply):
        raise ProtocolError(f"expected a status reply, got {type(reply).__name__}")
    return reply.status


def attach(
    socket_path: str,
    config: CacheConfig | None = None,
    transports: list[str] | None = None,
    *,
    fallback_model_dir: str | os.PathLike[str] | None = None,
    read_write: bool = False,
    watchdog: bool | None = None,
    on_daemon_death=fail_stop,
    watchdog_interval: float = 1.0,
    timeout: float = 30.0,
    max_frame: int = DEFAULT_MAX_FRAME,
    handback: bool = True,
    handback_peers: PeerPolicy | None = None,
    wait_ready: float = 0.0,
    daemon_uids: Iterable[int] | None = None,
) -> AttachedWeights:
    """Map the daemon's weights into this process.

    ``config=None`` accepts whatever the daemon holds; engines pass the config
    they expect and get :class:`ConfigMismatch` (naming the fields) otherwise.
    ``fallback_model_dir`` allows loading from disk, only when no socket exists.
    ``read_write`` maps vmm_fd memory writable (default read-only).
    ``watchdog`` (default: on for torch_ipc on CUDA, whose memory dies with the
    daemon) polls the daemon and calls ``on_daemon_death`` (default: exit the
    process with DAEMON_DIED_EXIT_CODE) when it is gone.
    ``handback`` (fd transports): keep the fds and hand them back to a
    restarting daemon running as the uid verified now (plus whom
    ``handback_peers`` allows), so it re-adopts the weights instead of
    reloading them (see :mod:`weightcache.handback`).
    ``wait_ready`` seconds: keep retrying while the daemon is not up yet, still
    loading or busy (an engine container usually starts before its daemon is
    ready); 0 fails at once.
    ``daemon_uids``: the uids the daemon may run as (default: see
    :func:`expected_daemon`); any other is refused with :class:`UntrustedDaemon`
    before anything is mapped.
    """
    transports = list(transports or default_client_transports())
    if fallback_model_dir is not None and not os.path.exists(socket_path):
        return _load_from_disk(Path(fallback_model_dir), config)
    request = FetchStateRequest(v=1, config=config, transports=transports)
    return _attach(
        socket_path, request, config, transports, read_write=read_write, watchdog=watchdog,
        on_daemon_death=on_daemon_death, watchdog_interval=watchdog_interval, timeout=timeout,
        max_frame=max_frame, handback=handback, handback_peers=handback_peers,
        wait_ready=wait_ready, daemon_uids=daemon_uids,
    )  # fmt: skip


def attach_layout(
    socket_path: str,
    config: CacheConfig,
    plan: LoadPlan,
    transports: list[str] | None = None,
    **options,
) -> AttachedWeights:
    """Map the daemon's build of ``plan`` (an engine's own layout of the weights ``config``
    names): ``tensors`` holds every parameter of the plan, by name and alias.

    The layout is asked for by the plan's hash; a daemon that does not hold it yet gets the
    plan and builds it (retryable meanwhile: ``wait_ready`` covers the build). Every
    parameter is checked against the plan's table (dtype, shape, strides) before use.
    ``options`` are :func:`attach`'s, but the disk fallback.
    """
    transports = list(transports or default_client_transports())
    key = plan_hash(plan)
    try:
        attached = attach_by_hash(socket_path, config, key, transports, **options)
    except UnknownLayout:
        expected = msgspec.structs.replace(config, plan=key)
        with_plan = FetchLayoutRequest(v=1, config=config, plan_hash=key,
                                       transports=transports, plan=plan)  # fmt: skip
        attached = _attach(socket_path, with_plan, expected, transports, **options)
    try:
        check_params(attached.tensors, plan)
    except ProtocolError:
        attached.close()
        raise
    return attached


def attach_by_hash(
    socket_path: str,
    config: CacheConfig,
    plan: str,
    transports: list[str] | None = None,
    **options,
) -> AttachedWeights:
    """Map the engine layout the daemon holds under the plan hash ``plan`` (tools, a
    neighbour daemon seeding itself); :class:`UnknownLayout` if it holds none."""
    transports = list(transports or default_client_transports())
    expected = msgspec.structs.replace(config, plan=plan)
    request = FetchLayoutRequest(v=1, config=config, plan_hash=plan, transports=transports)
    return _attach(socket_path, request, expected, transports, **options)


def check_params(tensors: Mapping[str, torch.Tensor], plan: LoadPlan) -> None:
    """The daemon's views must be exactly the plan's parameters: names, dtypes, shapes,
    strides, tied names sharing one tensor."""
    names = {n for p in plan.params for n in (p.name, *p.aliases)}
    if set(tensors) != names:
        extra, missing = sorted(set(tensors) - names), sorted(names - set(tensors))
        raise ProtocolError(f"daemon's layout differs from the plan: extra {extra[:5]}, "
                            f"missing {missing[:5]}")  # fmt: skip
    for p in plan.params:
        t = tensors[p.name]
        got = (str(t.dtype).removeprefix("torch."), list(t.shape), list(t.stride()))
        if t.numel() > 1 and got != (p.dtype, list(p.shape), list(p.stride)):
            raise ProtocolError(f"{p.name}: daemon's view is {got}, the plan says "
                                f"{(p.dtype, p.shape, p.stride)}")  # fmt: skip
        if any(tensors[a] is not t for a in p.aliases):
            raise ProtocolError(f"{p.name}: its tied names are not one tensor")


class UnknownLayout(DaemonError):
    """The daemon holds no layout of that plan hash (send the plan)."""


def _attach(
    socket_path: str,
    request: FetchStateRequest | FetchLayoutRequest,
    config: CacheConfig | None,
    transports: list[str],
    *,
    read_write: bool = False,
    watchdog: bool | None = None,
    on_daemon_death=fail_stop,
    watchdog_interval: float = 1.0,
    timeout: float = 30.0,
    max_frame: int = DEFAULT_MAX_FRAME,
    handback: bool = True,
    handback_peers: PeerPolicy | None = None,
    wait_ready: float = 0.0,
    daemon_uids: Iterable[int] | None = None,
) -> AttachedWeights:
    deadline = time.monotonic() + wait_ready
    while True:
        try:
            identity = expected_daemon(socket_path, daemon_uids)
            reply, backend, memory, daemon_uid = _fetch(
                socket_path, request, config, transports, read_write, timeout, max_frame,
                identity,
            )  # fmt: skip
            break
        except (DaemonNotReady, FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)
    try:
        tensors = build_views(memory.buffers, reply.layout)
    except BaseException:
        memory.close()
        raise
    attached = AttachedWeights(
        tensors=tensors,
        preloaded_weights_bytes=validated_preloaded_bytes(reply.preloaded_weights_bytes),
        transport=backend.name,
        daemon_pid=reply.pid,
        fingerprint=reply.fingerprint,
        config=reply.config,
        socket_path=socket_path,
        daemon_uid=daemon_uid,
        _memory=memory,
    )
    on_cuda = any(b.device.type == "cuda" for b in memory.buffers)
    if watchdog if watchdog is not None else (backend.name == "torch_ipc" and on_cuda):
        attached._watchdog = DaemonWatchdog(attached, watchdog_interval, on_daemon_death)
    if handback and backend.keeps_fds and memory.fds:
        sizes = reply.layout.allocation_sizes
        attached._handback, attached.handback_error = offer_handback(
            socket_path,
            reply.fingerprint,
            sizes,
            memory.fds,
            _handback_policy(daemon_uid, handback_peers),
        )
    return attached


def _handback_policy(daemon_uid: int, extra: PeerPolicy | None) -> PeerPolicy:
    """The daemon uid we verified (its successor runs as the same), and whom ``extra`` adds."""
    if extra is None:
        return PeerPolicy(frozenset({daemon_uid}))
    return PeerPolicy(extra.uids | {daemon_uid}, extra.gids)


def _fetch(
    socket_path: str,
    request: FetchStateRequest | FetchLayoutRequest,
    config: CacheConfig | None,
    transports: list[str],
    read_write: bool,
    timeout: float,
    max_frame: int,
    identity: DaemonIdentity,
) -> tuple[FetchStateReply, WeightCacheTransportBackend, ImportedMemory, int]:
    """One fetch exchange, and the daemon's allocations mapped into this process."""
    with _connect(socket_path, timeout, identity) as sock:
        daemon_uid = peer_credentials(sock)[1]
        _send(sock, request, socket_path, max_frame)
        body, _ = recv_frame(sock, max_frame, max_fds=0)
        reply = _checked_reply(decode_reply(body), config, transports, socket_path)
        backend = get_client_transport_backend(reply.transport_backend, read_write=read_write)
        try:
            entries = backend.recv_fetch_state_response(sock, reply, max_frame)
        except TransportMismatch as exc:
            raise ConfigMismatch(exc.fields, f"daemon at {socket_path}: {exc}") from None
    return reply, backend, backend.import_tensors(entries), daemon_uid


def _checked_reply(
    reply: object, config: CacheConfig | None, transports: list[str], socket_path: str
) -> FetchStateReply:
    if isinstance(reply, ErrorReply):
        raise _daemon_error(socket_path, reply)
    if not isinstance(reply, FetchStateReply):
        raise ProtocolError(f"expected a fetch_state reply, got {type(reply).__name__}")
    if reply.status == "mismatch":
        raise ConfigMismatch(
            reply.mismatched_fields,
            f"daemon at {socket_path} holds other weights; differing fields: "
            f"{', '.join(reply.mismatched_fields) or '(unspecified)'}",
        )
    if reply.status == "error":
        raise _daemon_error(socket_path, reply)
    if reply.status == "unknown_plan":
        raise UnknownLayout(f"daemon at {socket_path}: {reply.error}")
    # Validate before mapping anything, so a bad reply costs no mapping.
    validated_preloaded_bytes(reply.preloaded_weights_bytes)
    if reply.config is None or reply.layout is None or reply.fingerprint is None:
        raise ProtocolError("fetch_state reply lacks config, layout or fingerprint")
    if fingerprint(reply.config) != reply.fingerprint:
        raise ProtocolError("daemon's fingerprint does not match the config it sent")
    if config is not None and reply.config != config:
        raise ProtocolError("daemon answered ok for a config other than the one requested")
    name = reply.transport_backend or "torch_ipc"
    if name not in transports:
        raise ProtocolError(f"daemon chose transport {name!r}, which this client did not offer")
    try:
        check_layout(reply.layout)
    except ValueError as exc:
        raise ProtocolError(f"bad layout from daemon: {exc}") from None
    return reply


def _load_from_disk(model_dir: Path, config: CacheConfig | None) -> AttachedWeights:
    """The no-daemon path: a plain safetensors load (costs the engine its own memory)."""
    if config is not None and config.shard.tp_size > 1:
        raise RuntimeError(
            f"no daemon at the socket and the disk fallback loads whole tensors; it cannot "
            f"serve TP rank {config.shard.tp_rank} of {config.shard.tp_size}"
        )
    from safetensors.torch import load_file

    from weightcache.checkpoint import cache_config, checkpoint_files, read_checkpoint

    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        tensors.update(load_file(path))
    if config is not None and config.dtype is not None:
        from weightcache.checkpoint import dtype_from_name

        dtype = dtype_from_name(config.dtype)
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    actual = config or cache_config(read_checkpoint(model_dir), torch.device("cpu"))
    return AttachedWeights(tensors, 0, "disk", 0, fingerprint(actual), actual, None)


@contextmanager
def meta_parameters() -> Iterator[None]:
    """Build modules with parameters on ``meta`` and buffers real.

    Buffers a module computes in ``__init__`` (BERT's ``position_ids``) are not
    in checkpoints, so they must stay materialised; parameters come from the
    daemon via :func:`load_into`.
    """
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = _on_meta(param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _on_meta(param: nn.Parameter) -> nn.Parameter:
    """``param`` on meta, keeping its class and attributes.

    Engines subclass Parameter and hang their loaders on it (vLLM's
    ``weight_loader``); their constructors take extra arguments, so the meta
    copy is made without calling them. The attribute dict is shared, not
    copied: engines set attributes after registering the parameter.
    """
    meta = torch.Tensor._make_subclass(
        type(param), torch.empty_like(param, device="meta"), param.requires_grad
    )
    meta.__dict__ = param.__dict__
    return meta


def _check_match(name: str, source: torch.Tensor, target: torch.Tensor) -> None:
    if source.dtype != target.dtype or source.shape != target.shape:
        raise ValueError(
            f"{name}: the daemon holds {source.dtype} {tuple(source.shape)}, "
            f"the module expects {target.dtype} {tuple(target.shape)}"
        )
    if source.numel() > 1 and source.stride() != target.stride():
        raise ValueError(f"{name}: stride {source.stride()} != expected {target.stride()}")


def load_into(
    module: nn.Module, weights: AttachedWeights | Mapping[str, torch.Tensor]
) -> list[str]:
    """Point every parameter and checkpointed buffer of ``module`` at the daemon's tensors.

    No bytes are copied. Tied parameters (one Parameter under several names)
    stay one Parameter. Raises if any parameter or buffer is left on ``meta``.
    Returns the daemon tensors the module did not use.
    """
    tensors = weights.tensors if isinstance(weights, AttachedWeights) else weights
    used: set[str] = set()
    missing: list[str] = []
    modules = list(module.named_modules(remove_duplicate=False))

    # Group the places a parameter is registered, so tied weights stay tied.
    places: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str, str]]]] = {}
    for prefix, mod in modules:
        for pname, param in mod._parameters.items():
            if param is not None:
                full = f"{prefix}.{pname}" if prefix else pname
                places.setdefault(id(param), (param, []))[1].append((mod, pname, full))
    for param, sites in places.values():
        names = [full for _, _, full in sites if full in tensors]
        if not names:
            if param.is_meta:
                missing.append(sites[0][2])
            continue
        source = tensors[names[0]]
        _check_match(names[0], source, param)
        replacement = nn.Parameter(source, requires_grad=False)
        for mod, pname, _ in sites:
            mod._parameters[pname] = replacement
        used.update(names)

    for prefix, mod in modules:
        for bname, buf in mod._buffers.items():
            full = f"{prefix}.{bname}" if prefix else bname
            if full in tensors and bname not in mod._non_persistent_buffers_set:
                if buf is not None:
                    _check_match(full, tensors[full], buf)
                mod._buffers[bname] = tensors[full]
                used.add(full)
            elif buf is not None and buf.is_meta:
                missing.append(full)
    if missing:
        raise RuntimeError(
            f"{len(missing)} tensor(s) left on meta, absent from the daemon's weights: "
            f"{', '.join(missing[:10])}"
        )
    return sorted(set(tensors) - used)
