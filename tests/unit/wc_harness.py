"""Harness for the unit suite: real ``weightcache-sidecar serve`` subprocesses on real sockets.

A :class:`DaemonProcess` is one daemon on a short socket path under /tmp (a
Unix socket path must fit in 107 bytes; pytest's tmp_path may not) with its
own HTTP port; conftest.py's fixtures stop every daemon they started. Nothing
here mocks the daemon: tests talk to it through the real client, the real
wire helpers, or raw bytes.
"""

from __future__ import annotations

import array
import gc
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from weightcache.client import daemon_status
from weightcache.protocol import DaemonStatus, encode
from weightcache.wire import FRAME_HEADER

# How long a daemon may take to load before a fixture gives up (a hang guard, not a check).
READY_WITHIN_SECONDS = 120.0

# The uids of the Kubernetes defaults: the daemon runs as 65533:65533 and engines under
# their own uid with the daemon's gid as primary group. OTHER_UID is neither.
DAEMON_UID = DAEMON_GID = 65533
ENGINE_UID = 1001
OTHER_UID = 1002

# A client that needs nothing but the standard library, so it starts in
# milliseconds and runs as any uid: argv = socket, mode, hex-encoded frame.
#   exchange  send the frame, print the first reply frame's body as hex (or "closed")
#   hold:N    stop at handshake step N, print "ready", then wait to be killed:
#             0 connected  1 half the frame sent  2 frame sent  3 one reply byte read
#             4 whole reply frame read  5 the fd frame received too (fds held)
PEER_SCRIPT = r"""
import array, socket, struct, sys, time
path, mode, frame = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(path)

def read_exact(n):
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data

def read_frame():
    header = read_exact(4)
    return None if header is None else read_exact(struct.unpack(">I", header)[0])

if mode == "exchange":
    try:
        s.sendall(frame)
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused before reading: the reason is still in our receive queue
    body = read_frame()
    print("closed" if body is None else body.hex(), flush=True)
    sys.exit(0)
step = int(mode.split(":")[1])
if step >= 1:
    s.sendall(frame[: len(frame) // 2])
if step >= 2:
    s.sendall(frame[len(frame) // 2 :])
if step == 3:
    s.recv(1)
if step >= 4:
    read_frame()
if step >= 5:
    size = socket.CMSG_SPACE(253 * 4)
    kept = s.recvmsg(4, size)
print("ready", flush=True)
time.sleep(3600)
"""


def frame(message: msgspec.Struct) -> bytes:
    """A whole wire frame (header + MessagePack body) for ``message``."""
    body = encode(message)
    return FRAME_HEADER.pack(len(body)) + body


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Exchange:
    """What a raw connection got back: whole reply frames, and whether the daemon closed it."""

    replies: list[bytes]
    trailing: bytes
    closed: bool


def split_frames(data: bytes) -> tuple[list[bytes], bytes]:
    frames = []
    while len(data) >= FRAME_HEADER.size:
        (length,) = FRAME_HEADER.unpack(data[: FRAME_HEADER.size])
        if len(data) < FRAME_HEADER.size + length:
            break
        frames.append(data[FRAME_HEADER.size : FRAME_HEADER.size + length])
        data = data[FRAME_HEADER.size + length :]
    return frames, data


def exchange(
    socket_path: str,
    data: bytes,
    fds: tuple[int, ...] = (),
    *,
    half_close: bool = True,
    timeout: float = 30.0,
) -> Exchange:
    """Send raw bytes (fds on the first byte), then read until the daemon closes.

    ``half_close`` shuts our write side after sending, so a daemon waiting for
    the rest of a truncated frame sees end-of-file at once.
    """
    received = bytearray()
    closed = False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(socket_path)
        try:
            if fds:
                ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                s.sendmsg([data[:1]], ancillary)
                data = data[1:]
            s.sendall(data)
            if half_close:
                s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon closed early; what it said is still in our queue
        while True:
            try:
                chunk = s.recv(1 << 16)
            except ConnectionResetError:
                closed = True
                break
            if not chunk:
                closed = True
                break
            received += chunk
    replies, trailing = split_frames(bytes(received))
    return Exchange(replies, trailing, closed)


def read_chars(pid: int) -> int:
    """Bytes the process has read through read-like calls (``rchar`` of /proc/PID/io): files
    and sockets; memory handed over as fds (a re-adopted or seeded memfd) is not among them."""
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise AssertionError(f"no rchar in /proc/{pid}/io")


def proc_status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def open_fd_count(pid: int | str = "self") -> int:
    if pid == "self":
        gc.collect()  # fds held by unreachable objects (mmaps, sockets) close now, not later
    return len(os.listdir(f"/proc/{pid}/fd"))


