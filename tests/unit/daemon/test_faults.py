"""The OOM fault trigger: the kernel kills a daemon that pushes past its cgroup's limit.

Real daemon processes in memory cgroups this test makes (root, like the real
node), a trigger file created as root, and, for the attack, an engine-like
process under another uid in the daemon's group.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.wc_harness import (
    DAEMON_GID,
    DAEMON_UID,
    ENGINE_UID,
    cross_uid_workdir,
    package_env,
    python_for,
    readable_model_copy,
    wait_until,
)
from weightcache.client import attach, daemon_status, ping
from weightcache.daemon.faults import OOM_TRIGGER_SUFFIX, memory_limit
from weightcache.daemon.statedir import state_dir

V1_MEMORY = Path("/sys/fs/cgroup/memory")
V2_ROOT = Path("/sys/fs/cgroup")


@contextlib.contextmanager
def memory_cgroup(limit: int | None) -> Iterator[Path]:
    """A fresh memory cgroup (v1 or v2, whichever holds the memory controller), with
    `limit` bytes or none; removed afterwards."""
    if (V1_MEMORY / "memory.limit_in_bytes").exists():
        group, knob = V1_MEMORY / f"wc-faults-{uuid.uuid4().hex[:8]}", "memory.limit_in_bytes"
    elif "memory" in (V2_ROOT / "cgroup.subtree_control").read_text().split():
        group, knob = V2_ROOT / f"wc-faults-{uuid.uuid4().hex[:8]}", "memory.max"
    else:
        raise AssertionError("no cgroup hierarchy with the memory controller on this machine")
    group.mkdir()
    try:
        if limit is not None:
            (group / knob).write_text(str(limit))
        yield group
    finally:
        wait_until(lambda: not (group / "cgroup.procs").read_text().strip(),
                   "the cgroup's processes gone", within=30)
        group.rmdir()


def serve_in(group: Path, workdir: Path, model: Path, *, as_daemon_uid: bool = False
             ) -> subprocess.Popen:
    """`weightcache-sidecar serve` (memfd) started inside `group`."""
    log = open(workdir / "daemon.log", "wb")
    user = DAEMON_UID if as_daemon_uid else None
    if user is not None:  # preexec_fn runs after the switch to `user`
        os.chown(group / "cgroup.procs", user, -1)
    args = ["--allow-uid", "0", "--allow-gid", str(DAEMON_GID)] if as_daemon_uid else []
    proc = subprocess.Popen(
        [python_for(user), "-m", "weightcache.daemon.cli", "serve", "--model", str(model),
         "--socket", str(workdir / "d" / "cpu.sock"), "--transport", "memfd",
         "--http-address", "none", *args],
        stdout=log, stderr=subprocess.STDOUT, user=user,
        group=DAEMON_GID if as_daemon_uid else None,
        extra_groups=[] if as_daemon_uid else None,
        env=package_env(),
        # Joins the cgroup before exec: everything the daemon allocates is charged there.
        preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())),
    )
    log.close()
    socket = str(workdir / "d" / "cpu.sock")
    wait_until(lambda: proc.poll() is not None or _answers(socket), "the daemon serving",
               within=120)
    assert proc.poll() is None, (workdir / "daemon.log").read_text()
    return proc


def _answers(socket: str) -> bool:
    """The daemon serves its weights (it answers pings while it still loads)."""
    try:
        return daemon_status(socket, timeout=2).state == "ready"
    except (OSError, RuntimeError):
        return False


def trigger(workdir: Path) -> Path:
    path = Path(state_dir(str(workdir / "d" / "cpu.sock"))) / ("cpu.sock" + OOM_TRIGGER_SUFFIX)
    path.touch()
    return path


def oom_kills(group: Path) -> int | None:
    """The kernel's count of OOM kills in the cgroup (v1 memory.oom_control, v2 memory.events)."""
    for name in ("memory.oom_control", "memory.events"):
        with contextlib.suppress(OSError):
            for line in (group / name).read_text().splitlines():
                key, value = line.split()
                if key == "oom_kill":
                    return int(value)
    return None


