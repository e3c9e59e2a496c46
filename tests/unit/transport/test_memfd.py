"""memfd transport: sealed CPU memory, fds over SCM_RIGHTS, read-only mappings on the engine."""

from __future__ import annotations

import fcntl
import gc
import mmap
import os
import socket

import pytest
import torch

from tests.unit.wc_harness import open_fd_count, serve_tensors, transfer
from weightcache.layout import build_views
from weightcache.protocol import FetchStateReply, Layout, ProtocolError, decode_reply
from weightcache.transport import get_client_transport_backend
from weightcache.transport.base import AllocationEntry, FdBatch
from weightcache.transport.memfd import REQUIRED_SEALS, MemfdBackend
from weightcache.wire import recv_frame, send_message

TENSORS = {
    "w": torch.arange(24, dtype=torch.float32).view(4, 6),
    "b": torch.arange(6, dtype=torch.bfloat16),
    "ids": torch.tensor([3, 1, 4, 1, 5], dtype=torch.int64),
}


@pytest.fixture
def served():
    s = serve_tensors("memfd", TENSORS)
    yield s
    s.memory.close()


def mappings_of(fd: int) -> list[str]:
    """The permission fields of this process's mappings of ``fd``'s file."""
    inode = os.fstat(fd).st_ino
    with open("/proc/self/maps") as maps:
        return [line.split()[1] for line in maps if line.split()[4] == str(inode)]


def test_loaded_memory_is_sealed_against_writes_and_resizing(served) -> None:
    for fd, size in zip(served.memory.fds, served.memory.sizes, strict=True):
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & REQUIRED_SEALS == REQUIRED_SEALS
        with pytest.raises(PermissionError):
            mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, size * 2)
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)


def test_round_trip_maps_the_same_bytes_read_only(served) -> None:
    before = open_fd_count()
    backend = get_client_transport_backend("memfd")
    entries = transfer(served, backend)
    assert [e.size for e in entries] == served.layout.allocation_sizes
    imported = backend.import_tensors(entries)
    views = build_views(imported.buffers, served.layout)
    for name, tensor in TENSORS.items():
        assert torch.equal(views[name], tensor)
    # The engine's fd refers to the daemon's memfd; its mapping is shared and read-only.
    [fd] = imported.fds
    assert os.fstat(fd).st_ino == os.fstat(served.memory.fds[0]).st_ino
    assert mappings_of(fd) and all(perms == "r--s" for perms in mappings_of(fd))
    # Engines keep the fds (a restarted daemon re-adopts from them) until close().
    os.fstat(fd)
    imported.close()
    with pytest.raises(OSError):
        os.fstat(fd)
    del views, imported
    gc.collect()
    assert open_fd_count() == before


def test_engine_mapping_outlives_the_daemons_memory(served) -> None:
    backend = MemfdBackend()
    imported = backend.import_tensors(transfer(served, backend))
    served.memory.close()
    views = build_views(imported.buffers, served.layout)
    assert torch.equal(views["w"], TENSORS["w"])
    imported.close()


def test_an_unsealed_memfd_is_refused_and_its_fd_closed() -> None:
    fd = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 256)
    before = open_fd_count()
    with pytest.raises(RuntimeError, match="not sealed"):
        MemfdBackend().import_tensors([AllocationEntry(0, 256, None, fd)])
    assert open_fd_count() == before - 1


def test_a_memfd_of_the_wrong_size_is_refused(served) -> None:
    fd = os.dup(served.memory.fds[0])
    size = served.memory.sizes[0]
    with pytest.raises(RuntimeError, match=f"memfd holds {size} bytes, layout says {size + 256}"):
        MemfdBackend().import_tensors([AllocationEntry(0, size + 256, None, fd)])
    with pytest.raises(OSError):
        os.fstat(fd)  # closed by the failed import


def _reply_then_fds(layout: Layout, batch: FdBatch, fds: list[int]):
    daemon_end, engine_end = socket.socketpair()
    send_message(daemon_end, FetchStateReply(v=1, status="ok", layout=layout))
    send_message(daemon_end, batch, fds=fds)
    body, _ = recv_frame(engine_end)
    return daemon_end, engine_end, decode_reply(body)


@pytest.mark.parametrize(
    ("sent", "claimed", "message"),
    [
        (2, 2, "sent 2 file descriptors; expected at most 1"),
        (1, 2, "frame says 2, received 1"),
        (0, 0, "expected 1 fds"),
    ],
)
def test_fd_frames_that_do_not_match_the_layout_are_refused(served, sent, claimed, message):
    fds = [os.dup(served.memory.fds[0]) for _ in range(sent)]
    before = open_fd_count() - len(fds)
    daemon_end, engine_end, reply = _reply_then_fds(served.layout, FdBatch(v=1, count=claimed), fds)
    for fd in fds:
        os.close(fd)
    with daemon_end, engine_end, pytest.raises(ProtocolError, match=message):
        MemfdBackend().recv_fetch_state_response(engine_end, reply)
    assert open_fd_count() == before


def test_zero_size_allocations_and_tensors(tmp_path) -> None:
    served = serve_tensors("memfd", {"nothing": torch.empty(0, 3)})
    try:
        assert served.memory.sizes == [0]
        backend = MemfdBackend()
        imported = backend.import_tensors(transfer(served, backend))
        assert build_views(imported.buffers, served.layout)["nothing"].shape == (0, 3)
        imported.close()
    finally:
        served.memory.close()


def test_memfd_is_cpu_only_and_never_writable() -> None:
    with pytest.raises(RuntimeError, match="CPU memory; the daemon's device is meta"):
        MemfdBackend().allocate([256], torch.device("meta"))
    with pytest.raises(RuntimeError, match="always read-only"):
        get_client_transport_backend("memfd", read_write=True)
