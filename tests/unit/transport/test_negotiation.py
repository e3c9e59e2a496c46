"""Choosing a transport: by name, by what the client offers, and for old daemons."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from tests.unit.wc_harness import FakeDaemon, serve_tensors
from weightcache.checkpoint import cache_config, read_checkpoint
from weightcache.client import DaemonError, attach
from weightcache.protocol import FetchStateReply, FetchStateRequest, fingerprint
from weightcache.transport import (
    TRANSPORT_NAMES,
    choose_daemon_transport_backend,
    default_client_transports,
    default_daemon_transport,
    get_client_transport_backend,
)
from weightcache.transport.memfd import MemfdBackend
from weightcache.transport.torch_ipc import TorchIpcBackend


@pytest.fixture(scope="module")
def memfd_memory():
    served = serve_tensors("memfd", {"w": torch.ones(4)})
    yield served.memory
    served.memory.close()


def test_every_known_name_gives_its_backend() -> None:
    assert set(TRANSPORT_NAMES) == {"vmm_fd", "torch_ipc", "memfd"}
    for name in TRANSPORT_NAMES:
        assert get_client_transport_backend(name).name == name


def test_an_unknown_name_raises_instead_of_falling_back() -> None:
    with pytest.raises(RuntimeError, match=r"unknown transport backend 'rdma'; this client knows"):
        get_client_transport_backend("rdma")
    with pytest.raises(RuntimeError, match="unknown transport backend ''"):
        get_client_transport_backend("")


def test_a_missing_name_means_torch_ipc() -> None:
    assert isinstance(get_client_transport_backend(None), TorchIpcBackend)


def test_the_daemon_picks_the_clients_first_choice_it_can_export(memfd_memory) -> None:
    chosen = choose_daemon_transport_backend(memfd_memory, ["rdma", "torch_ipc", "memfd"])
    assert isinstance(chosen, MemfdBackend)


@pytest.mark.parametrize("offered", [["torch_ipc"], ["vmm_fd", "torch_ipc"], ["rdma"]])
def test_no_common_transport_is_a_clear_error(memfd_memory, offered) -> None:
    with pytest.raises(RuntimeError) as info:
        choose_daemon_transport_backend(memfd_memory, offered)
    assert str(info.value) == (
        f"no common transport: the daemon serves 'memfd' memory, the client supports {offered}"
    )


def test_cpu_defaults() -> None:
    assert default_client_transports() == ["memfd", "torch_ipc"]
    assert default_daemon_transport(torch.device("cpu")) == "memfd"


def test_a_real_daemon_refuses_a_client_without_a_common_transport(memfd_daemon) -> None:
    with pytest.raises(DaemonError, match=r"no common transport: the daemon serves 'memfd'"):
        attach(memfd_daemon.socket, transports=["torch_ipc", "vmm_fd"])


def test_a_reply_without_transport_backend_is_read_as_torch_ipc(tmp_path) -> None:
    """An old daemon: no ``transport_backend`` and no byte count, torch_ipc fds after the reply."""
    tensors = {"w": torch.arange(10.0), "b": torch.ones(3, dtype=torch.int64)}
    served = serve_tensors("torch_ipc", tensors)
    save_file(tensors, tmp_path / "model.safetensors")
    config = cache_config(read_checkpoint(tmp_path), torch.device("cpu"))

    def old_daemon(request: FetchStateRequest, conn) -> None:
        reply = FetchStateReply(
            v=1,
            status="ok",
            pid=os.getpid(),
            config=config,
            fingerprint=fingerprint(config),
            layout=served.layout,
            handles=served.export.handles,
        )
        try:
            served.backend.send_fetch_state_response(conn, reply, served.export)
        except (BrokenPipeError, ConnectionResetError):
            pass  # a client that refuses the reply hangs up before the fds

    fake = FakeDaemon(str(tmp_path / "old.sock"), old_daemon)
    try:
        attached = attach(fake.socket_path, transports=["memfd", "torch_ipc"])
        assert attached.transport == "torch_ipc"
        assert attached.preloaded_weights_bytes == 0
        for name, tensor in tensors.items():
            assert torch.equal(attached.tensors[name], tensor)
        attached.close()
        # A client that did not offer torch_ipc must not accept the old daemon's memory.
        with pytest.raises(RuntimeError, match="did not offer"):
            attach(fake.socket_path, transports=["memfd"])
    finally:
        fake.close()
        served.memory.close()
