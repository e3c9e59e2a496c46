"""``torch_ipc``: PyTorch's own sharing of allocator memory.

On CUDA this is legacy CUDA IPC (``cudaIpcGetMemHandle``): the engine must
share the daemon's PID namespace (hostPID across pods), the mapping is
read-write, and the memory dies with the daemon, so engines treat daemon
death as fail-stop. On the CPU it is PyTorch's shared-memory fd. The handle
fields are sent as plain MessagePack values; nothing is pickled.

Both sides must run the same torch release: the handles are torch's own
(``_share_cuda_`` fields, shared-memory fds it maps itself). The daemon sends
its torch version with the handles and the engine refuses another one
(:class:`TorchVersionMismatch`, which the client reports as a config
mismatch of ``torch_version``); fd transports (vmm_fd, memfd) have no such
coupling, so the ``CacheConfig`` carries no torch version.

torch_ipc cannot re-adopt (docs/readoption.md): on CUDA the memory belongs
to the daemon's caching allocator and dies with the daemon, and engines keep
no fds to hand back, so a restarted daemon always reloads from disk (its
status says so).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Annotated

import msgspec
import torch

from weightcache.protocol import ProtocolError
from weightcache.transport.base import (
    AllocationEntry,
    DaemonMemory,
    Export,
    TransportMismatch,
    WeightCacheTransportBackend,
)

Bytes = Annotated[bytes, msgspec.Meta(max_length=4096)]


class CudaIpcHandle(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """The fields of ``UntypedStorage._share_cuda_()``, in its order."""

    device: int
    handle: Bytes
    size: int
    offset: int
    ref_counter_handle: Bytes
    ref_counter_offset: int
    event_handle: Bytes | None
    event_sync_required: bool


class TorchIpcHandles(msgspec.Struct, forbid_unknown_fields=True):
    """The export: the daemon's torch release, and one handle per allocation (None on
    the CPU, where the allocation travels as an fd)."""

    torch_version: Annotated[str, msgspec.Meta(max_length=64)]
    allocations: list[CudaIpcHandle | None]


_handles_decoder = msgspec.msgpack.Decoder(TorchIpcHandles)


def export_handles(shared: Sequence[Sequence[object] | None]) -> dict:
    """The reply's ``handles``: this daemon's torch release and, per allocation, the
    fields of its ``UntypedStorage._share_cuda_()`` (None for a CPU allocation, whose fd
    travels in the ``fds`` frame).

    The handle fields are bytes and must stay bytes: the reply is MessagePack, which
    carries them as ``bin``. A plain ``to_builtins`` would turn them into base64 text,
    which the engine's decoder refuses (and would have to guess back).
    """
    allocations = [None if fields is None else CudaIpcHandle(*fields) for fields in shared]
    return msgspec.to_builtins(
        TorchIpcHandles(torch_release(), allocations), builtin_types=(bytes,)
    )


def torch_release() -> str:
    """This process's torch release, without the local build tag (2.14.1+cu130 -> 2.14.1)."""
    return torch.__version__.split("+")[0]


class TorchVersionMismatch(TransportMismatch):
    """The daemon runs another torch release than this engine; torch_ipc needs the same."""


class TorchAllocatorMemory(DaemonMemory):
    backend_name = "torch_ipc"

    def __init__(self, sizes: list[int], device: torch.device) -> None:
        super().__init__(sizes, device)
        self._reserved_before = self._reserved()
        self.buffers = [torch.empty(size, dtype=torch.uint8, device=device) for size in sizes]
        if device.type == "cpu":
            for b in self.buffers:
                b.share_memory_()
        self._measured: int | None = None

    def _reserved(self) -> int:
        if self.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(self.device)

    def finish_load(self) -> None:
        if self.device.type == "cuda":
            self._measured = max(0, self._reserved() - self._reserved_before)

    @property
    def preloaded_weights_bytes(self) -> int:
        # CUDA: what the daemon's allocator actually reserved for the weights.
        return self._measured if self._measured is not None else sum(self.sizes)

    def close(self) -> None:
        self.buffers = []


class TorchIpcBackend(WeightCacheTransportBackend):
    name = "torch_ipc"

    def allocate(self, sizes: list[int], device: torch.device) -> DaemonMemory:
        return TorchAllocatorMemory(sizes, device)

    def prepare_export(self, memory: DaemonMemory) -> Export:
        assert isinstance(memory, TorchAllocatorMemory)
        if memory.device.type == "cuda":
            shared = [b.untyped_storage()._share_cuda_() for b in memory.buffers]
            return Export(handles=export_handles(shared), fds=[])
        fds = [b.untyped_storage()._share_fd_cpu_()[0] for b in memory.buffers]
        return Export(handles=export_handles([None] * len(fds)), fds=fds)

    def fds_expected(self, handles: list[object]) -> bool:
        # CPU shared memory travels as fds; CUDA IPC handles are plain bytes.
        return all(h is None for h in handles)

    def decode_handles(self, handles: object, count: int) -> list[object]:
        try:
            decoded = _handles_decoder.decode(msgspec.msgpack.encode(handles))
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise ProtocolError(f"bad torch_ipc handles from daemon: {exc}") from None
        if decoded.torch_version != torch_release():
            raise TorchVersionMismatch(
                ["torch_version"],
                f"torch_ipc shares torch's own memory handles, so daemon and engine need the "
                f"same torch: the daemon runs torch {decoded.torch_version}, this engine "
                f"{torch_release()}; use vmm_fd (GPU) or memfd (CPU), or the same torch "
                f"release in both images",
            )
        if len(decoded.allocations) != count:
            raise ProtocolError(
                f"torch_ipc: {len(decoded.allocations)} handles for {count} allocations"
            )
        return decoded.allocations

    def import_tensor(self, entry: AllocationEntry) -> torch.Tensor:
        handle = entry.handle
        if isinstance(handle, CudaIpcHandle):
            # Opening an IPC handle in a process that has not touched CUDA yet crashes.
            torch.cuda.init()
            with torch.cuda.device(handle.device):
                storage = torch.UntypedStorage._new_shared_cuda(*msgspec.structs.astuple(handle))
        else:
            if entry.fd is None:
                raise ProtocolError(
                    f"torch_ipc: allocation {entry.index} has neither handle nor fd"
                )
            # torch maps whatever size it is told; past the file's end reads would SIGBUS.
            actual = os.fstat(entry.fd).st_size
            if actual != entry.size:
                raise RuntimeError(
                    f"allocation {entry.index}: shared memory file holds {actual} bytes, "
                    f"layout says {entry.size}"
                )
            storage = torch.UntypedStorage._new_shared_fd_cpu(entry.fd, entry.size)
        if storage.nbytes() != entry.size:
            raise RuntimeError(
                f"allocation {entry.index}: shared storage has {storage.nbytes()} bytes, "
                f"layout says {entry.size}"
            )
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
