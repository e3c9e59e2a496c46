"""torch_ipc transport on the CPU: PyTorch shared-memory fds, plain MessagePack handles."""

from __future__ import annotations

import gc
import os

import msgspec
import pytest
import torch

from tests.unit.wc_harness import open_fd_count, serve_tensors, transfer
from weightcache.layout import build_views
from weightcache.protocol import ProtocolError
from weightcache.transport import get_client_transport_backend
from weightcache.transport.base import AllocationEntry
from weightcache.transport.torch_ipc import (
    CudaIpcHandle,
    TorchIpcBackend,
    TorchVersionMismatch,
    torch_release,
)

TENSORS = {
    "emb": torch.randn(16, 8, generator=torch.Generator().manual_seed(1)),
    "norm": torch.ones(8, dtype=torch.float16),
    "count": torch.tensor(7, dtype=torch.int32),
}


@pytest.fixture
def served():
    s = serve_tensors("torch_ipc", TENSORS)
    yield s
    s.memory.close()


def ours(allocations: list) -> dict:
    """The export as a daemon on this process's torch sends it."""
    return {"torch_version": torch_release(), "allocations": allocations}


def test_cpu_export_is_fds_with_empty_handles_and_the_daemons_torch(served) -> None:
    assert served.export.handles == ours([None])
    assert len(served.export.fds) == 1
    assert served.memory.preloaded_weights_bytes == sum(served.layout.allocation_sizes)


def test_round_trip_shares_the_daemons_memory(served) -> None:
    backend = get_client_transport_backend("torch_ipc")
    before = open_fd_count()
    imported = backend.import_tensors(transfer(served, backend))
    views = build_views(imported.buffers, served.layout)
    for name, tensor in TENSORS.items():
        assert torch.equal(views[name], tensor)
        assert views[name].dtype == tensor.dtype and views[name].shape == tensor.shape
    # Same pages, not a copy: a daemon-side write shows through the engine's view.
    served.memory.buffers[0][:4] = torch.tensor([2.5]).view(torch.uint8)
    assert views["emb"][0, 0].item() == 2.5
    # The received fds are not kept (torch_ipc memory cannot be re-adopted).
    assert imported.fds == []
    del views, imported
    gc.collect()
    assert open_fd_count() == before


def test_handles_that_do_not_match_the_layout_are_refused() -> None:
    backend = TorchIpcBackend()
    with pytest.raises(ProtocolError, match="2 handles for 1 allocations"):
        backend.decode_handles(ours([None, None]), 1)
    with pytest.raises(ProtocolError, match="bad torch_ipc handles"):
        backend.decode_handles(ours([[0, "not bytes", 1, 0, b"", 0, None, False]]), 1)
    with pytest.raises(ProtocolError, match="bad torch_ipc handles"):
        backend.decode_handles({"handle": b"x"}, 1)
    with pytest.raises(ProtocolError, match="bad torch_ipc handles"):
        backend.decode_handles(ours([[0, b"h" * 5000, 1, 0, b"", 0, None, False]]), 1)
    with pytest.raises(ProtocolError, match="bad torch_ipc handles"):
        backend.decode_handles([None], 1)  # a daemon from before the torch check


def test_a_daemon_on_another_torch_release_is_refused_naming_both() -> None:
    """torch_ipc hands over torch's own handles: the one transport that needs the same
    torch on both sides (the CacheConfig carries no torch version)."""
    other = {"torch_version": "1.99.0", "allocations": [None]}
    with pytest.raises(TorchVersionMismatch) as caught:
        TorchIpcBackend().decode_handles(other, 1)
    assert caught.value.fields == ["torch_version"]
    assert f"daemon runs torch 1.99.0, this engine {torch_release()}" in str(caught.value)
    assert "use vmm_fd (GPU) or memfd (CPU)" in str(caught.value)


def test_cuda_handles_decode_into_typed_structs_only() -> None:
    fields = [0, b"handle", 512, 0, b"ref", 0, None, True]
    [handle] = TorchIpcBackend().decode_handles(ours([fields]), 1)
    assert handle == CudaIpcHandle(*fields)
    # Plain MessagePack, no pickle: the struct re-encodes as the same list.
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(handle)) == fields
    assert not TorchIpcBackend().fds_expected([handle])
    assert TorchIpcBackend().fds_expected([None])


def test_an_allocation_with_neither_handle_nor_fd_is_refused() -> None:
    with pytest.raises(ProtocolError, match="allocation 0 has neither handle nor fd"):
        TorchIpcBackend().import_tensor(AllocationEntry(0, 256))


def test_a_shared_storage_of_the_wrong_size_is_refused_and_the_fd_closed(served) -> None:
    fd = os.dup(served.export.fds[0])
    size = served.layout.allocation_sizes[0]
    with pytest.raises(
        RuntimeError, match=f"shared memory file holds {size} bytes, layout says {size * 2}"
    ):
        TorchIpcBackend().import_tensors([AllocationEntry(0, size * 2, None, fd)])
    with pytest.raises(OSError):
        os.fstat(fd)
