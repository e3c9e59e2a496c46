import socket
import subprocess
import sys
import time
from pathlib import Path

from tools.testenv import procs


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = procs.free_ports(5)
    assert len(set(ports)) == 5
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_free_ports_are_never_an_outgoing_connections_local_port() -> None:
    # The kernel picks outgoing connections' local ports from this range: a port from it,
    # chosen for a process that restarts later, may be taken by then (EADDRINUSE).
    low, high = (int(v) for v in procs.EPHEMERAL_PORT_RANGE.read_text().split())
    assert not [p for p in procs.free_ports(50) if low <= p <= high]


def test_free_ports_skip_a_port_already_listening() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", procs.free_ports(1)[0]))
        taken.listen()
        busy = taken.getsockname()[1]
        for _ in range(20):
            assert busy not in procs.free_ports(200)


def test_port_is_listening_sees_a_listener() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert procs.port_is_listening(port)
    assert not procs.port_is_listening(port)


def test_stop_kills_the_whole_group_including_grandchildren(tmp_path: Path) -> None:
    group = procs.ProcessGroup()
    # A child that ignores SIGTERM and forks a grandchild: only the group kill reaches both.
    script = (
        "import os, signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "os.fork()\n"
        "time.sleep(600)\n"
    )
    group.spawn("a", [sys.executable, "-c", script], tmp_path / "a.log")
    group.spawn("b", [sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / "b.log")
    pgid = group.pgid
    assert pgid is not None
    while len(procs.group_members(pgid)) < 3:
        time.sleep(0.05)
    group.stop(grace=0.5)
    # The grandchild is nobody's child here: its SIGKILL lands when the kernel gets to it
    # (under load, a moment after stop() returns). Without the group kill it sleeps 600 s.
    deadline = time.monotonic() + 30
    while procs.group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert procs.group_members(pgid) == []


def test_children_die_with_a_sigkilled_owner(tmp_path: Path) -> None:
    owner_script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from tools.testenv.procs import ProcessGroup\n"
        "g = ProcessGroup()\n"
        "g.spawn('s', [sys.executable, '-c', 'import time; time.sleep(600)'], Path(sys.argv[1]))\n"
        "print(g.pgid, flush=True)\n"
        "time.sleep(600)\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", owner_script, str(tmp_path / "s.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    pgid = int(owner.stdout.readline())
    assert procs.group_members(pgid)
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 30
    while procs.group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert procs.group_members(pgid) == []
