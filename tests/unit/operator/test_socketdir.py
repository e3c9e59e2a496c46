"""The socket directory set-up (the daemon pod's only root step), on a real filesystem.

These run as root here, as the init container does, so chown and the
ownership checks are real; the attacks plant what a daemon of another cache
could plant inside its own directory.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from weightcache_operator.socketdir import SetupError, prepare

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
    """The set-up step as the daemon pod's init container runs it: root with CAP_CHOWN alone
    (no CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH or CAP_FOWNER)."""
    return subprocess.run(
        ["setpriv", "--bounding-set", "-all,+chown", "--inh-caps", "-all", "--",
         sys.executable, "-m", "weightcache_operator.socketdir", *args],
        capture_output=True, text=True, timeout=60,
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
