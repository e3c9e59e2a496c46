"""CLI: python -m tools.engine_venvs {build,path,test} [VENV...] (see __init__.py).

``test`` builds (or reuses) each venv (default: all of :data:`VENVS`) and runs
its test modules (``tests/engines/<module>``) with that venv's interpreter.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from tools.engine_venvs import REPO_ROOT, VENVS, build, venv_dir


def run_tests(name: str) -> int:
    venv = VENVS[name]
    python = build(name) / "bin" / "python"
    # The checkout's sources first: the venv's editable install may point at another
    # checkout (a second worktree sharing the cached venv); its metadata (entry points) is
    # the same, its code may not be.
    paths = [REPO_ROOT / "sidecar", REPO_ROOT / "operator", REPO_ROOT]
    env = {
        **os.environ,
        "WEIGHTCACHE_ENGINE_TESTS": venv.engine,
        # The tests' daemons run under this (the project's) venv and its torch.
        "WEIGHTCACHE_DAEMON_PYTHON": sys.executable,
        "PYTHONPATH": os.pathsep.join(map(str, paths)),
    }
    modules = [f"tests/engines/{module}" for module in venv.tests]
    deselected = [f"--deselect=tests/engines/{test}" for test in venv.deselect]
    argv = [str(python), "-m", "pytest", "-rs", "-p", "no:cacheprovider", *modules, *deselected]
    print(f"+ [{name}]", " ".join(argv), flush=True)
    return subprocess.run(argv, cwd=REPO_ROOT, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.engine_venvs")
    parser.add_argument("command", choices=("build", "path", "test"))
    parser.add_argument("venvs", nargs="*", metavar="VENV", help=f"default: all of {list(VENVS)}")
    args = parser.parse_args(argv)
    unknown = [name for name in args.venvs if name not in VENVS]
    if unknown:
        parser.error(f"unknown venv(s) {unknown}; expected some of {list(VENVS)}")
    failed = []
    for name in args.venvs or list(VENVS):
        if args.command == "test":
            if run_tests(name) != 0:
                failed.append(name)
        else:
            print(build(name) if args.command == "build" else venv_dir(name))
    if failed:
        print(f"engine adapter tests failed in: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
