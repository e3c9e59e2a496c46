"""The daemon process: lock, probes and metrics, the status CLI, load failures, SIGTERM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tests.unit.wc_harness import wait_until
from weightcache.client import attach, daemon_status, ping
from weightcache.daemon.cli import main

SIDECAR = str(Path(sys.executable).parent / "weightcache-sidecar")


# ----------------------------------------------------------------------------- one per device


def serve_in_thread(args: list[str]) -> int:
    """``weightcache-sidecar serve`` in this process, off the main thread (no signal handlers)."""
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(main(["serve", *args])))
    thread.start()
    thread.join(120)
    assert codes, "serve did not return"
    return codes[0]


def test_a_second_daemon_on_the_same_socket_refuses_to_start(memfd_daemon, capsys) -> None:
    args = ["--model", str(memfd_daemon.model_dir), "--socket", memfd_daemon.socket]
    assert serve_in_thread([*args, "--http-address", "none"]) == 1
    assert (
        f"another daemon (pid {memfd_daemon.pid}) already serves this device "
        f"(lock {memfd_daemon.socket}.lock is held)"
    ) in capsys.readouterr().err
    # The first daemon, its socket and its lock are untouched.
    assert ping(memfd_daemon.socket) == memfd_daemon.pid
    assert Path(memfd_daemon.socket + ".lock").read_text().strip() == str(memfd_daemon.pid)


# ----------------------------------------------------------------------------- HTTP


def test_probes(memfd_daemon) -> None:
    assert memfd_daemon.http("/healthz") == (200, "text/plain", b"ok\n")
    assert memfd_daemon.http("/readyz") == (200, "text/plain", b"ready\n")
    assert memfd_daemon.http("/nope")[0] == 404


def test_status_over_http_matches_status_over_the_socket(memfd_daemon) -> None:
    code, content_type, body = memfd_daemon.http("/status")
    assert (code, content_type) == (200, "application/json")
    over_http = json.loads(body)
    over_socket = daemon_status(memfd_daemon.socket)
    for key in ("state", "pid", "fingerprint", "preloaded_weights_bytes", "expected_bytes"):
        assert over_http[key] == getattr(over_socket, key)
    assert over_http["state"] == "ready" and over_http["pid"] == memfd_daemon.pid
    assert over_http["transport_backend"] == "memfd" and over_http["load_source"] == "disk"
    assert over_http["socket"] == memfd_daemon.socket and over_http["device"] == "cpu"


def test_metrics(memfd_daemon) -> None:
    def scrape() -> dict[str, float]:
        code, content_type, body = memfd_daemon.http("/metrics")
        assert code == 200 and content_type.startswith("text/plain")
        values = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    status = daemon_status(memfd_daemon.socket)
    before = scrape()
    labels = '{device="cpu",transport="memfd"}'
    assert before[f"weightcache_ready{labels}"] == 1.0
    assert before[f"weightcache_preloaded_weights_bytes{labels}"] == status.preloaded_weights_bytes
    assert before[f"weightcache_expected_weights_bytes{labels}"] == status.expected_bytes
    assert before[f"weightcache_load_seconds{labels}"] == pytest.approx(status.load_seconds)
    assert all(name.split("{")[0].startswith("weightcache_") for name in before)
    for _ in range(3):
        ping(memfd_daemon.socket)
    pings = 'weightcache_requests_total{op="ping"}'
    # The daemon counts a request just after sending its reply.
    after = wait_until(
        lambda: (m := scrape()).get(pings, 0) >= before.get(pings, 0) + 3 and m,
        "the three pings to be counted",
    )
    assert after[pings] == before.get(pings, 0) + 3


# ----------------------------------------------------------------------------- status CLI


def test_status_cli_prints_the_daemons_status_as_json(memfd_daemon) -> None:
    result = subprocess.run(
        [SIDECAR, "status", "--socket", memfd_daemon.socket],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["pid"] == memfd_daemon.pid
    assert status["state"] == "ready"
    assert status["fingerprint"] == daemon_status(memfd_daemon.socket).fingerprint


def test_status_cli_without_a_daemon_fails_naming_the_socket(tmp_path, capsys) -> None:
    missing = str(tmp_path / "none.sock")
    assert main(["status", "--socket", missing]) == 1
    err = capsys.readouterr().err
    assert err.startswith("weightcache-sidecar: ") and missing in err


# ----------------------------------------------------------------------------- serve arguments


def test_serve_refuses_a_socket_path_over_107_bytes(tmp_path, capsys) -> None:
    long_path = "/tmp/" + "x" * 120 + "/cpu.sock"
    assert main(["serve", "--model", str(tmp_path), "--socket", long_path]) == 1
    assert "over the 107-byte limit" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tp-size", "2", "--tp-rank", "2"], "--tp-rank must be in [0, --tp-size)"),
        (["--max-connections", "0"], "--max-connections must be at least 1"),
        (["--timeout", "0"], "expected a positive number"),
        (["--allow-uid", "-1"], "expected a non-negative integer"),
        (["--http-address", "localhost"], "expected HOST:PORT or 'none'"),
        (["--transport", "rdma"], "invalid choice: 'rdma'"),
    ],
)
def test_serve_rejects_bad_arguments(tmp_path, capsys, args, message) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--model", str(tmp_path), "--socket", str(tmp_path / "s"), *args])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


# ----------------------------------------------------------------------------- load failures


def test_a_checkpoint_that_cannot_load_is_reported_and_exits_1(tmp_path, caplog) -> None:
    header = b"{not json!!!!!!}"
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    sock = str(tmp_path / "d" / "cpu.sock")
    args = ["--model", str(tmp_path), "--socket", sock, "--http-address", "none"]
    assert serve_in_thread(args) == 1
    assert "load failed: " in caplog.text and "header is not JSON" in caplog.text
    assert not os.path.exists(sock)


# ----------------------------------------------------------------------------- SIGTERM


def test_sigterm_exits_cleanly_removes_the_socket_and_engines_keep_their_weights(
    daemons, minilm_dir, minilm_reference
) -> None:
    """(A successor taking over the socket is tested in faults/test_daemon_faults.py.)"""
    daemon = daemons(minilm_dir, "--transport", "memfd")
    attached = attach(daemon.socket)
    try:
        assert daemon.terminate() == 0
        assert not os.path.exists(daemon.socket)
        assert "Traceback" not in daemon.log()
        # memfd: the engine's mapping outlives the daemon.
        for name, tensor in minilm_reference.items():
            assert torch.equal(attached.tensors[name], tensor)
        assert attached.degraded
    finally:
        attached.close()