def test_the_trigger_gets_the_daemon_oom_killed_by_the_kernel_and_is_consumed(
    daemons, minilm_dir,
) -> None:
    workdir = daemons.workdir()
    (workdir / "d").mkdir()
    with memory_cgroup(768 << 20) as group:
        proc = serve_in(group, workdir, minilm_dir)
        try:
            path = trigger(workdir)
            assert proc.wait(60) == -9, (workdir / "daemon.log").read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert oom_kills(group) == 1
    log = (workdir / "daemon.log").read_text()
    assert "fault injection: allocating memory past the cgroup limit of 805306368 bytes" in log
    # Consumed before the push: a restarted daemon does not do it again.
    assert not path.exists()


def test_without_a_memory_limit_the_daemon_refuses_and_keeps_serving(
    daemons, minilm_dir,
) -> None:
    workdir = daemons.workdir()
    (workdir / "d").mkdir()
    with memory_cgroup(None) as group:
        proc = serve_in(group, workdir, minilm_dir)
        try:
            path = trigger(workdir)
            wait_until(lambda: "not done" in (workdir / "daemon.log").read_text(),
                       "the daemon's refusal", within=30)
            assert not path.exists()
            attached = attach(str(workdir / "d" / "cpu.sock"), transports=["memfd"])
            attached.close()
            assert proc.poll() is None
        finally:
            proc.terminate()
            proc.wait(30)
    assert ("fault injection (.inject-oom) not done: this process's cgroup has no memory "
            "limit: pushing past it would exhaust the node") in (workdir / "daemon.log").read_text()


# An engine in the daemon's group tries to plant the trigger wherever it could write.
PLANT = textwrap.dedent(
    """
    import json, os, sys
    sock = sys.argv[1]
    name = os.path.basename(sock) + ".inject-oom"
    private = os.path.join(os.path.dirname(sock), ".daemon")
    out = {}
    for where in (private, os.path.dirname(sock), os.path.join(os.path.dirname(sock), "engines")):
        try:
            open(os.path.join(where, name), "x").close()
            out[where] = "created"
        except OSError as e:
            out[where] = e.strerror
    print(json.dumps(out))
    """
)


def test_an_engine_cannot_trigger_the_fault(daemons, minilm_dir) -> None:
    workdir = daemons.workdir()
    cross_uid_workdir(workdir)
    model = readable_model_copy(minilm_dir, workdir)
    with memory_cgroup(768 << 20) as group:
        proc = serve_in(group, workdir, model, as_daemon_uid=True)
        try:
            socket = str(workdir / "d" / "cpu.sock")
            out = subprocess.run(
                [python_for(ENGINE_UID), "-c", PLANT, socket], capture_output=True, text=True,
                user=ENGINE_UID, group=DAEMON_GID, extra_groups=[], check=True,
                env=package_env(),
            ).stdout
            outcome = json.loads(out)
            d = str(workdir / "d")
            # The private directory and the socket directory refuse the engine; in the
            # engines' hand-back directory (group-writable) the file means nothing.
            assert outcome == {f"{d}/.daemon": "Permission denied", d: "Permission denied",
                               f"{d}/engines": "created"}
            for _ in range(3):  # a few of the watcher's polls
                assert ping(socket) == proc.pid
                time.sleep(1)
            assert oom_kills(group) == 0
            assert "fault injection" not in (workdir / "daemon.log").read_text()
        finally:
            proc.terminate()
            proc.wait(30)


@pytest.mark.parametrize(("lines", "files", "limit"), [
    ("12:memory:/kubepods/pod1/c1\n",
     {"memory/kubepods/pod1/c1/memory.limit_in_bytes": "1073741824"}, 1 << 30),
    # In a container the hierarchy's root is the container's own cgroup.
    ("12:memory:/kubepods/pod1/c1\n", {"memory/memory.limit_in_bytes": "536870912"}, 512 << 20),
    ("12:memory:/\n", {"memory/memory.limit_in_bytes": "9223372036854771712"}, None),
    ("0::/job\n", {"job/memory.max": "2147483648"}, 2 << 30),
    ("0::/\n", {"memory.max": "max"}, None),
    ("0::/\n", {}, None),
])
def test_memory_limit_reads_the_processs_own_cgroup(tmp_path, lines, files, limit) -> None:
    (tmp_path / "cgroup").write_text(lines)
    for name, value in files.items():
        (tmp_path / "fs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / name).write_text(value + "\n")
    assert memory_limit(str(tmp_path / "cgroup"), tmp_path / "fs") == limit
