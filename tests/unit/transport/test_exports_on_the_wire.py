"""Every transport's export, daemon to engine, through the real wire without a GPU.

The daemon's ``fetch_state_reply`` and the backend's ``send_fetch_state_response``
on one end of a socket pair, the client's ``decode_reply`` and
``recv_fetch_state_response`` on the other: what the engine receives must be what
the daemon exported, value for value and type for type (a CUDA IPC handle's bytes
stay bytes). CI has no GPU, so the CUDA exports are built from fields of the real
types: what ``UntypedStorage._share_cuda_()`` returns, and the fds ``vmm_fd``
exports (any fd travels the same way; a memfd stands in for the driver's).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgspec
import pytest
import torch

from tests.unit.wc_harness import serve_tensors
from weightcache.daemon.server import fetch_state_reply
from weightcache.protocol import FetchStateRequest, Layout, TensorGroup, decode_reply
from weightcache.transport import TRANSPORT_NAMES, get_client_transport_backend
from weightcache.transport.base import AllocationEntry, DaemonMemory, Export
from weightcache.transport.torch_ipc import CudaIpcHandle, TorchAllocatorMemory, TorchIpcBackend
from weightcache.wire import close_fds, recv_frame

# Byte strings that are not UTF-8 and hold every byte value: neither text nor base64
# survives as them.
IPC_HANDLE = bytes(range(256))[::-1][:64]
REF_COUNTER_HANDLE = b"\x00\xff/dev/shm/torch_ref\x80"
EVENT_HANDLE = bytes(range(64))

# What torch's `_share_cuda_()` returns: device index, memory handle, size, offset,
# ref-counter handle and offset, event handle (None without one), event sync flag.
CUDA_SHARED = [
    (0, IPC_HANDLE, 2 * 1024 * 1024, 0, REF_COUNTER_HANDLE, 8, EVENT_HANDLE, True),
    (3, IPC_HANDLE[::-1], 512, 256, REF_COUNTER_HANDLE, 16, None, False),
]


@dataclass
class Resident:
    """What the daemon's ``fetch_state_reply`` reads of the weights it holds."""

    memory: DaemonMemory
    layout: Layout
    export: Export
    config: None = None
    fingerprint: str = "0" * 64

    @property
    def preloaded_weights_bytes(self) -> int:
        return sum(self.layout.allocation_sizes)


class DeviceMemory(DaemonMemory):
    """Device memory that was never allocated: its export is built from real-typed
    fields instead (no GPU here). ``fetch_state_reply`` reads only its kind."""

    def __init__(self, backend_name: str, sizes: list[int]) -> None:
        super().__init__(sizes, torch.device("cuda", 0))
        self.backend_name = backend_name

    def close(self) -> None:
        pass


def layout_of(sizes: list[int]) -> Layout:
    """One byte tensor filling each allocation (a daemon holds one allocation per device;
    two here check that allocations keep their order)."""
    groups = [
        TensorGroup(allocation=i, dtype="uint8", shape=[size], offset=0, step=size, names=[f"t{i}"])
        for i, size in enumerate(sizes)
    ]
    return Layout(allocation_sizes=list(sizes), groups=groups)


