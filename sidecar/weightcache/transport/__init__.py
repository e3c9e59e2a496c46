"""Transport backends by name, and the negotiation between daemon and engine.

Unknown names raise: a silent fallback would hide a misconfigured engine.
A reply without ``transport_backend`` comes from an old daemon and means
``torch_ipc``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from weightcache.transport.base import DaemonMemory, WeightCacheTransportBackend

log = logging.getLogger(__name__)

DEFAULT_TRANSPORT = "torch_ipc"


def _memfd(read_write: bool) -> WeightCacheTransportBackend:
    from weightcache.transport.memfd import MemfdBackend

    if read_write:
        raise RuntimeError("memfd mappings are sealed and always read-only")
    return MemfdBackend()


def _torch_ipc(read_write: bool) -> WeightCacheTransportBackend:
    from weightcache.transport.torch_ipc import TorchIpcBackend

    # CUDA IPC and PyTorch's shared memory are always mapped read-write.
    return TorchIpcBackend()


def _vmm_fd(read_write: bool) -> WeightCacheTransportBackend:
    from weightcache.transport.vmm_fd import VmmFdBackend

    return VmmFdBackend(writable=read_write)


_BACKENDS: dict[str, Callable[[bool], WeightCacheTransportBackend]] = {
    "vmm_fd": _vmm_fd,
    "torch_ipc": _torch_ipc,
    "memfd": _memfd,
}
TRANSPORT_NAMES = tuple(_BACKENDS)


def get_client_transport_backend(
    name: str | None, *, read_write: bool = False
) -> WeightCacheTransportBackend:
    """The backend a daemon reply names; ``None`` (old daemon) means torch_ipc.

    ``read_write`` asks for writable mappings where the transport can choose.
    """
    name = DEFAULT_TRANSPORT if name is None else name
    try:
        factory = _BACKENDS[name]
    except KeyError:
        raise RuntimeError(
            f"unknown transport backend {name!r}; this client knows {list(TRANSPORT_NAMES)}"
        ) from None
    return factory(read_write)


def get_daemon_transport_backend(name: str) -> WeightCacheTransportBackend:
    return get_client_transport_backend(name)


def choose_daemon_transport_backend(
    memory: DaemonMemory, client_supported: list[str]
) -> WeightCacheTransportBackend:
    """The first transport the client lists that can export the daemon's memory."""
    for name in client_supported:
        # Only the daemon's own kind can export its memory; avoid building others.
        if name == memory.backend_name and name in _BACKENDS:
            backend = _BACKENDS[name](False)
            if backend.can_export(memory):
                return backend
    raise RuntimeError(
        f"no common transport: the daemon serves {memory.backend_name!r} memory, "
        f"the client supports {client_supported}"
    )


def default_client_transports() -> list[str]:
    """What an engine offers, preferred first."""
    if torch.cuda.is_available():
        return ["vmm_fd", "torch_ipc"]
    return ["memfd", "torch_ipc"]


def default_daemon_transport(device: torch.device) -> str:
    """``auto``: vmm_fd where the GPU supports VMM with POSIX fds, else torch_ipc; memfd on CPU."""
    if device.type == "cpu":
        return "memfd"
    from weightcache.transport.vmm_fd import vmm_fd_supported

    if vmm_fd_supported(device):
        return "vmm_fd"
    log.warning(
        "%s: no CUDA VMM with POSIX-fd handles (or cuda-bindings missing): serving torch_ipc, "
        "which engines can only open from the daemon's PID namespace (hostPID)",
        device,
    )
    return "torch_ipc"
