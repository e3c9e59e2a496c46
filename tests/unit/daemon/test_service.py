"""The daemon process: lock, probes and metrics, the status CLI, load failures, SIGTERM."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.unit.wc_harness import frame, free_port, wait_until
from weightcache.client import attach, daemon_status, ping
from weightcache.daemon.cli import build_parser, main
from weightcache.daemon.lock import lock_path
from weightcache.daemon.service import Daemon, DaemonOptions
from weightcache.protocol import FetchStateRequest

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
        f"(lock {lock_path(memfd_daemon.socket)} is held)"
    ) in capsys.readouterr().err
    # The first daemon, its socket and its lock are untouched.
    assert ping(memfd_daemon.socket) == memfd_daemon.pid
    assert Path(lock_path(memfd_daemon.socket)).read_text().strip() == str(memfd_daemon.pid)


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
    assert over_http["device"] == "cpu"
    # Whoever reaches the pod's port learns no paths and no error text: those stay on
    # the peer-checked socket.
    assert over_socket.socket == memfd_daemon.socket and over_socket.load_reason
    for private in ("socket", "error", "load_reason"):
        assert private not in over_http


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


def test_a_manifest_that_cannot_be_written_is_a_warning_and_serving_goes_on(
    daemons, minilm_dir, minilm_reference
) -> None:
    """The manifest's place taken (here by a directory; on the real node, a full
    filesystem): the daemon serves, and its status says what its successor will miss."""
    workdir = daemons.workdir()
    (workdir / "d" / ".daemon" / "cpu.sock.manifest" / "in-the-way").mkdir(parents=True)
    os.chmod(workdir / "d" / ".daemon", 0o700)
    daemon = daemons(minilm_dir, "--transport", "memfd", workdir=workdir)
    status = daemon.status()
    assert status.state == "ready" and status.load_source == "disk"
    assert status.warning is not None
    assert status.warning.startswith(
        f"manifest {workdir}/d/.daemon/cpu.sock.manifest not written (a restart will reload "
        "from disk): ")
    assert status.warning in daemon.log()
    # Not on the network-facing HTTP status (free text and paths).
    assert "warning" not in json.loads(daemon.http("/status")[2])
    attached = attach(daemon.socket, transports=["memfd"])
    try:
        for name, tensor in minilm_reference.items():
            assert torch.equal(attached.tensors[name], tensor), name
    finally:
        attached.close()


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
        assert attached.degraded()
    finally:
        attached.close()


# ----------------------------------------------------------------------------- probes


def test_http_listens_on_loopback_unless_told_otherwise() -> None:
    args = ["serve", "--model", "m", "--socket", "/tmp/s"]
    assert build_parser().parse_args(args).http_address == ("127.0.0.1", 8470)
    assert build_parser().parse_args(args).metrics_address is None
    # What the operator renders: /metrics alone on the pod's network, nothing else.
    pod = build_parser().parse_args([*args, "--http-address", "none",
                                     "--metrics-address", "0.0.0.0:8470"])
    assert (pod.http_address, pod.metrics_address) == (None, ("0.0.0.0", 8470))


def test_a_load_stuck_on_io_fails_liveness(daemons, tmp_path) -> None:
    # The checkpoint's index is a FIFO nobody writes: opening it blocks in the kernel, as
    # a read from a dead NFS server does. The daemon must say so, so kubelet restarts it.
    model = tmp_path / "model"
    model.mkdir()
    os.mkfifo(model / "model.safetensors.index.json")
    daemon = daemons(model, "--transport", "memfd", "--stall-seconds", "1", wait=False)
    wait_until(lambda: http_get(daemon.http_port, "/healthz")[0] == 503, "/healthz to fail")
    code, _, body = daemon.http("/healthz")
    assert code == 503
    assert body.startswith(b"stuck: no progress for ") and b"while loading from disk" in body
    assert daemon.http("/readyz") == (503, "text/plain", b"not ready\n")
    assert daemon_status(daemon.socket).state == "loading"
    daemon.kill()


def test_readiness_fails_while_the_daemon_drains(daemons, many_tensor_checkpoint, peers) -> None:
    directory, _ = many_tensor_checkpoint
    daemon = daemons(directory, "--transport", "memfd")
    request = frame(FetchStateRequest(v=1, config=None, transports=["memfd"]))
    # Sent its request, reads nothing: the daemon is stuck sending a reply over 1 MB.
    held = peers.hold(daemon.socket, 2, request)
    # Its request sent is not yet its request taken: a stop before that closes it at once.
    wait_until(lambda: daemon.metric("weightcache_active_connections") == 1,
               "the daemon to be serving the held client")
    daemon.proc.send_signal(signal.SIGTERM)
    wait_until(
        lambda: daemon.http("/readyz") == (503, "text/plain", b"not accepting connections\n"),
        "/readyz to report the stopped accept loop",
    )
    held.kill()
    assert daemon.proc.wait(60) == 0


def test_a_dead_accept_loop_fails_readiness_and_liveness(minilm_dir) -> None:
    """In process: nothing outside the daemon can break its listener; a bug (an fd closed
    twice, reused) could. The accept loop must stop and say so, not spin as if transient."""
    run_dir = Path(tempfile.mkdtemp(prefix="wc-", dir="/tmp"))
    port = free_port()
    options = DaemonOptions(
        model_dir=minilm_dir,
        device=torch.device("cpu"),
        gpu="cpu",
        socket_path=str(run_dir / "d" / "cpu.sock"),
        transport="memfd",
        http_address=("127.0.0.1", port),
    )
    daemon = Daemon(options)
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(daemon.run()))
    thread.start()
    try:
        wait_until(lambda: http_get(port, "/readyz")[0] == 200, "the daemon to be ready")
        devnull = os.open("/dev/null", os.O_RDONLY)
        os.dup2(devnull, daemon._server._listener.fileno())  # no longer a socket
        os.close(devnull)
        wait_until(lambda: http_get(port, "/readyz")[0] == 503, "/readyz to fail")
        assert http_get(port, "/readyz") == (503, b"not accepting connections\n")
        assert http_get(port, "/healthz") == (503, b"socket server stopped accepting\n")
    finally:
        daemon.request_stop()
        thread.join(60)
        shutil.rmtree(run_dir, ignore_errors=True)
    assert codes == [0]


def http_get(port: int, path: str) -> tuple[int | None, bytes]:
    """(status, body); (None, b"") while nothing listens yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except urllib.error.URLError:
        return None, b""


def test_a_symlink_planted_for_the_private_dir_stops_the_daemon(daemons, minilm_dir) -> None:
    # Whoever could write the socket directory points .daemon elsewhere, hoping the daemon
    # writes its manifest and key (or truncates a file through its lock) there.
    workdir = daemons.workdir()
    (workdir / "d").mkdir(mode=0o750)
    elsewhere = workdir / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    (workdir / "d" / ".daemon").symlink_to(elsewhere)
    daemon = daemons(minilm_dir, "--transport", "memfd", workdir=workdir, wait=False)
    assert daemon.proc.wait(60) == 1
    assert ".daemon is a symlink or not a directory; refusing to follow it" in daemon.log()
    assert list(elsewhere.iterdir()) == []