def memfds(sizes: list[int]) -> list[int]:
    fds = []
    for size in sizes:
        fd = os.memfd_create("vmm-stand-in", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        fds.append(fd)
    return fds


def memfd_resident() -> Resident:
    served = serve_tensors("memfd", {"w": torch.arange(64.0), "b": torch.ones(3)})
    return Resident(served.memory, served.layout, served.export)


def torch_ipc_cpu_resident() -> Resident:
    served = serve_tensors("torch_ipc", {"w": torch.arange(64.0), "b": torch.ones(3)})
    return Resident(served.memory, served.layout, served.export)


class SharedCudaStorage:
    """A CUDA allocation's stand-in (no GPU here): only what the daemon's export asks of
    it, the fields its storage's ``_share_cuda_()`` returns."""

    def __init__(self, fields: tuple) -> None:
        self.fields = fields

    def untyped_storage(self) -> SharedCudaStorage:
        return self

    def _share_cuda_(self) -> tuple:
        return self.fields


def torch_ipc_cuda_resident() -> Resident:
    """TorchIpcBackend.prepare_export's own CUDA path, over allocations that share these
    fields."""
    layout = layout_of([shared[2] for shared in CUDA_SHARED])
    memory = TorchAllocatorMemory.__new__(TorchAllocatorMemory)  # its __init__ allocates
    DaemonMemory.__init__(memory, layout.allocation_sizes, torch.device("cuda", 0))
    memory.buffers = [SharedCudaStorage(shared) for shared in CUDA_SHARED]
    return Resident(memory, layout, TorchIpcBackend().prepare_export(memory))


def vmm_fd_resident() -> Resident:
    # VmmFdBackend.prepare_export: no handles, one fd per allocation.
    layout = layout_of([4096, 8192])
    memory = DeviceMemory("vmm_fd", layout.allocation_sizes)
    return Resident(memory, layout, Export(handles=None, fds=memfds(layout.allocation_sizes)))


# One daemon-side export per transport and kind of memory; a transport missing here
# fails test_every_transport_has_its_exports_checked.
EXPORTS: dict[str, dict[str, Callable[[], Resident]]] = {
    "memfd": {"cpu": memfd_resident},
    "torch_ipc": {"cpu": torch_ipc_cpu_resident, "cuda": torch_ipc_cuda_resident},
    "vmm_fd": {"cuda": vmm_fd_resident},
}
CASES = [(name, kind) for name, kinds in EXPORTS.items() for kind in kinds]


@pytest.fixture(params=CASES, ids=[f"{name}-{kind}" for name, kind in CASES])
def resident(request) -> Iterator[tuple[str, Resident]]:
    name, kind = request.param
    made = EXPORTS[name][kind]()
    yield name, made
    made.memory.close()
    close_fds(list(made.export.fds))


def over_the_wire(resident: Resident, transport: str) -> tuple[object, list[AllocationEntry]]:
    """One fetch_state answered by the daemon's code and read by the client's."""
    request = FetchStateRequest(v=1, config=None, transports=[transport])
    reply, backend = fetch_state_reply(request, resident)
    assert backend is not None, reply.error
    daemon_end, engine_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with daemon_end, engine_end:
        backend.send_fetch_state_response(daemon_end, reply, resident.export)
        body, fds = recv_frame(engine_end, max_fds=0)
        assert fds == []  # the reply itself never carries fds
        received = decode_reply(body)
        client = get_client_transport_backend(received.transport_backend)
        return received, client.recv_fetch_state_response(engine_end, received)


def test_every_transport_has_its_exports_checked() -> None:
    assert set(EXPORTS) == set(TRANSPORT_NAMES)


def test_the_engine_receives_what_the_daemon_exported(resident) -> None:
    name, made = resident
    reply, entries = over_the_wire(made, name)
    try:
        assert reply.transport_backend == name
        assert [e.size for e in entries] == made.layout.allocation_sizes
        assert [e.index for e in entries] == list(range(len(entries)))
        if made.export.fds:
            # The same open files, one per allocation in order, not just as many fds.
            sent = [os.fstat(fd).st_ino for fd in made.export.fds]
            assert [os.fstat(e.fd).st_ino for e in entries] == sent
        else:
            assert all(e.fd is None for e in entries)
    finally:
        close_fds([e.fd for e in entries if e.fd is not None])


def test_cuda_ipc_handles_arrive_as_the_bytes_torch_shared() -> None:
    """The export torch_ipc builds on CUDA, decoded by the engine into the very fields
    `_share_cuda_()` gave: bytes as bytes, ints as ints, the device index kept."""
    made = torch_ipc_cuda_resident()
    _, entries = over_the_wire(made, "torch_ipc")
    handles = [entry.handle for entry in entries]
    assert handles == [CudaIpcHandle(*shared) for shared in CUDA_SHARED]
    for handle, shared in zip(handles, CUDA_SHARED, strict=True):
        assert type(handle.handle) is bytes and handle.handle == shared[1]
        assert type(handle.ref_counter_handle) is bytes
        assert handle.event_handle == shared[6]
        assert type(handle.device) is int and handle.device == shared[0]
        assert type(handle.event_sync_required) is bool
    # What import_tensor hands to torch._new_shared_cuda: the tuple as shared.
    assert [msgspec.structs.astuple(handle) for handle in handles] == CUDA_SHARED
