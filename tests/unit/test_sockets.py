"""weightcache.sockets: what both sides of every socket rely on, on a real filesystem."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from weightcache.sockets import (
    PeerPolicy,
    listen_unix,
    peer_credentials,
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
