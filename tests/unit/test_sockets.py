"""weightcache.sockets: what both sides of every socket rely on, on a real filesystem."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path

import pytest

from weightcache.sockets import (
    PeerPolicy,
    listen_unix,
    peer_credentials,
    peer_groups,
    prepare_socket_dir,
    socket_files,
)


def test_a_listener_appears_with_its_final_mode_and_replaces_a_stale_socket(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "d.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()  # a dead daemon's socket file
    with listen_unix(path, backlog=4) as listener:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
        assert sorted(os.listdir(tmp_path)) == ["d.sock"]  # no temporary left behind
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(path)
            conn, _ = listener.accept()
            with conn:
                pid, uid, gid = peer_credentials(conn)
    assert (pid, uid, gid) == (os.getpid(), os.getuid(), os.getgid())


def test_a_failed_listen_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    with pytest.raises(OSError):
        listen_unix(str(tmp_path / "taken"), backlog=4)  # a directory cannot be replaced
    assert sorted(os.listdir(tmp_path)) == ["taken"]


def test_socket_files_lists_only_sockets(tmp_path: Path) -> None:
    real = tmp_path / "a.sock"
    listener = listen_unix(str(real), backlog=1)
    (tmp_path / "b.sock").write_text("not a socket")
    (tmp_path / "c.sock").symlink_to(real)
    (tmp_path / "d.txt").write_text("")
    try:
        assert socket_files(str(tmp_path)) == [str(real)]
        assert socket_files(str(tmp_path / "absent")) == []
    finally:
        listener.close()


def test_socket_files_reads_a_bounded_number_of_entries(tmp_path: Path) -> None:
    """A directory an engine floods costs a daemon's start the same as a small one."""
    listeners = [listen_unix(str(tmp_path / f"{i}.sock"), backlog=1) for i in range(6)]
    try:
        found = socket_files(str(tmp_path), limit=4)
        assert len(found) <= 4 and set(found) <= {str(tmp_path / f"{i}.sock") for i in range(6)}
        assert len(socket_files(str(tmp_path))) == 6
    finally:
        for listener in listeners:
            listener.close()


def test_the_socket_dir_is_tightened_and_never_followed(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    directory.mkdir()
    directory.chmod(0o777)
    prepare_socket_dir(str(directory / "cpu.sock"))
    assert stat.S_IMODE(directory.stat().st_mode) == 0o750
    (tmp_path / "link").symlink_to(directory)
    with pytest.raises(OSError, match="symlink is refused"):
        prepare_socket_dir(str(tmp_path / "link" / "cpu.sock"))


def test_peer_policy() -> None:
    policy = PeerPolicy(frozenset({1000}), frozenset({50}))
    assert policy.allows(1000, 7) and policy.allows(7, 50)
    assert not policy.allows(7, 8) and not PeerPolicy(frozenset()).allows(0, 0)


def test_a_supplementary_group_admits_a_peer_whose_primary_group_is_its_own() -> None:
    policy = PeerPolicy(frozenset({65533}), frozenset({65533}))
    assert policy.allows(1000, 1000, (4, 65533))
    assert not policy.allows(1000, 1000, (4, 5))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to take another uid and groups")
def test_the_kernel_reports_the_peers_supplementary_groups() -> None:
    """What an engine pod with `supplementalGroups: [65533]` looks like to the daemon."""
    # Not under pytest's tmp_path: its parents are root's 0700, closed to uid 1000.
    directory = Path(tempfile.mkdtemp(prefix="wc-peergroups-", dir="/tmp"))
    path = str(directory / "d.sock")
    try:
        directory.chmod(0o755)
        with listen_unix(path, backlog=1) as listener:
            os.chmod(path, 0o666)
            listener.settimeout(30)  # a peer that never connects fails the test, not hangs it
            child = os.fork()
            if child == 0:  # the engine: uid 1000, primary gid 1000, supplementary 65533
                try:
                    os.setgroups([65533])
                    os.setgid(1000)
                    os.setuid(1000)
                    with socket.socket(socket.AF_UNIX) as s:
                        s.settimeout(30)
                        s.connect(path)
                        s.recv(1)
                finally:
                    os._exit(0)
            try:
                conn, _ = listener.accept()
                with conn:
                    _, uid, gid = peer_credentials(conn)
                    groups = peer_groups(conn)
                    conn.sendall(b"x")
            finally:
                os.waitpid(child, 0)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert (uid, gid) == (1000, 1000)
    assert 65533 in groups
    assert PeerPolicy(frozenset(), frozenset({65533})).allows(uid, gid, groups)
