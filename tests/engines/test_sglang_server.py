"""SGLang's own server on CPU, weights from a real daemon, requests over HTTP.

Real processes throughout: a daemon (the project's venv and torch) holding
MiniLM over memfd, and SGLang's server (this venv's SGLang and torch) started
as a user would, through the launcher and through an unmodified
``python -m sglang.launch_server`` with the extra config. The reference is a
cold server (SGLang's own loader), started with this SGLang treated as an
unsupported release: weightcache installed beside it must not stop it.
Embeddings (``/encode``) must be bit-equal to the cold server's (JSON floats
are exact), the daemon's own counter must show each fetch, and every online
weight-update API must be refused by the server while it keeps serving.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.engines.enginekit import EngineServer, fetches, narrowed_support, require_engine

require_engine("sglang")

from tests.unit.wc_harness import free_port  # noqa: E402
from weightcache.integrations.sglang.loader import WEIGHT_UPDATES_REFUSED  # noqa: E402

TEXTS = ["weights stay resident", "an engine restarts in milliseconds", "short"]
START_WITHIN_S = 600  # a loaded 2-core machine; a quiet one starts in about a minute
MAPPED_LINE = "mapped zero-copy over memfd"


def sglang_args(model: Path, port: int) -> list[str]:
    return ["--model-path", str(model), "--device", "cpu", "--dtype", "float32",
            "--is-embedding", "--port", str(port), "--skip-server-warmup",
            "--max-total-tokens", "2048",  # a small KV pool: allocated in seconds
            # Prefix caching would reuse an earlier request's KV for a repeated text: wrong
            # for a bidirectional encoder, and not the same floats as a full pass.
            "--disable-radix-cache"]  # fmt: skip


def start(argv: list[str], port: int, tmp: Path, name: str, env: dict | None = None):
    server = EngineServer(argv, port, tmp / f"{name}.log", {**os.environ, **(env or {})})
    return server.wait_healthy(START_WITHIN_S)


def embeddings(server: EngineServer) -> list:
    """One request per text: a batch's composition (timing-dependent) changes the float
    rounding of the shorter texts, a single text's never does."""
    out = []
    for text in TEXTS:
        status, body = server.post("/encode", {"text": text})
        assert status == 200, body
        out.append(body["embedding"])
    return out


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sglang-server")


@pytest.fixture(scope="module")
def cold(minilm_dir, tmp) -> list:
    """A cold server's embeddings; this SGLang counted unsupported, weightcache installed."""
    port = free_port()
    argv = [sys.executable, "-m", "sglang.launch_server", *sglang_args(minilm_dir, port)]
    server = start(argv, port, tmp, "cold", narrowed_support(tmp, "sglang"))
    try:
        return embeddings(server)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def launched(memfd_daemon, minilm_dir, tmp):
    """The launcher route: weightcache-sglang with SGLang's own arguments."""
    before = fetches(memfd_daemon)
    port = free_port()
    launcher = "weightcache.integrations.sglang.launch"
    argv = [sys.executable, "-m", launcher, *sglang_args(minilm_dir, port),
            "--weightcache-socket", memfd_daemon.socket]  # fmt: skip
    server = start(argv, port, tmp, "launcher")
    yield server, before
    server.stop()


def test_an_unsupported_release_serves_with_its_own_loader(cold, tmp) -> None:
    log = (tmp / "cold.log").read_text(errors="replace")
    assert "unavailable" in log and "0.0.1.x" in log  # the one WARNING, naming the range
    assert len(cold) == len(TEXTS) and len(cold[0]) == 384


def test_the_launcher_serves_the_daemons_weights_bit_equal(launched, cold, memfd_daemon):
    server, before = launched
    assert embeddings(server) == cold
    assert fetches(memfd_daemon) == before + 1  # one fetch: SGLang's single TP rank
    assert MAPPED_LINE in server.log()  # the bytes line, at SGLang's default level


# The online weight-update APIs a request alone reaches. update_weights_from_tensor and
# _from_distributed reach the same SGLang check only inside a trainer's session (begin/end
# weight update, a process group with the trainer), which this test does not run.
MUTATIONS = {
    "/update_weights_from_disk": {"model_path": "{model}"},
    "/update_weights_from_ipc": {"zmq_handles": {}},
}


@pytest.mark.parametrize("path", sorted(MUTATIONS))
def test_weight_updates_are_refused_and_the_server_serves_on(
    path, launched, cold, minilm_dir
) -> None:
    server, _ = launched
    body = json.loads(json.dumps(MUTATIONS[path]).replace("{model}", str(minilm_dir)))
    status, answer = server.post(path, body)
    assert status == 400 and answer["success"] is False, answer
    assert WEIGHT_UPDATES_REFUSED in answer["message"]
    assert server.proc.poll() is None
    assert embeddings(server) == cold  # the shared weights untouched


def test_an_unmodified_launch_server_attaches_again_through_the_plugin(
    launched, memfd_daemon, minilm_dir, cold, tmp
) -> None:
    """A restart (the launcher server stopped first) through `python -m
    sglang.launch_server --model-loader-extra-config`: attaches to the same daemon again."""
    first, _ = launched
    first.stop()
    before = fetches(memfd_daemon)
    port = free_port()
    extra = json.dumps({"weightcache": {"socket": memfd_daemon.socket}})
    argv = [sys.executable, "-m", "sglang.launch_server", *sglang_args(minilm_dir, port),
            "--model-loader-extra-config", extra]  # fmt: skip
    server = start(argv, port, tmp, "plugin")
    try:
        assert embeddings(server) == cold
        assert fetches(memfd_daemon) == before + 1
        assert MAPPED_LINE in server.log()
    finally:
        server.stop()


def test_without_a_daemon_the_server_loads_from_disk_saying_why(minilm_dir, cold, tmp):
    absent = tmp / "no-daemon" / "cpu.sock"
    port = free_port()
    extra = json.dumps({"weightcache": {"socket": str(absent)}})
    argv = [sys.executable, "-m", "sglang.launch_server", *sglang_args(minilm_dir, port),
            "--model-loader-extra-config", extra]  # fmt: skip
    server = start(argv, port, tmp, "absent")
    try:
        assert embeddings(server) == cold
        log = server.log()
        assert "loading from disk instead of the daemon" in log
        assert str(absent) in log and "waited 10 s" in log
    finally:
        server.stop()
