"""tools/gpu_suite.py: git's tree hash from the files, the outcome record, the CI warning."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tools.gpu_suite import TIERS, Outcomes, check, tree_hash

GIT_ENV = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=repo, env=GIT_ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A committed tree with what sidecar/ can hold: nested packages, an executable, a
    symlink, names git sorts unlike Python (``a.b`` before the tree ``a``), and
    ignored files beside them."""
    (tmp_path / ".gitignore").write_text("__pycache__/\n*.pyc\n*.egg-info/\n/build/\n")
    tree = tmp_path / "sidecar"
    (tree / "pkg" / "a").mkdir(parents=True)
    (tree / "pkg" / "a" / "x.py").write_text("x = 1\n")
    (tree / "pkg" / "a.b").write_text("sorted before the tree a/ by git\n")
    (tree / "pkg" / "a-").write_text("and this one before both\n")
    (tree / "run.sh").write_text("#!/bin/sh\n")
    (tree / "run.sh").chmod(0o755)
    (tree / "link").symlink_to("pkg/a/x.py")
    (tree / "Dockerfile").write_bytes(b"\x00\xffbinary too\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "tree")
    # What a test run leaves behind, ignored by git.
    (tree / "pkg" / "__pycache__").mkdir()
    (tree / "pkg" / "__pycache__" / "x.cpython-312.pyc").write_bytes(b"\x01")
    (tree / "w.egg-info").mkdir()
    (tree / "w.egg-info" / "PKG-INFO").write_text("x")
    (tree / "empty").mkdir()  # git keeps no empty directory
    return tmp_path


def test_the_tree_hash_is_gits_for_a_clean_tree(repo: Path) -> None:
    assert tree_hash(repo, "sidecar") == git(repo, "rev-parse", "HEAD:sidecar")


def test_any_change_to_a_tracked_file_or_mode_changes_the_hash(repo: Path) -> None:
    clean = tree_hash(repo, "sidecar")
    (repo / "sidecar" / "run.sh").chmod(0o644)
    assert tree_hash(repo, "sidecar") != clean
    (repo / "sidecar" / "run.sh").chmod(0o755)
    assert tree_hash(repo, "sidecar") == clean
    (repo / "sidecar" / "pkg" / "a" / "x.py").write_text("x = 2\n")
    assert tree_hash(repo, "sidecar") != clean


def test_an_untracked_file_that_git_would_add_makes_the_tree_dirty(repo: Path) -> None:
    clean = tree_hash(repo, "sidecar")
    (repo / "sidecar" / "new.py").write_text("")
    assert tree_hash(repo, "sidecar") != clean
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "new")
    assert tree_hash(repo, "sidecar") == git(repo, "rev-parse", "HEAD:sidecar")


def test_outcomes_of_a_real_pytest_run(tmp_path: Path) -> None:
    (tmp_path / "test_some.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert False\n"
        "@pytest.mark.skip(reason='needs 2 CUDA devices')\n"
        "def test_two(): pass\n"
        "@pytest.fixture\n"
        "def broken():\n"
        "    yield\n"
        "    raise RuntimeError('teardown')\n"
        "def test_torn(broken): pass\n"
    )
    outcomes = Outcomes()
    status = pytest.main(["-q", "-p", "no:cacheprovider", str(tmp_path)], plugins=[outcomes])
    assert status == pytest.ExitCode.TESTS_FAILED
    found = outcomes.finished()
    ids = {test.rsplit("::", 1)[1] for test in found["failed_tests"]}
    assert ids == {"test_bad", "test_torn"}  # a teardown failure fails the test
    assert (found["passed"], found["failed"], found["skipped"]) == (1, 2, 1)
    [(skipped, reason)] = found["skipped_tests"].items()
    assert skipped.endswith("::test_two") and "needs 2 CUDA devices" in reason


def test_each_tests_seconds_are_recorded(tmp_path: Path) -> None:
    (tmp_path / "test_slow.py").write_text(
        "import time\ndef test_slow(): time.sleep(0.3)\ndef test_fast(): pass\n"
    )
    outcomes = Outcomes()
    pytest.main(["-q", "-p", "no:cacheprovider", str(tmp_path)], plugins=[outcomes])
    seconds = {t.rsplit("::", 1)[1]: s for t, s in outcomes.finished()["test_seconds"].items()}
    assert seconds["test_slow"] >= 0.3 > seconds["test_fast"]


