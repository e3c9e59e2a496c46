"""The device lock: one daemon per device, and a lock path that cannot be turned on a file."""

from __future__ import annotations

import os

import pytest

from weightcache.daemon.lock import DaemonAlreadyRunning, DeviceLock, LockFileError, lock_path


def test_lock_path_is_in_the_private_dir() -> None:
    assert lock_path("/run/wc/ns.name/gpu-X.sock") == "/run/wc/ns.name/.daemon/gpu-X.sock.lock"


def test_one_holder_at_a_time_and_the_next_takes_over(tmp_path) -> None:
    path = str(tmp_path / "cpu.sock.lock")
    first = DeviceLock(path)
    first.acquire()
    with pytest.raises(DaemonAlreadyRunning, match=f"another daemon \\(pid {os.getpid()}\\)"):
        DeviceLock(path).acquire()
    first.release()
    second = DeviceLock(path)
    second.acquire()
    second.release()


def test_a_symlink_at_the_lock_path_is_refused_and_its_target_untouched(tmp_path) -> None:
    # What anyone who can write the directory could plant: the daemon would create or
    # truncate the target and write its pid into it.
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    lock = tmp_path / "cpu.sock.lock"
    lock.symlink_to(victim)
    with pytest.raises(LockFileError, match="a symlink there is refused"):
        DeviceLock(str(lock)).acquire()
    assert victim.read_text() == "precious\n"
    dangling = tmp_path / "gpu.sock.lock"
    dangling.symlink_to(tmp_path / "created-by-the-daemon")
    with pytest.raises(LockFileError):
        DeviceLock(str(dangling)).acquire()
    assert not (tmp_path / "created-by-the-daemon").exists()


def test_a_fifo_or_another_uids_file_is_refused(tmp_path) -> None:
    fifo = tmp_path / "fifo.lock"
    os.mkfifo(fifo)
    with pytest.raises(LockFileError, match="not a regular file owned by uid"):
        DeviceLock(str(fifo)).acquire()  # and without blocking on the open
    if os.getuid() == 0:
        theirs = tmp_path / "theirs.lock"
        theirs.write_text("")
        os.chown(theirs, 65534, 65534)
        with pytest.raises(LockFileError, match="not a regular file owned by uid"):
            DeviceLock(str(theirs)).acquire()
