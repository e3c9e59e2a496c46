"""The GPU suite's record: which sidecar/ tree passed tests/gpu on which GPU.

    python -m tools.gpu_suite run [--tier smoke]  # CUDA machine: pytest tests/gpu, its record
    python -m tools.gpu_suite check               # anywhere (CI): warn on a record not main's

CI has no GPU, so a change to ``sidecar/`` lands with a record of the GPU suite run on
its own tree (0 failed): ``benchmarks/results/gpu-suite.json`` holds the date, the
device, driver, torch and CUDA, the tier, the counts with the failed and skipped test
ids, each test's seconds, and ``sidecar_tree``, the git tree hash of ``sidecar/`` it ran
on. The ``smoke`` tier (the tests marked ``smoke``: every transport on CUDA, a 16 GB
layout over vmm_fd, the adapters' GPU paths, KV, re-adoption; about 4 minutes) is what
every change to ``sidecar/`` needs, since GPU time comes in 30-minute sessions whose
machine may not start; ``full`` (the default) adds the replays of the MoE plan, peer
seeding, tensor parallelism and the rest, when time allows.

That hash is computed from the files themselves, the way git hashes a tree, so the
record can be written on a GPU machine that received a copy of the working tree without
its git metadata: it equals ``git rev-parse HEAD:sidecar`` exactly when the files are
those of the commit. ``run`` refuses to start unless they are: the files must hash to
``HEAD:sidecar``, or, on a copy whose git metadata is missing or not its own, to
``--expect-tree`` (that hash, computed where the commit is). ``check`` (run by
``.ci/run``, stdlib only) compares the record with ``HEAD:sidecar`` and prints a loud
warning when they differ.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import hashlib
import json
import os
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RECORD = REPO_ROOT / "benchmarks" / "results" / "gpu-suite.json"
TREE = "sidecar"
# pytest's selection of each tier.
TIERS = {"smoke": ["-m", "smoke"], "full": []}


# ---------------------------------------------------------------- git's tree hash


def ignore_patterns(gitignore: Path) -> list[str]:
    """The repository's ignore patterns (the plain forms .gitignore uses here)."""
    if not gitignore.exists():
        return []
    lines = (line.strip() for line in gitignore.read_text().splitlines())
    return [line for line in lines if line and not line.startswith(("#", "!"))]


def ignored(relative: str, is_dir: bool, patterns: list[str]) -> bool:
    """Whether git ignores ``relative`` (a path from the repository root) by ``patterns``:
    ``name``, ``*.ext`` and ``dir/`` match at any depth, ``/path`` at the root only."""
    name = relative.rsplit("/", 1)[-1]
    for pattern in patterns:
        if pattern.endswith("/"):
            if not is_dir:
                continue
            pattern = pattern.rstrip("/")
        if pattern.startswith("/"):
            if fnmatch.fnmatchcase(relative, pattern[1:]):
                return True
        elif "/" in pattern:
            if fnmatch.fnmatchcase(relative, pattern):
                return True
        elif fnmatch.fnmatchcase(name, pattern):
            return True
    return False


def _object_id(kind: str, body: bytes) -> bytes:
    return hashlib.sha1(f"{kind} {len(body)}\0".encode() + body).digest()


def _tree_id(root: Path, directory: Path, patterns: list[str]) -> bytes | None:
    """Git's tree object id of ``directory``; None when it holds no file git would track."""
    entries: list[tuple[str, bytes, bytes]] = []  # (sort key, mode, id)
    for child in directory.iterdir():
        relative = child.relative_to(root).as_posix()
        info = child.lstat()
        if stat.S_ISLNK(info.st_mode):
            if ignored(relative, False, patterns):
                continue
            entries.append((child.name, b"120000", _object_id("blob", os.readlink(child).encode())))
        elif stat.S_ISDIR(info.st_mode):
            if ignored(relative, True, patterns):
                continue
            sub = _tree_id(root, child, patterns)
            if sub is not None:
                # git orders a tree as if its name ended in "/".
                entries.append((child.name + "/", b"40000", sub))
        elif stat.S_ISREG(info.st_mode):
            if ignored(relative, False, patterns):
                continue
            mode = b"100755" if info.st_mode & stat.S_IXUSR else b"100644"
            entries.append((child.name, mode, _object_id("blob", child.read_bytes())))
    if not entries:
        return None
    entries.sort(key=lambda entry: entry[0].encode())
    body = b"".join(
        mode + b" " + key.rstrip("/").encode() + b"\0" + oid for key, mode, oid in entries
    )
    return _object_id("tree", body)


def tree_hash(root: Path, path: str) -> str:
    """``git rev-parse HEAD:<path>`` of a clean checkout, computed from the files under
    ``root/path`` (the repository's .gitignore applies)."""
    oid = _tree_id(root, root / path, ignore_patterns(root / ".gitignore"))
    if oid is None:
        raise ValueError(f"{root / path}: no file git would track")
    return oid.hex()


def git(*args: str, repo: Path = REPO_ROOT) -> str | None:
    """A git command's output in ``repo``, or None without git or its metadata."""
    try:
        done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
    except FileNotFoundError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


# ---------------------------------------------------------------- the record


