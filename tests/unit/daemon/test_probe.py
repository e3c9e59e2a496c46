"""`weightcache-sidecar probe`: the kubelet's liveness and readiness questions, asked over
the daemon's peer-checked Unix socket by the real command, against real daemon processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

from tests.unit.wc_harness import (
    DAEMON_GID,
    DAEMON_UID,
    cross_uid_workdir,
    package_env,
    python_for,
    readable_model_copy,
    wait_until,
)

SIDECAR = [sys.executable, "-m", "weightcache.daemon.cli"]


def probe(*args: str, user: int | None = None) -> subprocess.CompletedProcess:
    python = python_for(user)
    return subprocess.run(
        [python, "-m", "weightcache.daemon.cli", "probe", *args],
        capture_output=True, text=True, timeout=60, user=user,
        group=None if user is None else DAEMON_GID, env=package_env(),
    )


def test_a_ready_daemon_is_live_and_ready(memfd_daemon) -> None:
    ready = probe("ready", "--socket", memfd_daemon.socket)
    assert (ready.returncode, ready.stdout) == (0, "ready\n"), ready.stderr
    live = probe("live", "--socket", memfd_daemon.socket)
    assert (live.returncode, live.stdout) == (0, "ok\n"), live.stderr


def test_the_socket_path_comes_from_the_file_the_daemon_wrote(daemons, minilm_dir,
                                                              tmp_path: Path) -> None:
    """In a pod the socket's name holds the GPU's UUID, which only the daemon resolves."""
    path_file = tmp_path / "daemon-0.socket"
    daemon = daemons(minilm_dir, "--transport", "memfd", "--socket-path-file", str(path_file))
    assert path_file.read_text() == daemon.socket + "\n"
    ready = probe("ready", "--socket-path-file", str(path_file))
    assert ready.returncode == 0, ready.stderr
    status = subprocess.run([*SIDECAR, "status", "--socket-path-file", str(path_file)],
                            capture_output=True, text=True, timeout=120)
    assert status.returncode == 0 and '"state": "ready"' in status.stdout, status.stderr


def test_a_loading_daemon_is_live_but_not_ready_until_it_stalls(daemons, tmp_path) -> None:
    # The checkpoint's index is a FIFO nobody writes: the load blocks in the kernel.
    model = tmp_path / "model"
    model.mkdir()
    os.mkfifo(model / "model.safetensors.index.json")
    daemon = daemons(model, "--transport", "memfd", "--stall-seconds", "5", wait=False)
    wait_until(lambda: os.path.exists(daemon.socket), "the daemon to listen")
    ready = probe("ready", "--socket", daemon.socket)
    assert (ready.returncode, ready.stderr) == (1, "not ready\n")
    stuck = wait_until(lambda: (r := probe("live", "--socket", daemon.socket)).returncode and r,
                       "liveness to fail once the load stalls")
    assert stuck.stderr.startswith("stuck: no progress for "), stuck.stderr
    daemon.kill()


def test_no_daemon_is_neither_live_nor_ready(tmp_path: Path) -> None:
    missing = probe("live", "--socket", str(tmp_path / "cpu.sock"))
    assert missing.returncode == 1 and "No such file" in missing.stderr
    no_file = probe("ready", "--socket-path-file", str(tmp_path / "none"))
    assert no_file.returncode == 1 and "not ready" in no_file.stderr
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"\xff\xfe not a path")
    bad = probe("live", "--socket-path-file", str(garbage))
    assert bad.returncode == 1 and f"not live: {garbage}" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_a_listener_of_another_uid_is_not_believed(daemons) -> None:
    """Whoever else binds the socket path cannot answer the daemon's probes."""
    workdir = daemons.workdir()
    workdir.chmod(0o755)
    path = str(workdir / "cpu.sock")
    impostor = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    impostor.bind(path)
    os.chmod(path, 0o666)
    impostor.listen(8)
    accepted = []
    thread = threading.Thread(target=lambda: accepted.append(impostor.accept()), daemon=True)
    thread.start()
    try:
        refused = probe("ready", "--socket", path, user=DAEMON_UID)
    finally:
        impostor.close()
    assert refused.returncode == 1
    assert f"is served by uid {os.getuid()}, not {DAEMON_UID}" in refused.stderr


def test_probes_are_answered_while_engines_hold_every_connection(daemons, minilm_dir,
                                                                 peers) -> None:
    """An engine group filling --max-connections must not fail the daemon's own probes."""
    workdir = daemons.workdir()
    cross_uid_workdir(workdir)
    model = readable_model_copy(minilm_dir, workdir)
    daemon = daemons(model, "--transport", "memfd", "--allow-uid", "0",
                     "--max-connections", "1", "--timeout", "60",
                     workdir=workdir, user=DAEMON_UID, group=DAEMON_GID)
    peers.hold(daemon.socket, 0, b"")  # root, an engine: takes the one slot and idles
    wait_until(lambda: daemon.metric("weightcache_active_connections") == 1,
               "the engine to hold the only slot")
    busy = peers.run(daemon.socket, b"\x00\x00\x00\x01\x80")
    assert "busy" in bytes.fromhex(busy.stdout.strip()).decode(errors="replace")
    ready = probe("ready", "--socket", daemon.socket, user=DAEMON_UID)
    assert (ready.returncode, ready.stdout) == (0, "ready\n"), ready.stderr


def test_the_probe_command_imports_no_torch() -> None:
    """The kubelet runs it every few seconds; importing torch takes seconds (6 s in the
    sidecar image on the CI machine, past the probes' timeouts: the kubelet restarted a
    daemon that was serving, over and over). Nothing the entry point imports at module
    level may pull torch in."""
    check = subprocess.run(
        [sys.executable, "-c", "import sys, weightcache.daemon.cli, weightcache.daemon.probe;"
         " print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"],
        capture_output=True, text=True, timeout=120, env=package_env())
    assert check.returncode == 0, check.stderr
    assert check.stdout.strip() == "[]"
