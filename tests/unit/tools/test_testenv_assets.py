import shutil
from pathlib import Path

import pytest

from tools.testenv import assets


def test_cache_root_follows_xdg_then_home(tmp_path: Path) -> None:
    assert (
        assets.cache_root({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "weightcache" / "testenv"
    )
    assert assets.cache_root({"WEIGHTCACHE_TESTENV_CACHE": str(tmp_path / "c")}) == tmp_path / "c"
    assert assets.cache_root({}) == Path.home() / ".cache" / "weightcache" / "testenv"


def _copy_sources(tmp_path: Path) -> Path:
    for rel in assets.PIN_FILES:
        target = tmp_path / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(assets.SOURCE_DIR / rel, target)
    return tmp_path


def test_pin_key_names_the_release_and_changes_with_any_pinned_file(tmp_path: Path) -> None:
    sources = _copy_sources(tmp_path)
    key = assets.pin_key(sources)
    assert key.startswith(assets.K8S_VERSION + "-")
    assert assets.pin_key(sources) == key
    for rel in assets.PIN_FILES:
        original = (sources / rel).read_bytes()
        (sources / rel).write_bytes(original + b"\n")
        assert assets.pin_key(sources) != key, rel
        (sources / rel).write_bytes(original)


def _executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_kubebuilder_assets_win_and_the_pinned_build_fills_the_rest(tmp_path: Path) -> None:
    pinned, envtest = tmp_path / "pinned", tmp_path / "envtest"
    for name in assets.BINARIES:
        _executable(pinned / name)
    for name in ("kube-apiserver", "etcd", "kubectl"):
        _executable(envtest / name)
    found, missing = assets.resolve_binaries(pinned, {"KUBEBUILDER_ASSETS": str(envtest)})
    assert missing == []
    assert found["kube-apiserver"] == envtest / "kube-apiserver"
    assert found["etcd"] == envtest / "etcd"
    assert found["kwok"] == pinned / "kwok"


def test_missing_and_non_executable_binaries_are_reported(tmp_path: Path) -> None:
    _executable(tmp_path / "kwok")
    (tmp_path / "helm").write_text("not executable")
    found, missing = assets.resolve_binaries(tmp_path, {})
    assert list(found) == ["kwok"]
    assert "helm" in missing and "kube-apiserver" in missing


@pytest.mark.parametrize("stamp", [True, False])
def test_build_flags_strip_and_trim(stamp: bool) -> None:
    flags = assets.go_build_flags(stamp)
    assert "-trimpath" in flags
    ldflags = next(f for f in flags if f.startswith("-ldflags="))
    assert "-s -w" in ldflags
    assert ("k8s.io/component-base/version.gitVersion=" + assets.K8S_VERSION in ldflags) == stamp