@dataclass(eq=False)  # a pytest plugin: pluggy keeps plugins in sets, by identity
class Outcomes:
    """Test outcomes as pytest reports them: a failure in any phase fails the test."""

    passed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # test id -> reason
    seconds: dict[str, float] = field(default_factory=dict)  # test id -> set-up, call, teardown

    def pytest_runtest_logreport(self, report) -> None:
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration
        if report.failed:
            if report.nodeid not in self.failed:
                self.failed.append(report.nodeid)
        elif report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
            self.skipped[report.nodeid] = str(reason)
        elif report.when == "call":
            self.passed.append(report.nodeid)

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            self.failed.append(report.nodeid or "<collection>")

    def finished(self) -> dict:
        # A test that passed its call but failed its teardown is a failure only.
        passed = [test for test in self.passed if test not in self.failed]
        return {
            "passed": len(passed),
            "failed": len(self.failed),
            "skipped": len(self.skipped),
            "failed_tests": self.failed,
            "skipped_tests": self.skipped,
            # What each test costs, to keep the smoke tier within its minutes.
            "test_seconds": {test: round(s, 1) for test, s in self.seconds.items()},
        }


def machine() -> dict:
    """What the suite ran on: the GPU, its driver, torch and its CUDA."""
    import torch

    query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    try:
        smi = subprocess.run(query, capture_output=True, text=True, check=True, timeout=30)
        driver = smi.stdout.split("\n")[0].strip()
    except (OSError, subprocess.SubprocessError) as exc:
        driver = f"unknown ({exc})"
    return {
        "device": torch.cuda.get_device_name(0),
        "device_count": torch.cuda.device_count(),
        "driver": driver,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
    }


def record(
    outcomes: dict, sidecar_tree: str, exit_status: int, seconds: float, tier: str
) -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **machine(),
        "tier": tier,
        "sidecar_tree": sidecar_tree,
        "pytest_exit_status": exit_status,
        "seconds": round(seconds, 1),
        **outcomes,
    }


def say(message: str) -> None:
    print(f"gpu_suite: {message}", file=sys.stderr)


def run(out: Path, expect_tree: str | None = None, tier: str = "full") -> int:
    import time

    import pytest
    import torch

    if not torch.cuda.is_available():
        say(
            "no CUDA device here; the record is written only where the GPU tests run "
            "(CI runs tests/gpu, which skip without one)"
        )
        return 2
    sidecar_tree = tree_hash(REPO_ROOT, TREE)
    expected = expect_tree or git("rev-parse", f"HEAD:{TREE}")
    if sidecar_tree != expected:
        say(
            f"{TREE}/ here hashes to {sidecar_tree}, not to the committed tree "
            f"{expected or '(no git here: pass --expect-tree)'}: commit first (or copy the "
            f"commit over whole), so that the record names a tree that exists"
        )
        return 2
    print(f"gpu_suite: {TREE}/ tree {sidecar_tree}", flush=True)
    outcomes = Outcomes()
    started = time.monotonic()
    os.environ.setdefault("WEIGHTCACHE_RESULTS_DIR", str(out.parent))
    argv = ["-rs", "-s", "-p", "no:cacheprovider", *TIERS[tier], str(REPO_ROOT / "tests" / "gpu")]
    status = int(pytest.main(argv, plugins=[outcomes]))
    if status not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        say(f"pytest ended with {pytest.ExitCode(status).name}: no record written")
        return status
    result = record(outcomes.finished(), sidecar_tree, status, time.monotonic() - started, tier)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    counts = f"{result['passed']} passed, {result['failed']} failed, {result['skipped']} skipped"
    print(f"gpu_suite: {tier} tier: {counts} on {result['device']}; wrote {out}", flush=True)
    return status


def check(path: Path, repo: Path = REPO_ROOT) -> int:
    """Warn (never fail: a GPU machine is not always at hand) when the record is stale."""
    if not path.exists():
        return 0
    head = git("rev-parse", f"HEAD:{TREE}", repo=repo)
    problems = []
    try:
        recorded = json.loads(path.read_text())
        if not isinstance(recorded, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        recorded = {}
        problems.append(f"it cannot be read: {exc}")
    if recorded and recorded.get("sidecar_tree") != head:
        problems.append(
            f"it ran on {TREE}/ tree {recorded.get('sidecar_tree')}, but HEAD:{TREE} is {head}: "
            f"the GPU suite (its smoke tier at least) has not run on this {TREE}/"
        )
    if recorded.get("failed"):
        problems.append(f"it records {recorded['failed']} failed: {recorded.get('failed_tests')}")
    if problems:
        bar = "!" * 78
        print(f"{bar}\nWARNING: {path} is not a clean GPU record of this commit:", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        print(
            "  Run the GPU suite on a GPU machine (tests/gpu/README.md) and commit its "
            f"record.\n{bar}",
            file=sys.stderr,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_suite")
    parser.add_argument("command", choices=("run", "check", "tree"))
    parser.add_argument("--record", type=Path, default=RECORD, help=f"default: {RECORD}")
    parser.add_argument(
        "--expect-tree",
        help="run: the sidecar/ tree the files must hash to (`git rev-parse HEAD:sidecar` "
        "where the commit is), for a copy whose git metadata is missing or not its own",
    )
    parser.add_argument("--tier", choices=sorted(TIERS), default="full",
                        help="run: the smoke tier (tests marked smoke) or the full suite")
    args = parser.parse_args(argv)
    if args.command == "run":
        return run(args.record, args.expect_tree, args.tier)
    if args.command == "check":
        return check(args.record)
    print(tree_hash(REPO_ROOT, TREE))
    return 0


if __name__ == "__main__":
    sys.exit(main())