def test_the_smoke_tier_covers_what_every_sidecar_change_needs(tmp_path: Path) -> None:
    """The tier a 30-minute GPU session can always afford: every transport on CUDA (torch_ipc
    included), a 16 GB layout attached over vmm_fd, the adapters' GPU paths (the layout
    decision's device memory among them), KV, re-adoption; not the MoE replay nor the
    two-GPU tests."""

    class Collected:
        def __init__(self) -> None:
            self.ids: list[str] = []

        def pytest_collection_finish(self, session) -> None:
            self.ids.extend(item.nodeid for item in session.items)

    collected = Collected()
    argv = ["-q", "--collect-only", "-p", "no:cacheprovider", *TIERS["smoke"], "tests/gpu"]
    assert pytest.main(argv, plugins=[collected]) == pytest.ExitCode.OK
    ids = collected.ids
    for transport in ("vmm_fd", "torch_ipc"):
        assert any("test_cuda_transports.py" in i and transport in i for i in ids)
    assert any("test_engine_free_replay.py" in i and "llama" in i for i in ids)
    assert not any("test_engine_free_replay.py" in i and "qwen" in i for i in ids)
    assert any("test_the_layout_decision_leaves_the_device_as_the_engine_found_it" in i
               for i in ids)  # fmt: skip
    assert any("test_kv_gpu.py" in i for i in ids)
    assert any("test_readopt_gpu.py" in i for i in ids)
    assert not any("test_tp2_gpu.py" in i or "test_peer_gpu.py" in i for i in ids)
    assert TIERS["full"] == []


def test_the_post_commit_hook_warns_when_a_commit_leaves_the_record_behind(repo: Path) -> None:
    """`make venv` points git at .githooks: after a commit that changes sidecar/, the hook
    prints the record's warning (the commit itself stands)."""
    root = Path(__file__).resolve().parents[3]
    (repo / "tools").mkdir()
    for name in ("__init__.py", "gpu_suite.py"):
        shutil.copy(root / "tools" / name, repo / "tools" / name)
    results = repo / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "gpu-suite.json").write_text(json.dumps(
        {"sidecar_tree": git(repo, "rev-parse", "HEAD:sidecar"), "failed": 0}))
    git(repo, "config", "core.hooksPath", str(root / ".githooks"))
    git(repo, "add", "-A")
    quiet = commit(repo, "the record and its tool")
    assert "WARNING" not in quiet  # the record is of this tree
    (repo / "sidecar" / "run.sh").write_text("#!/bin/sh\necho changed\n")
    loud = commit(repo, "a sidecar change")
    assert "WARNING" in loud and "has not run on this sidecar/" in loud
    assert "a sidecar change" in git(repo, "log", "-1", "--format=%s")


def commit(repo: Path, message: str) -> str:
    """`git commit -a` in ``repo``; what its hooks printed."""
    done = subprocess.run(["git", "commit", "-qam", message], cwd=repo, env=GIT_ENV,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def record_for(repo: Path, tree: str, failed: list[str]) -> Path:
    path = repo / "gpu-suite.json"
    path.write_text(json.dumps({"sidecar_tree": tree, "failed": len(failed),
                                "failed_tests": failed}))  # fmt: skip
    return path


def test_ci_warns_loudly_when_the_record_is_of_another_tree(repo: Path, capsys) -> None:
    head = git(repo, "rev-parse", "HEAD:sidecar")
    assert check(record_for(repo, head, []), repo) == 0
    assert capsys.readouterr().err == ""
    old = "0" * 40
    assert check(record_for(repo, old, []), repo) == 0  # a warning, never a failure
    err = capsys.readouterr().err
    assert "WARNING" in err and old in err and head in err


def test_ci_warns_when_the_record_has_failures(repo: Path, capsys) -> None:
    head = git(repo, "rev-parse", "HEAD:sidecar")
    check(record_for(repo, head, ["tests/gpu/test_x.py::test_y"]), repo)
    assert "1 failed" in capsys.readouterr().err


def test_no_record_no_warning(repo: Path, capsys) -> None:
    assert check(repo / "absent.json", repo) == 0
    assert capsys.readouterr().err == ""


def test_an_unreadable_record_is_a_warning_too(repo: Path, capsys) -> None:
    (repo / "gpu-suite.json").write_text("[1, 2")
    assert check(repo / "gpu-suite.json", repo) == 0
    assert "cannot be read" in capsys.readouterr().err


def test_the_suite_refuses_a_tree_that_is_not_the_committed_one(monkeypatch, capsys) -> None:
    """On a CUDA machine it would check before running a test; without one it stops
    earlier, so this checks the verdict itself with the tree this checkout holds."""
    import tools.gpu_suite as suite

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("pytest.main", lambda *a, **k: pytest.fail("the suite must not start"))
    assert suite.run(Path("/nonexistent/gpu-suite.json"), expect_tree="0" * 40) == 2
    err = capsys.readouterr().err
    assert f"not to the committed tree {'0' * 40}" in err
