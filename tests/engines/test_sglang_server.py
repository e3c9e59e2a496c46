"""SGLang's own server on CPU, weights from a real daemon, requests over HTTP.

Real processes throughout: a daemon (the project's venv and torch) holding
MiniLM over memfd, and SGLang's server (this venv's SGLang and torch) started
as a user would. Five server starts, each adding evidence the others lack:

1. no daemon: an unmodified ``python -m sglang.launch_server`` selecting
   weightcache through the extra config waits 10 s, says why at WARNING and
   loads from disk with SGLang's own ``DefaultModelLoader``: a cold load by
   the engine's own loader, so its embeddings are the reference;
2. the launcher (``weightcache-sglang``): SGLang's own layout from the
   daemon (``fetch_layout`` on the daemon's own counter, never its
   checkpoint layout), embeddings bit-equal to the reference, the log line
   saying every parameter is mapped and none in engine memory, and every
   weight-mutating API refused while the server serves on;
3. a restart through the plugin route (the launcher's server stopped first):
   maps the same layout again, one ``fetch_layout``;
4. and 5. this SGLang, untouched, beside a weightcache whose supported range
   leaves it out (``enginekit.outside_the_range``): started as usual it
   serves, embeddings bit-equal to the reference; the plugin route selecting
   weightcache fails at start-up naming the supported releases (and the
   launcher refuses before starting SGLang).

Embeddings (``/encode``) are compared bit for bit (JSON floats are exact).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from tests.engines.enginekit import (
    EngineServer,
    assert_refused_at_start,
    fetches,
    outside_the_range,
    require_engine,
)

require_engine("sglang")

from tests.unit.wc_harness import free_port  # noqa: E402

TEXTS = ["weights stay resident", "an engine restarts in milliseconds", "short"]
START_WITHIN_S = 600  # a loaded 2-core machine; a quiet one starts in about a minute
# The loader's line: every parameter the daemon's memory, none in engine memory.
LAYOUT_LINE = re.compile(
    r"weightcache: SGLang's own layout \(plan [0-9a-f]{12}\) over memfd from daemon pid \d+: "
    r"\d+ parameter\(s\) \(\d+ bytes\) mapped zero-copy, 0 \(0 bytes\) in engine memory"
)
READ_ONLY = "mapped read-only from the weightcache daemon"


def sglang_args(model: Path, port: int) -> list[str]:
    return ["--model-path", str(model), "--device", "cpu", "--dtype", "float32",
            "--is-embedding", "--port", str(port), "--skip-server-warmup",
            "--max-total-tokens", "2048",  # a small KV pool: allocated in seconds
            # Prefix caching would reuse an earlier request's KV for a repeated text: wrong
            # for a bidirectional encoder, and not the same floats as a full pass.
            "--disable-radix-cache"]  # fmt: skip


def start(
    argv: list[str], port: int, tmp: Path, name: str, env: dict[str, str] | None = None
) -> EngineServer:
    server = EngineServer(argv, port, tmp / f"{name}.log", dict(env or os.environ))
    return server.wait_healthy(START_WITHIN_S)


def plugin_route(model: Path, port: int, socket: str | Path) -> list[str]:
    """An unmodified ``python -m sglang.launch_server`` selecting weightcache by config."""
    extra = json.dumps({"weightcache": {"socket": str(socket)}})
    return [sys.executable, "-m", "sglang.launch_server", *sglang_args(model, port),
            "--model-loader-extra-config", extra]  # fmt: skip


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
def cold(minilm_dir, tmp) -> tuple[list, str, Path]:
    """(embeddings, log, the absent socket) of the no-daemon server: the reference."""
    absent = tmp / "no-daemon" / "cpu.sock"
    port = free_port()
    server = start(plugin_route(minilm_dir, port, absent), port, tmp, "no-daemon")
    try:
        return embeddings(server), server.log(), absent
    finally:
        server.stop()


@pytest.fixture(scope="module")
def launched(memfd_daemon, minilm_dir, tmp):
    """The launcher route: weightcache-sglang with SGLang's own arguments."""
    before = fetches(memfd_daemon), fetches(memfd_daemon, "fetch_layout")
    port = free_port()
    launcher = "weightcache.integrations.sglang.launch"
    argv = [sys.executable, "-m", launcher, *sglang_args(minilm_dir, port),
            "--weightcache-socket", memfd_daemon.socket]  # fmt: skip
    server = start(argv, port, tmp, "launcher")
    yield server, before
    server.stop()


def test_without_a_daemon_the_server_loads_from_disk_saying_why(cold) -> None:
    reference, log, absent = cold
    assert len(reference) == len(TEXTS) and len(reference[0]) == 384
    # (SGLang's log format shows no level; the adapter logs this at WARNING.)
    assert "weightcache: loading from disk instead of the daemon" in log
    assert str(absent) in log and "waited 10 s" in log


def test_the_launcher_serves_the_daemons_weights_bit_equal(launched, cold, memfd_daemon):
    server, (checkpoint, own) = launched
    assert embeddings(server) == cold[0]
    # SGLang's own layout, never the checkpoint's; the first start may have the daemon
    # build it (asked by hash, then with the plan, then until built).
    assert fetches(memfd_daemon) == checkpoint
    assert fetches(memfd_daemon, "fetch_layout") - own >= 1
    assert LAYOUT_LINE.search(server.log())  # the bytes line, at SGLang's default level