def print_counts(title: str, counts: dict[str, int]) -> None:
    """The counts a fault module ran (shown with ``pytest -s``; docs/reliability.md cites them)."""
    print(f"\n{title}:")
    for kind, n in sorted(counts.items()):
        print(f"  {kind}: {n}")
    print(f"  total: {sum(counts.values())}")


def wait_until(predicate, what: str, within: float = 60.0, interval: float = 0.05):
    """Poll ``predicate`` until it returns a truthy value (a hang guard, not a timing check)."""
    deadline = time.monotonic() + within
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(interval)


@dataclass
class DaemonProcess:
    """One ``weightcache-sidecar serve`` subprocess and the means to probe it."""

    model_dir: Path
    workdir: Path
    extra_args: tuple[str, ...] = ()
    socket_name: str = "d/cpu.sock"
    http_port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    starts: int = 0
    # Run as this uid/gid (no supplementary groups); the test makes the paths it needs reachable.
    user: int | None = None
    group: int | None = None
    # RLIMIT_NPROC: tasks (threads included) of the daemon's uid past which it cannot start one.
    nproc_limit: int | None = None

    @property
    def socket(self) -> str:
        return str(self.workdir / self.socket_name)

    @property
    def log_path(self) -> Path:
        return self.workdir / f"daemon-{self.starts}.log"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def command(self) -> list[str]:
        return [
            python_for(self.user),
            "-m",
            "weightcache.daemon.cli",
            "serve",
            "--model",
            str(self.model_dir),
            "--socket",
            self.socket,
            "--http-address",
            f"127.0.0.1:{self.http_port}",
            *self.extra_args,
        ]

    def start(self, wait: bool = True) -> DaemonProcess:
        self.starts += 1
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                user=self.user,
                group=self.group,
                extra_groups=[] if self.group is not None else None,
                env=self.environment(),
                preexec_fn=None if self.nproc_limit is None else self._limit_tasks,
            )
        if wait:
            self.wait_ready()
        return self

    def environment(self) -> dict[str, str]:
        return package_env()

    def _limit_tasks(self) -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NPROC, (self.nproc_limit, self.nproc_limit))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> DaemonStatus:
        def ready() -> DaemonStatus | None:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"daemon exited with {self.proc.returncode} before ready:\n{self.log()}"
                )
            try:
                status = daemon_status(self.socket, timeout=5.0)
            except (OSError, RuntimeError):
                return None
            if status.pid != self.pid:
                return None  # a predecessor's stale socket
            if status.state == "error":
                raise AssertionError(f"daemon failed to load: {status.error}\n{self.log()}")
            return status if status.state == "ready" else None

        return wait_until(ready, f"daemon on {self.socket} to be ready", READY_WITHIN_SECONDS)

    def status(self) -> DaemonStatus:
        return daemon_status(self.socket)

    def http(self, path: str) -> tuple[int, str, bytes]:
        """(status code, content type, body) of a GET on the daemon's HTTP side."""
        url = f"http://127.0.0.1:{self.http_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return response.status, response.headers["Content-Type"], response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers["Content-Type"], exc.read()

    def metric(self, name: str) -> float:
        """The value of an unlabelled metric on /metrics."""
        _, _, body = self.http("/metrics")
        for line in body.decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def wait_idle(self) -> None:
        """Until the daemon has closed every client connection it was serving."""
        wait_until(
            lambda: self.metric("weightcache_active_connections") == 0,
            "the daemon to finish with every connection",
        )

    def fd_count(self) -> int:
        """Open fds once idle and settled: a probe's HTTP connection closes just after its reply."""
        self.wait_idle()
        counts = [open_fd_count(self.pid)]

        def settled() -> bool:
            time.sleep(0.02)
            counts.append(open_fd_count(self.pid))
            return counts[-1] == counts[-2] == counts[-3] if len(counts) >= 3 else False

        wait_until(settled, "the daemon's fd count to settle", interval=0)
        return counts[-1]

    def rss_kib(self) -> int:
        return proc_status_kib(self.pid, "VmRSS")

    def peak_rss_kib(self) -> int:
        return proc_status_kib(self.pid, "VmHWM")

    def terminate(self, within: float = 60.0) -> int:
        """SIGTERM and wait; the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(within)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


_PYTHON_FOR: dict[int, str] = {}


def package_env() -> dict[str, str]:
    """Our environment, with PYTHONPATH naming every non-stdlib entry of our ``sys.path``:
    another interpreter of the same Python version then imports the same packages."""
    # An editable install reaches our packages through a .pth hook, which a
    # PYTHONPATH entry does not run: name their source roots as well.
    import weightcache
    import weightcache_operator

    roots = [os.path.dirname(os.path.dirname(m.__file__ or ""))
             for m in (weightcache, weightcache_operator)]
    paths = [p for p in [*roots, *sys.path]
             if p and os.path.isdir(p) and not p.startswith(sys.base_prefix)
             and not _inside_site_packages(p)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


def _inside_site_packages(path: str) -> bool:
    """An entry a package added below site-packages at run time (SGLang's cutlass DSL adds
    its own `base_dsl`, which holds a `typing.py`): on PYTHONPATH it would shadow the stdlib."""
    parts = os.path.normpath(path).split(os.sep)
    return any(part in ("site-packages", "dist-packages") for part in parts[:-1])


def python_for(uid: int | None) -> str:
    """An interpreter ``uid`` can run that imports this repo's packages (with package_env()).

    Ours may live under a directory other uids cannot enter (a pyenv build in
    /root): then the system's, if it is the same Python version.
    """
    if uid is None or uid == os.getuid():
        return sys.executable
    if uid not in _PYTHON_FOR:
        version = tuple(sys.version_info[:2])
        probe = f"import sys, torch, weightcache.client; assert sys.version_info[:2] == {version}"
        candidates = [os.path.realpath(sys.executable), "/usr/bin/python3"]
        for candidate in candidates:
            try:
                result = subprocess.run(
                    [candidate, "-c", probe], user=uid, env=package_env(), capture_output=True
                )
            except PermissionError:
                continue
            if result.returncode == 0:
                _PYTHON_FOR[uid] = candidate
                break
        else:
            raise AssertionError(f"no Python among {candidates} imports weightcache as uid {uid}")
    return _PYTHON_FOR[uid]


def cross_uid_workdir(workdir: Path, socket_dir: str = "d") -> Path:
    """Lay out ``workdir`` as a node does for a daemon of DAEMON_UID: others may traverse
    it, and the socket directory already belongs to the daemon (the privileged set-up
    step's one job). Returns the socket directory."""
    os.chmod(workdir, 0o755)
    directory = workdir / socket_dir
    directory.mkdir()
    os.chown(directory, DAEMON_UID, DAEMON_GID)
    return directory


def readable_model_copy(source: Path, workdir: Path) -> Path:
    """A copy of a checkpoint every uid may read (the test may damage it)."""
    model = workdir / "model"
    model.mkdir(mode=0o755)
    for path in source.glob("*.safetensors"):
        shutil.copy(path, model / path.name)
        os.chmod(model / path.name, 0o644)
    return model


class Engines:
    """Engine processes (``python -c script socket``), optionally as another uid/gid.

    A script prints one line once it is attached (``check`` vets it; the line
    is kept as ``proc.line``), then holds on until its stdin closes.
    """

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(
        self,
        socket_path: str,
        script: str,
        *,
        user: int | None = None,
        group: int | None = None,
        env: dict[str, str] | None = None,
        check=lambda line: len(line) == 64,
    ) -> subprocess.Popen:
        proc = subprocess.Popen(
            [python_for(user), "-c", script, socket_path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            user=user,
            group=group,
            extra_groups=[] if group is not None else None,
            env={**package_env(), **(env or {})},
        )
        self.procs.append(proc)
        proc.line = proc.stdout.readline().strip()
        if not check(proc.line):
            proc.kill()
            raise AssertionError(f"engine failed: {proc.line!r} {proc.stderr.read()}")
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                stream.close()


class DaemonFactory:
    """Starts daemons in short temporary directories and stops all of them at the end."""

    def __init__(self) -> None:
        self._daemons: list[DaemonProcess] = []
        self._dirs: list[str] = []

    def workdir(self) -> Path:
        path = tempfile.mkdtemp(prefix="wc-", dir="/tmp")
        self._dirs.append(path)
        return Path(path)

    def __call__(
        self,
        model_dir: Path,
        *extra_args: str,
        wait: bool = True,
        workdir: Path | None = None,
        **fields,
    ) -> DaemonProcess:
        """``fields``: DaemonProcess's own (socket_name, user, group, nproc_limit)."""
        daemon = DaemonProcess(
            Path(model_dir), workdir or self.workdir(), tuple(extra_args), **fields
        )
        self._daemons.append(daemon)
        return daemon.start(wait=wait)

    def adopt(self, daemon: DaemonProcess) -> DaemonProcess:
        self._daemons.append(daemon)
        return daemon

    def close(self) -> None:
        running = [d for d in self._daemons if d.proc is not None and d.proc.poll() is None]
        for daemon in running:  # all at once: each takes a moment to drain and exit
            daemon.proc.send_signal(signal.SIGTERM)
        for daemon in running:
            try:
                daemon.proc.wait(20)
            except subprocess.TimeoutExpired:
                daemon.kill()
        for path in self._dirs:
            shutil.rmtree(path, ignore_errors=True)


class Peers:
    """Stdlib-only client processes (see PEER_SCRIPT); all killed at teardown."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen] = []
        self._python_for: dict[int, str] = {}

    def python_for(self, uid: int) -> str:
        """An interpreter ``uid`` can execute: ours may sit under a directory it cannot enter."""
        if uid not in self._python_for:
            candidates = [os.path.realpath(sys.executable), "/usr/bin/python3"]
            for candidate in candidates:
                try:
                    probe = subprocess.run(
                        [candidate, "-I", "-S", "-c", "pass"], user=uid, capture_output=True
                    )
                except PermissionError:
                    continue
                if probe.returncode == 0:
                    self._python_for[uid] = candidate
                    break
            else:
                raise AssertionError(f"no Python interpreter among {candidates} runs as uid {uid}")
        return self._python_for[uid]

    def argv(self, socket_path: str, mode: str, data: bytes, uid: int) -> list[str]:
        return [self.python_for(uid), "-I", "-S", "-c", PEER_SCRIPT, socket_path, mode, data.hex()]

    def run(
        self, socket_path: str, data: bytes, user: int | None = None, group: int | None = None
    ) -> subprocess.CompletedProcess:
        """One request as (optionally) another uid/gid; stdout is the reply body in hex."""
        uid = os.getuid() if user is None else user
        return subprocess.run(
            self.argv(socket_path, "exchange", data, uid),
            user=user,
            group=group,
            extra_groups=[] if group is not None else None,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def hold(self, socket_path: str, step: int, data: bytes) -> subprocess.Popen:
        """A client stopped at handshake ``step``; returns once it got there."""
        proc = subprocess.Popen(
            self.argv(socket_path, f"hold:{step}", data, os.getuid()),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._procs.append(proc)
        line = proc.stdout.readline()
        if line.strip() != "ready":
            proc.kill()
            raise AssertionError(f"peer at step {step} failed: {line!r} {proc.stderr.read()}")
        return proc

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()


class FakeDaemon:
    """A stand-in daemon on a real Unix socket, for replies a real daemon never sends.

    ``handler(request, conn)`` gets each decoded request and writes the reply
    with the real wire helpers (and real transport backends), so the client
    under test sees exactly the bytes and fds a daemon would produce.
    """

    def __init__(self, socket_path: str, handler) -> None:
        self.socket_path = socket_path
        self._handler = handler
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(socket_path)
        self._listener.listen(16)
        self._listener.settimeout(0.1)
        self._stop = threading.Event()
        self.errors: list[BaseException] = []
        # Connections fully handled and closed (its fds share this process with the client's).
        self.handled = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        from weightcache.protocol import decode_request
        from weightcache.wire import recv_frame

        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(30)
            with conn:
                try:
                    body, _ = recv_frame(conn)
                    self._handler(decode_request(body), conn)
                except Exception as exc:  # reported by close(), never swallowed
                    self.errors.append(exc)
            self.handled += 1

    def wait_handled(self, count: int) -> None:
        wait_until(lambda: self.handled >= count, f"the fake daemon to handle {count} requests")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._listener.close()
        if self.errors:
            raise self.errors[0]


@dataclass
class Served:
    """Daemon-side memory holding some tensors, loaded and ready to export."""

    backend: object
    layout: object
    memory: object
    export: object


def serve_tensors(transport: str, tensors: dict) -> Served:
    """What a daemon does after reading a checkpoint, for tensors made in the test."""
    import torch

    from weightcache.layout import TensorSpec, plan_layout, tensor_specs
    from weightcache.transport import get_daemon_transport_backend

    backend = get_daemon_transport_backend(transport)
    specs = [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    layout = plan_layout(specs)
    memory = backend.allocate(layout.allocation_sizes, torch.device("cpu"))
    for spec, allocation, offset in tensor_specs(layout):
        if spec.nbytes:
            data = tensors[spec.name].contiguous().reshape(-1).view(torch.uint8)
            memory.buffers[allocation][offset : offset + spec.nbytes] = data
    memory.finish_load()
    return Served(backend, layout, memory, backend.prepare_export(memory))


def transfer(served: Served, client_backend) -> list:
    """One fetch_state reply from ``served`` to ``client_backend`` over a real socket pair."""
    from weightcache.protocol import FetchStateReply, decode_reply
    from weightcache.wire import recv_frame

    daemon_end, engine_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with daemon_end, engine_end:
        reply = FetchStateReply(
            v=1,
            status="ok",
            transport_backend=served.backend.name,
            layout=served.layout,
            handles=served.export.handles,
        )
        served.backend.send_fetch_state_response(daemon_end, reply, served.export)
        body, _ = recv_frame(engine_end)
        return client_backend.recv_fetch_state_response(engine_end, decode_reply(body))
