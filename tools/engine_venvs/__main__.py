"""CLI: python -m tools.engine_venvs {build,path,test} ENGINE... (see __init__.py).

``test`` builds (or reuses) each engine's venv and runs its adapter tests,
``tests/engines/test_<engine>.py``, with that venv's interpreter.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from tools.engine_venvs import ENGINES, REPO_ROOT, build, venv_dir


def run_tests(engine: str) -> int:
    python = build(engine) / "bin" / "python"
    # The checkout's sources first: the venv's editable install may point at another
    # checkout (a second worktree sharing the cached venv); its metadata (entry points) is
    # the same, its code may not be.
    paths = [REPO_ROOT / "sidecar", REPO_ROOT / "operator", REPO_ROOT]
    env = {
        **os.environ,
        "WEIGHTCACHE_ENGINE_TESTS": engine,
        "PYTHONPATH": os.pathsep.join(map(str, paths)),
    }
    argv = [str(python), "-m", "pytest", "-rs", "-p", "no:cacheprovider",
            f"tests/engines/test_{engine}.py"]  # fmt: skip
    print("+", " ".join(argv), flush=True)
    return subprocess.run(argv, cwd=REPO_ROOT, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.engine_venvs")
    parser.add_argument("command", choices=("build", "path", "test"))
    parser.add_argument("engines", nargs="+", choices=ENGINES)
    args = parser.parse_args(argv)
    failed = 0
    for engine in args.engines:
        if args.command == "test":
            failed |= run_tests(engine) != 0
        else:
            print(build(engine) if args.command == "build" else venv_dir(engine))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