def update_payloads(model: Path) -> dict[str, dict]:
    """A real request body for every weight-mutating API: each would overwrite the word
    embeddings with zeros, or open the way to (a trainer's group, a refit session)."""
    import torch
    from sglang.srt.utils import MultiprocessingSerializer

    name, shape = "model.embeddings.word_embeddings.weight", [30522, 384]
    zeros = MultiprocessingSerializer.serialize([(name, torch.zeros(shape))], output_str=True)
    return {
        "/update_weights_from_disk": {"model_path": str(model)},
        "/update_weights_from_tensor": {"serialized_named_tensors": [zeros]},
        "/update_weights_from_distributed": {
            "names": [name], "dtypes": ["float32"], "shapes": [shape]},
        "/update_weights_from_ipc": {"zmq_handles": {}},
        "/init_weights_update_group": {
            "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
            "world_size": 2, "backend": "gloo"},
        "/begin_weight_update": {},
        "/release_memory_occupation": {"tags": ["weights"]},
        "/resume_memory_occupation": {},  # no tags: every tag, the weights included
        "/weights_checker": {"action": "reset_tensors"},  # random values into every weight
    }  # fmt: skip


# Every weight-mutating endpoint -> the API its refusal names.
MUTATIONS = {
    **{f"/{api}": api for api in (
        "update_weights_from_disk", "update_weights_from_tensor",
        "update_weights_from_distributed", "update_weights_from_ipc",
        "init_weights_update_group", "begin_weight_update",
        "release_memory_occupation", "resume_memory_occupation")},
    "/weights_checker": "check_weights action reset_tensors",
}  # fmt: skip


def test_every_weight_mutating_api_is_refused_and_the_server_serves_on(
    launched, cold, minilm_dir
) -> None:
    server, _ = launched
    answers = {path: server.post(path, body) for path, body in update_payloads(minilm_dir).items()}
    assert sorted(answers) == sorted(MUTATIONS)
    for path, (status, answer) in answers.items():
        # Updates answer as SGLang answers a failed update; memory release/resume as its
        # errors ({"error": {"message"}}). Each names the API and why.
        message = answer["message"] if "message" in answer else answer["error"]["message"]
        assert status == 400 and MUTATIONS[path] in message and READ_ONLY in message, (
            path, status, answer)  # fmt: skip
    assert server.proc.poll() is None
    assert embeddings(server) == cold[0]  # the shared weights untouched


def test_an_unmodified_launch_server_attaches_again_through_the_plugin(
    launched, memfd_daemon, minilm_dir, cold, tmp
) -> None:
    """A restart (the launcher server stopped first) through `python -m
    sglang.launch_server --model-loader-extra-config`: attaches to the same daemon again."""
    first, _ = launched
    first.stop()
    checkpoint, own = fetches(memfd_daemon), fetches(memfd_daemon, "fetch_layout")
    port = free_port()
    server = start(plugin_route(minilm_dir, port, memfd_daemon.socket), port, tmp, "plugin")
    try:
        assert embeddings(server) == cold[0]
        # The layout is held now: one attach, SGLang's single TP rank.
        assert fetches(memfd_daemon) == checkpoint
        assert fetches(memfd_daemon, "fetch_layout") == own + 1
        assert LAYOUT_LINE.search(server.log())
    finally:
        server.stop()


# The releases of a weightcache built one SGLang release ahead: the installed 0.5.23 is
# outside.
OTHER_RELEASES = ("0.5.24", "0.5.25")


def test_outside_the_supported_range_sglang_serves_by_default_and_refuses_weightcache(
    minilm_dir, cold, tmp
) -> None:
    """This venv's SGLang, untouched, beside a weightcache whose range leaves it out
    (enginekit.outside_the_range): started as usual it loads with its own loader and
    serves; selecting weightcache (the extra config, or the launcher) fails at start-up
    naming the supported releases."""
    import subprocess

    from weightcache.integrations.versions import installed_version

    env = outside_the_range("sglang", OTHER_RELEASES, tmp / "other-releases")
    refusal = (
        "weightcache.integrations.sglang supports SGLang 0.5.24.x and 0.5.25.x; "
        f"SGLang {installed_version('sglang')} is installed"
    )
    port = free_port()
    argv = [sys.executable, "-m", "sglang.launch_server", *sglang_args(minilm_dir, port)]
    server = start(argv, port, tmp, "outside-default", env)
    try:
        assert embeddings(server) == cold[0]  # SGLang's own loader, as cold
        log = server.log()
    finally:
        server.stop()
    assert f"the 'weightcache' loader config is unavailable: {refusal}" in log  # the WARNING
    assert "UnsupportedEngineVersion" not in log

    port = free_port()
    server = EngineServer(
        plugin_route(minilm_dir, port, cold[2]), port, tmp / "outside-plugin.log", env
    )
    assert_refused_at_start(server, START_WITHIN_S, refusal)

    launcher = "weightcache.integrations.sglang.launch"
    argv = [sys.executable, "-m", launcher, *sglang_args(minilm_dir, free_port()),
            "--weightcache-socket", str(cold[2])]  # fmt: skip
    refused = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and f"weightcache-sglang: {refusal}" in refused.stderr
