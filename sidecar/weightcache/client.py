"""The engine's IPC loader: attach to a daemon's weights and load them into a module.

    with meta_parameters():
        model = BertModel(config)            # parameters on meta, buffers real
    attached = attach(socket_path, expected_config)
    load_into(model, attached)               # no copies; nothing left on meta

``attached.preloaded_weights_bytes`` is what the KV-cache sizing must add
back (see :mod:`weightcache.kv`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from weightcache.daemon.server import PeerPolicy
from weightcache.handback import HandbackServer, offer_handback
from weightcache.layout import build_views, check_layout
from weightcache.protocol import (
    DEFAULT_MAX_FRAME,
    CacheConfig,
    DaemonStatus,
    ErrorReply,
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
from weightcache.transport import default_client_transports, get_client_transport_backend
from weightcache.transport.base import ImportedMemory, WeightCacheTransportBackend
from weightcache.wire import recv_frame, send_message

log = logging.getLogger(__name__)

# Exit code of a torch_ipc engine whose daemon died (EX_TEMPFAIL: restart me).
DAEMON_DIED_EXIT_CODE = 75
# Consecutive failed liveness checks before the watchdog declares the daemon dead.
WATCHDOG_MISSES = 3


class DaemonError(RuntimeError):
    """The daemon answered with an error (loading, busy, no common transport, ...)."""


class DaemonNotReady(DaemonError):
    """The daemon is loading or busy; the same request may succeed later."""


def _daemon_error(socket_path: str, message: str | None) -> DaemonError:
    # The daemon ends every transient refusal ("still loading", "busy") with "; retry".
    kind = DaemonNotReady if (message or "").endswith("; retry") else DaemonError
    return kind(f"daemon at {socket_path}: {message}")


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
    _memory: ImportedMemory | None = field(default=None, repr=False)
    _watchdog: DaemonWatchdog | None = field(default=None, repr=False)
    _handback: HandbackServer | None = field(default=None, repr=False)

    def daemon_alive(self, timeout: float = 2.0) -> bool:
        """Whether the daemon that served these weights still answers (same pid)."""
        if self.socket_path is None:
            return False
        try:
            return ping(self.socket_path, timeout) == self.daemon_pid
        except (OSError, RuntimeError):
            return False

    @property
    def degraded(self) -> bool:
        """vmm_fd/memfd engines keep serving after their daemon dies; this says so."""
        return not self.daemon_alive()

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
            return ping(attached.socket_path, timeout=self._interval * 2) != attached.daemon_pid
        except (FileNotFoundError, ConnectionRefusedError):
            return True
        except (OSError, RuntimeError):
            return False  # busy or slow: alive as far as we can tell

    def stop(self) -> None:
        self._stopped.set()


def _connect(socket_path: str, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(socket_path)
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
            raise DaemonError(f"daemon at {socket_path}: {reply.error}") from None
        raise


def _request(socket_path: str, request, timeout: float, max_frame: int = DEFAULT_MAX_FRAME):
    with _connect(socket_path, timeout) as sock:
        _send(sock, request, socket_path, max_frame)
        body, _ = recv_frame(sock, max_frame, max_fds=0)
    reply = decode_reply(body)
    if isinstance(reply, ErrorReply):
        raise _daemon_error(socket_path, reply.error)
    return reply


def ping(socket_path: str, timeout: float = 5.0) -> int:
    """The daemon's pid, if it answers."""
    reply = _request(socket_path, PingRequest(v=1), timeout)
    if not isinstance(reply, PingReply):
        raise ProtocolError(f"expected a ping reply, got {type(reply).__name__}")
    return reply.pid


def daemon_status(socket_path: str, timeout: float = 5.0) -> DaemonStatus:
    reply = _request(socket_path, StatusRequest(v=1), timeout)
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
    restarting daemon that ``handback_peers`` allows (default: our own uid),
    so it re-adopts the weights instead of reloading them (see
    :mod:`weightcache.handback`).
    ``wait_ready`` seconds: keep retrying while the daemon is not up yet, still
    loading or busy (an engine container usually starts before its daemon is
    ready); 0 fails at once.
    """
    transports = list(transports or default_client_transports())
    if fallback_model_dir is not None and not os.path.exists(socket_path):
        return _load_from_disk(Path(fallback_model_dir), config)
    deadline = time.monotonic() + wait_ready
    while True:
        try:
            reply, backend, memory = _fetch(
                socket_path, config, transports, read_write, timeout, max_frame
            )
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
        _memory=memory,
    )
    on_cuda = any(b.device.type == "cuda" for b in memory.buffers)
    if watchdog if watchdog is not None else (backend.name == "torch_ipc" and on_cuda):
        attached._watchdog = DaemonWatchdog(attached, watchdog_interval, on_daemon_death)
    if handback and backend.keeps_fds and memory.fds:
        sizes = reply.layout.allocation_sizes
        attached._handback = offer_handback(
            socket_path, reply.fingerprint, sizes, memory.fds, handback_peers
        )
    return attached


def _fetch(
    socket_path: str,
    config: CacheConfig | None,
    transports: list[str],
    read_write: bool,
    timeout: float,
    max_frame: int,
) -> tuple[FetchStateReply, WeightCacheTransportBackend, ImportedMemory]:
    """One fetch_state exchange, and the daemon's allocations mapped into this process."""
    with _connect(socket_path, timeout) as sock:
        request = FetchStateRequest(v=1, config=config, transports=transports)
        _send(sock, request, socket_path, max_frame)
        body, _ = recv_frame(sock, max_frame, max_fds=0)
        reply = _checked_reply(decode_reply(body), config, transports, socket_path)
        backend = get_client_transport_backend(reply.transport_backend, read_write=read_write)
        entries = backend.recv_fetch_state_response(sock, reply, max_frame)
    return reply, backend, backend.import_tensors(entries)


def _checked_reply(
    reply: object, config: CacheConfig | None, transports: list[str], socket_path: str
) -> FetchStateReply:
    if isinstance(reply, ErrorReply):
        raise _daemon_error(socket_path, reply.error)
    if not isinstance(reply, FetchStateReply):
        raise ProtocolError(f"expected a fetch_state reply, got {type(reply).__name__}")
    if reply.status == "mismatch":
        raise ConfigMismatch(
            reply.mismatched_fields,
            f"daemon at {socket_path} holds other weights; differing fields: "
            f"{', '.join(reply.mismatched_fields) or '(unspecified)'}",
        )
    if reply.status == "error":
        raise _daemon_error(socket_path, reply.error)
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
            kind = type(module._parameters[name])
            module._parameters[name] = kind(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


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
