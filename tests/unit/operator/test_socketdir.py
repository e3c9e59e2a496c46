"""The socket directory set-up (the daemon pod's only root step), on a real filesystem.

These run as root here, as the init container does, so chown and the
ownership checks are real; the attacks plant what a daemon of another cache
could plant inside its own directory.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from weightcache_operator.socketdir import (
    Budget,
    SetupError,
    is_retired,
    moved_name,
    open_root,
    prepare,
    sweep,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root, as the init container")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "sockets"
    path.mkdir()
    path.chmod(0o755)  # whatever umask another test's thread has set meanwhile
    return path


def test_creates_the_directory_for_the_daemon(root: Path) -> None:
    prepare(str(root), "team.minilm", 65533, 65534)
    st = (root / "team.minilm").stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (65533, 65534, 0o750)
    # Idempotent, also once the daemon owns it (root then may not chmod without CAP_FOWNER).
    prepare(str(root), "team.minilm", 65533, 65534)
    # A new runAsUser takes the directory over.
    prepare(str(root), "team.minilm", 4242, 4242)
    assert (root / "team.minilm").stat().st_uid == 4242


def test_a_directory_the_daemon_already_owns_is_left_as_it_is(root: Path) -> None:
    # On a restart the set-up step (root without CAP_DAC_READ_SEARCH) could not even open
    # the daemon's directory; it has nothing to do there, so it must not try.
    (root / "team.minilm").mkdir(mode=0o700)
    os.chown(root / "team.minilm", 65533, 65534)
    prepare(str(root), "team.minilm", 65533, 65534)
    st = (root / "team.minilm").stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (65533, 65534, 0o700)


def test_a_symlink_in_place_of_the_directory_is_refused_not_followed(
    root: Path, tmp_path: Path
) -> None:
    victim = tmp_path / "etc"
    victim.mkdir()
    victim.chmod(0o755)
    (root / "team.minilm").symlink_to(victim)
    with pytest.raises(SetupError, match="refusing to follow"):
        prepare(str(root), "team.minilm", 65533, 65533)
    st = victim.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o755)
    # A dangling link is refused too, and nothing is created where it points.
    (root / "x.y").symlink_to(tmp_path / "nowhere")
    with pytest.raises(SetupError):
        prepare(str(root), "x.y", 65533, 65533)
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("name", ["../escape", "a/b", "..", ".", ""])
def test_only_a_single_component_is_accepted(root: Path, name: str) -> None:
    with pytest.raises(SetupError, match="single directory name"):
        prepare(str(root), name, 65533, 65533)


def test_a_root_others_can_write_is_refused(root: Path) -> None:
    os.chmod(root, 0o777)
    with pytest.raises(SetupError, match="writable by root alone"):
        prepare(str(root), "team.minilm", 65533, 65533)
    os.chmod(root, 0o755)
    os.chown(root, 1000, 1000)
    with pytest.raises(SetupError, match="owned by uid 1000"):
        prepare(str(root), "team.minilm", 65533, 65533)
    assert not (root / "team.minilm").exists()


def test_root_is_never_the_new_owner(root: Path) -> None:
    with pytest.raises(SetupError, match="root"):
        prepare(str(root), "team.minilm", 0, 65533)


def test_command_line(root: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "weightcache_operator.socketdir", *args],
                              capture_output=True, text=True, timeout=60)

    ok = run(str(root), "team.minilm", "65533", "65533")
    assert ok.returncode == 0, ok.stderr
    assert run(str(root), "team.minilm", "x", "65533").returncode == 2
    (root / "evil").symlink_to("/etc")
    refused = run(str(root), "evil", "65533", "65533")
    assert refused.returncode == 1 and "refusing to follow" in refused.stderr


def as_init_container(*args: str) -> subprocess.CompletedProcess[str]:
    """The set-up step (or the sweeper) as its container runs it: root with CAP_CHOWN alone
    (no CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH or CAP_FOWNER)."""
    return subprocess.run(
        ["setpriv", "--bounding-set", "-all,+chown", "--inh-caps", "-all", "--",
         sys.executable, "-m", "weightcache_operator.socketdir", *args],
        capture_output=True, text=True, timeout=120,
    )


def daemon_was_here(directory: Path, uid: int) -> None:
    """What a daemon of `uid` leaves: its private state (the re-adoption key) and sockets."""
    private, engines = directory / ".daemon", directory / "engines"
    private.mkdir(mode=0o700)
    (private / "cpu.sock.manifest").write_text('{"checksum_key": "secret"}')
    engines.mkdir()
    os.chmod(engines, 0o3770)
    (engines / "1-abc.sock").write_text("")
    for path in (private / "cpu.sock.manifest", engines / "1-abc.sock", private, engines):
        os.chown(path, uid, uid)
    os.chmod(directory, 0o750)


def test_a_new_daemon_uid_or_a_new_cache_gets_a_fresh_directory(root: Path) -> None:
    """Issue 25 item 10: changing runAsUser wedged the init container forever (EACCES on the
    old uid's 0750 directory), and a cache deleted and created again under its name, with the
    same uid, inherited its directory: the re-adoption key and manifest included."""
    cache = root / "team.minilm"
    first = as_init_container(str(root), "team.minilm", "65533", "65533")
    assert first.returncode == 0, first.stderr
    daemon_was_here(cache, 65533)

    changed = as_init_container(str(root), "team.minilm", "4242", "4242")
    assert changed.returncode == 0, changed.stderr  # once: EACCES, exit 1, every restart
    st = cache.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (4242, 4242, 0o750)
    assert list(cache.iterdir()) == []
    # Set aside, for the sweeper: no cache's start waits on removing it.
    (retired,) = [p for p in root.iterdir() if p.name.startswith(".retired-team.minilm-")]
    assert retired.stat().st_uid == 65533
    swept = as_init_container("sweep", "--every", "0", str(root))
    assert swept.returncode == 0, swept.stderr
    assert sorted(p.name for p in root.iterdir()) == [".weightcache", "team.minilm"]

    daemon_was_here(cache, 4242)
    again = as_init_container(str(root), "team.minilm", "4242", "4242", "uid-1")
    assert again.returncode == 0, again.stderr
    assert (cache / ".daemon").exists()  # a restart keeps what its daemon left
    recreated = as_init_container(str(root), "team.minilm", "4242", "4242", "uid-2")
    assert recreated.returncode == 0, recreated.stderr
    assert list(cache.iterdir()) == [] and cache.stat().st_uid == 4242
    record = (root / ".weightcache" / "team.minilm").read_text().split()
    assert record == ["uid-2", "4242", "4242"]
    assert stat.S_IMODE((root / ".weightcache").stat().st_mode) == 0o700


def test_a_directory_from_before_records_is_kept_and_recorded(root: Path) -> None:
    """An upgrade must not throw away the weights' re-adoption state."""
    cache = root / "team.minilm"
    cache.mkdir()
    daemon_was_here(cache, 65533)
    result = as_init_container(str(root), "team.minilm", "65533", "65533", "uid-1")
    assert result.returncode == 0, result.stderr
    assert (cache / ".daemon").exists()
    assert (root / ".weightcache" / "team.minilm").read_text().split() == [
        "uid-1", "65533", "65533"]


# --------------------------------------------------------------------------- retired trees

DEPTH = 1500  # past Python's recursion limit: once a RecursionError on every cache's start


def nested(top: Path, depth: int, uid: int) -> None:
    """What an engine of uid `uid` can nest in its cache's engines/: `depth` directories,
    each closed to everyone (mode 0), files, a socket, a FIFO, and links out of the tree."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for level in range(depth):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            if level % 100 == 0:
                os.symlink("/etc", "to-etc", dir_fd=fd)
                os.mkfifo("fifo", dir_fd=fd)
                with open(os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd), "w") as f:
                    f.write("x")
            os.fchown(fd, uid, uid)
            os.fchmod(fd, 0)
            os.close(fd)
            fd = child
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(f"/proc/self/fd/{fd}/s.sock")
        os.fchown(fd, uid, uid)
        os.fchmod(fd, 0)
    finally:
        os.close(fd)


def retired_tree(root: Path, name: str, depth: int = DEPTH, uid: int = 4242) -> Path:
    """A cache directory whose engine nested a tree in engines/, set aside as the set-up step
    sets it aside."""
    cache = root / name
    cache.mkdir()
    daemon_was_here(cache, uid)
    nested(cache / "engines", depth, uid)
    retired = root / f".retired-{name}-0badc0de"
    cache.rename(retired)
    return retired


def entries_below(path: Path) -> int:
    result = subprocess.run(["find", str(path), "-mindepth", "1"], capture_output=True,
                            text=True, check=False)
    return len(result.stdout.splitlines())


def test_a_start_never_enters_another_caches_retired_directory(root: Path) -> None:
    """Issue 34 item 1: every cache's set-up step removed every retired directory of the
    node, recursing once per level: 1,500 nested directories made it die of RecursionError
    on each start, every cache's daemon stuck in Init:CrashLoopBackOff."""
    retired = retired_tree(root, "tenant.squatter")
    before = entries_below(retired)
    result = as_init_container(str(root), "victim.cache", "65533", "65533", "uid-v")
    assert result.returncode == 0, result.stderr
    assert (root / "victim.cache").stat().st_uid == 65533
    assert entries_below(retired) == before  # left to the sweeper
    # Too deep for the recursive rmtree that cleans pytest's temporary directories.
    assert as_init_container("sweep", "--every", "0", str(root)).returncode == 0


def test_the_sweeper_removes_any_tree_with_chown_alone_never_following_a_link(
    root: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    os.chown(outside, 1234, 1234)
    retired = retired_tree(root, "tenant.squatter")
    (retired / "engines" / "d" / "to-outside").symlink_to(outside)
    prepare(str(root), "victim.cache", 65533, 65533)
    swept = as_init_container("sweep", "--every", "0", str(root))
    assert swept.returncode == 0, swept.stderr
    assert sorted(p.name for p in root.iterdir()) == [".weightcache", "victim.cache"]
    assert "removed" in swept.stderr and "more left" not in swept.stderr
    st = outside.stat()
    assert (st.st_uid, (outside / "keep").read_text()) == (1234, "x")
    assert (root / "victim.cache").stat().st_uid == 65533


def test_a_sweep_is_bounded_and_every_pass_makes_progress(root: Path) -> None:
    retired_tree(root, "tenant.squatter", depth=300)
    left = entries_below(root)
    passes = 0
    while True:
        passes += 1
        fd = open_root(str(root))
        try:
            result = sweep(fd, Budget(time.monotonic() + 60, entries=50))
        finally:
            os.close(fd)
        now = entries_below(root)
        if result.complete:
            break
        assert now < left, f"pass {passes} removed nothing ({result.summary()})"
        left = now
    assert passes > 10  # the budget bounded each pass
    assert list(root.iterdir()) == []
    # A spent deadline does nothing at all.
    retired_tree(root, "tenant.again", depth=3)
    fd = open_root(str(root))
    try:
        result = sweep(fd, Budget(time.monotonic() - 1, entries=10**6))
    finally:
        os.close(fd)
    assert (result.complete, result.removed, result.moved) == (False, 0, 0)


def test_an_entry_that_cannot_be_removed_is_logged_and_the_rest_goes(root: Path) -> None:
    retired = retired_tree(root, "tenant.squatter", depth=5)
    stuck = retired / "busy"
    stuck.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(stuck)], check=True)
    try:
        swept = as_init_container("sweep", "--every", "0", str(root))
        assert swept.returncode == 1
        assert "1 could not be removed" in swept.stderr and "busy" in swept.stderr, swept.stderr
        assert "Device or resource busy" in swept.stderr
        # Everything else went; the directory holding the mount point stays for later.
        assert [p.name for p in root.iterdir()] == [retired.name]
        assert [p.name for p in retired.iterdir()] == ["busy"]
    finally:
        subprocess.run(["umount", str(stuck)], check=True)
    swept = as_init_container("sweep", "--every", "0", str(root))
    assert swept.returncode == 0, swept.stderr
    assert list(root.iterdir()) == []


def test_the_sweeper_refuses_a_root_others_may_write(root: Path) -> None:
    os.chmod(root, 0o777)
    swept = as_init_container("sweep", "--every", "0", str(root))
    os.chmod(root, 0o755)
    assert swept.returncode == 1 and "writable by root alone" in swept.stderr


def test_retired_names() -> None:
    assert is_retired(".retired-team.cache-0badc0de")
    assert not is_retired(".retired-") and not is_retired("team.cache")
    assert not is_retired(".weightcache")
    moved = moved_name(".retired-my-team.cache-0badc0de", "ab" * 8)
    assert moved == ".retired-my-team.cache-" + "ab" * 8
    # However deep the directory was, its new name does not grow.
    assert moved_name(moved, "cd" * 8) == ".retired-my-team.cache-" + "cd" * 8


def test_a_budget_is_spent_by_entries_or_by_time() -> None:
    budget = Budget(deadline=10.0, entries=2)
    assert budget.spend(1.0) and budget.spend(2.0)
    assert not budget.spend(3.0)
    assert not Budget(deadline=10.0, entries=5).spend(10.0)
