"""A daemon on one torch release serves an engine on another (real processes, CPU).

The daemon runs under the project's venv, this test (the engine side) under an
engine venv, each with its own torch, as a daemon image and an engine image
built by different teams. The ``CacheConfig`` carries no torch version: memfd
maps and the weights are the checkpoint's, bit for bit. torch_ipc, whose
handles are torch's own, refuses naming both releases.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.engines.conftest import daemon_python
from weightcache.checkpoint import cache_config, read_checkpoint
from weightcache.client import ConfigMismatch, attach


@pytest.fixture(scope="module")
def daemon_torch() -> str:
    out = subprocess.run(
        [daemon_python(), "-c", "import torch; print(torch.__version__.split('+')[0])"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return out.stdout.strip()


def test_the_two_sides_run_different_torch_releases(daemon_torch) -> None:
    assert daemon_torch != torch.__version__.split("+")[0]


def test_memfd_serves_an_engine_on_another_torch(memfd_daemon, minilm_dir: Path) -> None:
    expected = cache_config(read_checkpoint(minilm_dir), torch.device("cpu"))
    attached = attach(memfd_daemon.socket, expected, ["memfd"])
    try:
        assert attached.transport == "memfd" and attached.config == expected
        on_disk = load_file(Path(minilm_dir) / "model.safetensors")
        assert sorted(attached.tensors) == sorted(on_disk)
        assert [n for n, t in on_disk.items() if not torch.equal(attached.tensors[n], t)] == []
    finally:
        attached.close()


def test_torch_ipc_refuses_another_torch_naming_both(
    session_daemons, minilm_dir: Path, daemon_torch
) -> None:
    daemon = session_daemons(minilm_dir, "--transport", "torch_ipc")
    expected = cache_config(read_checkpoint(minilm_dir), torch.device("cpu"))
    with pytest.raises(ConfigMismatch) as caught:
        attach(daemon.socket, expected, ["torch_ipc"])
    assert caught.value.fields == ["torch_version"]
    engine_torch = torch.__version__.split("+")[0]
    assert f"daemon runs torch {daemon_torch}, this engine {engine_torch}" in str(caught.value)
    assert daemon.status().state == "ready"  # refused on the engine side; the daemon serves on
