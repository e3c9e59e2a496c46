"""tools.engine_venvs: which cached venvs are stale, and what their hash covers (no builds)."""

from __future__ import annotations

from pathlib import Path

import pytest

import tools.engine_venvs as engine_venvs


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("WEIGHTCACHE_CACHE_DIR", str(tmp_path))
    root = tmp_path / "engines"
    root.mkdir()
    return root


def test_stale_cleanup_removes_only_older_builds_of_the_same_venv(cache: Path) -> None:
    names = ["vllm-0123456789ab", "vllm-ba9876543210", "vllm_prev-0123456789ab",
             "sglang-0123456789ab", "vllm-notahash"]  # fmt: skip
    for name in names:
        (cache / name).mkdir()
    assert engine_venvs._remove_stale("vllm", keep=cache / "vllm-ba9876543210")
    assert sorted(p.name for p in cache.iterdir()) == sorted(set(names) - {"vllm-0123456789ab"})
    assert not engine_venvs._remove_stale("vllm", keep=cache / "vllm-ba9876543210")


def test_a_stale_venvs_removal_clears_the_shared_uv_cache_but_not_the_live_venvs(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The venvs install from uv's cache by hard links: clearing the cache (so an old
    pin's wheels do not stay behind) leaves every live venv's files in place."""
    live = engine_venvs.venv_dir("sglang")
    wheel_file = engine_venvs.uv_cache() / "archive-v0" / "torch" / "lib.so"
    wheel_file.parent.mkdir(parents=True)
    wheel_file.write_bytes(b"shared by two venvs")
    for venv in (live, engine_venvs.venv_dir("sglang_prev")):
        (venv / "lib").mkdir(parents=True)
        (venv / "lib" / "lib.so").hardlink_to(wheel_file)
        (venv / ".complete").write_text("built\n")
    monkeypatch.setattr(engine_venvs, "_install_weightcache", lambda target: None)

    engine_venvs.build("sglang")  # nothing stale: the cache stays for the next build
    assert wheel_file.exists()
    (cache / "sglang-0123456789ab").mkdir()  # an older pin's venv
    assert engine_venvs.build("sglang") == live
    assert not (cache / "sglang-0123456789ab").exists()
    assert not engine_venvs.uv_cache().exists()
    assert (live / "lib" / "lib.so").read_bytes() == b"shared by two venvs"
    assert (engine_venvs.venv_dir("sglang_prev") / "lib" / "lib.so").stat().st_nlink == 2


def test_every_venv_has_its_pins_and_an_engine_with_tests() -> None:
    for name, venv in engine_venvs.VENVS.items():
        assert all(p.is_file() for p in engine_venvs.pin_files(name)), name
        assert venv.engine in engine_venvs.ENGINES
        for module in venv.tests:
            assert (engine_venvs.REPO_ROOT / "tests" / "engines" / module).is_file(), module
        # A deselected test exists in one of the venv's modules (a renamed test would
        # otherwise run again unnoticed) and runs in another venv of the same engine.
        for test in venv.deselect:
            module, function = test.split("::")
            source = (engine_venvs.REPO_ROOT / "tests" / "engines" / module).read_text()
            assert module in venv.tests and f"def {function.split('[')[0]}(" in source, test
            assert any(
                other.engine == venv.engine and module in other.tests and test not in other.deselect
                for other in engine_venvs.VENVS.values()
            ), test


def test_the_hash_covers_an_overrides_file(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    for name in ("vllm_prev.txt", "test.txt"):
        (tmp_path / name).write_text((engine_venvs.HERE / name).read_text())
    monkeypatch.setattr(engine_venvs, "HERE", tmp_path)
    without = engine_venvs.pin_hash("vllm_prev")
    (tmp_path / "vllm_prev.overrides.txt").write_text("torch==2.13.0\n")
    assert engine_venvs.pin_hash("vllm_prev") != without
    assert engine_venvs.pin_hash("vllm_prev") == engine_venvs.pin_hash("vllm_prev")


def test_unknown_venvs_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown engine venv 'vllm-0.31'"):
        engine_venvs.pin_files("vllm-0.31")
