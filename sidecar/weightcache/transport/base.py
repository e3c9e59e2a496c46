"""The transport seams shared by every backend.

A daemon holds its weights in a few flat allocations (see
:mod:`weightcache.layout`); a transport says how those allocations are
created on the daemon side and mapped on the engine side. The four seams of
the reference design stay: ``prepare_export``, ``send_fetch_state_response``,
``recv_fetch_state_response`` and ``import_tensor`` (one allocation in, one
flat tensor out; ``import_tensors`` is the batch loop a backend may override).
"""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import msgspec
import torch

from weightcache.protocol import DEFAULT_MAX_FRAME, FetchStateReply, ProtocolError
from weightcache.wire import close_fds, recv_frame, send_message


class FdBatch(msgspec.Struct, tag_field="op", tag="fds", forbid_unknown_fields=True):
    """The frame that follows a fetch_state reply and carries its fds (SCM_RIGHTS)."""

    v: Literal[1]
    count: int


_fd_batch_decoder = msgspec.msgpack.Decoder(FdBatch)


class TransportMismatch(RuntimeError):
    """The daemon's transport cannot serve this engine as it is (``fields`` say why, as
    a config mismatch would); nothing was mapped."""

    def __init__(self, fields: list[str], message: str) -> None:
        super().__init__(message)
        self.fields = fields


class DaemonMemory(ABC):
    """The daemon's allocations: written by the loader, then served read-only."""

    backend_name: ClassVar[str]

    def __init__(self, sizes: list[int], device: torch.device) -> None:
        self.sizes = list(sizes)
        self.device = device
        self.buffers: list[torch.Tensor] = []

    @property
    def preloaded_weights_bytes(self) -> int:
        """Exact sum of allocation sizes; allocator-backed memory overrides with a measurement."""
        return sum(self.sizes)

    def finish_load(self) -> None:  # noqa: B027 (optional hook; most memory needs nothing)
        """Called once every byte is written: seal, drop write access, take measurements."""

    @abstractmethod
    def close(self) -> None:
        """Release the daemon's references (importers keep theirs)."""


@dataclass
class Export:
    """What a fetch_state reply carries for one daemon memory, computed once."""

    handles: Any = None
    fds: list[int] = field(default_factory=list)


@dataclass
class AllocationEntry:
    """One allocation as the engine receives it."""

    index: int
    size: int
    handle: Any = None
    fd: int | None = None


class ImportedMemory:
    """Flat tensors over the daemon's allocations, plus what must be released with them."""

    def __init__(self, buffers: list[torch.Tensor], fds: list[int] | None = None) -> None:
        self.buffers = buffers
        # Kept open so a restarting daemon can re-adopt the memory from us.
        self.fds = fds or []

    def close(self) -> None:
        self.buffers = []
        close_fds(self.fds)
        self.fds = []


class WeightCacheTransportBackend(ABC):
    name: ClassVar[str]
    # Whether fetch_state replies are followed by an FdBatch frame
    # (daemon side: whenever the export has fds).
    uses_fds: ClassVar[bool] = False
    # Whether the engine keeps the received fds open, so that a restarting
    # daemon can re-adopt the memory (fd-based transports whose memory outlives
    # its creator).
    keeps_fds: ClassVar[bool] = False

    # ------------------------------------------------------------------ daemon side

    def allocation_alignment(self, device: torch.device) -> int:
        """What allocation sizes are rounded up to (e.g. the VMM granularity)."""
        return 256

    @abstractmethod
    def allocate(self, sizes: list[int], device: torch.device) -> DaemonMemory:
        """Memory the loader writes the weights into directly (no second copy)."""

    def can_export(self, memory: DaemonMemory) -> bool:
        return memory.backend_name == self.name

    @abstractmethod
    def prepare_export(self, memory: DaemonMemory) -> Export:
        """Handles and fds for ``memory``; computed once at load, reused for every client."""

    def send_fetch_state_response(
        self, conn: socket.socket, reply: FetchStateReply, export: Export
    ) -> None:
        send_message(conn, reply)
        if export.fds:
            send_message(conn, FdBatch(v=1, count=len(export.fds)), fds=export.fds)

    # ------------------------------------------------------------------ engine side

    def recv_fetch_state_response(
        self, sock: socket.socket, reply: FetchStateReply, max_frame: int = DEFAULT_MAX_FRAME
    ) -> list[AllocationEntry]:
        """Read whatever follows the reply for this backend; return one entry per allocation."""
        assert reply.layout is not None
        sizes = reply.layout.allocation_sizes
        handles = self.decode_handles(reply.handles, len(sizes))
        fds: list[int] = []
        if self.fds_expected(handles):
            body, fds = recv_frame(sock, max_frame, max_fds=len(sizes))
            try:
                batch = _fd_batch_decoder.decode(body)
                if batch.count != len(fds) or len(fds) != len(sizes):
                    raise ProtocolError(
                        f"expected {len(sizes)} fds for {len(sizes)} allocations, "
                        f"frame says {batch.count}, received {len(fds)}"
                    )
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                close_fds(fds)
                raise ProtocolError(f"bad fd frame from daemon: {exc}") from None
            except ProtocolError:
                close_fds(fds)
                raise
        return [
            AllocationEntry(i, size, handles[i], fds[i] if fds else None)
            for i, size in enumerate(sizes)
        ]

    def fds_expected(self, handles: list[Any]) -> bool:
        return self.uses_fds

    def decode_handles(self, handles: Any, count: int) -> list[Any]:
        """Validate the reply's transport-specific handles; default: none expected."""
        return [None] * count

    @abstractmethod
    def import_tensor(self, entry: AllocationEntry) -> torch.Tensor:
        """Map one allocation and return a flat uint8 tensor over it (no copy)."""

    def import_tensors(self, entries: list[AllocationEntry]) -> ImportedMemory:
        fds = [e.fd for e in entries if e.fd is not None]
        try:
            buffers = [self.import_tensor(entry) for entry in entries]
        except BaseException:
            close_fds(fds)
            raise
        if not self.keeps_fds:
            close_fds(fds)
            fds = []
        return ImportedMemory(buffers, fds)
