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
