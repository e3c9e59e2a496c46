"""CLI: python -m tools.testenv {build,up,down,env}.

`up` leaves the control plane running under a detached supervisor process
(the owner of the process group, see procs.py) and prints shell exports;
`down` stops it; `env` prints the exports again. State lives in
<cache>/runs/<name>/state.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from tools.testenv import assets
from tools.testenv.cluster import Cluster, Endpoint, interrupt_on_termination, load_state
from tools.testenv.procs import kill_group

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_dir(name: str) -> Path:
    return assets.cache_root() / "runs" / name


def exports(endpoint: Endpoint) -> str:
    lines = [
        f"export KUBECONFIG={shlex.quote(endpoint.kubeconfig)}",
        f"export WEIGHTCACHE_TESTENV_SERVER={shlex.quote(endpoint.server)}",
        f"export WEIGHTCACHE_TESTENV_CA={shlex.quote(endpoint.ca)}",
        f'export PATH={shlex.quote(endpoint.bin_dir)}:"$PATH"',
    ]
    return "\n".join(lines)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _running_state(directory: Path) -> tuple[Endpoint, int] | None:
    state = directory / "state.json"
    if not state.exists():
        return None
    supervisor = int((directory / "supervisor.pid").read_text())
    if not _alive(supervisor):
        return None
    return load_state(state), supervisor


def cmd_build(args: argparse.Namespace) -> int:
    started = time.monotonic()
    binaries = assets.ensure_binaries()
    print(binaries["kube-apiserver"].parent)
    print(f"testenv: binaries ready in {time.monotonic() - started:.1f} s", file=sys.stderr)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    directory = run_dir(args.name)
    running = _running_state(directory)
    if running:
        print(f"testenv: {args.name!r} already up", file=sys.stderr)
        print(exports(running[0]))
        return 0
    assets.ensure_binaries()
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    started = time.monotonic()
    with open(directory / "supervisor.log", "ab") as log:
        supervisor = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tools.testenv",
                "_serve",
                "--name",
                args.name,
                "--nodes",
                str(args.nodes),
            ],
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    (directory / "supervisor.pid").write_text(f"{supervisor.pid}\n")
    while not (directory / "state.json").exists():
        if supervisor.poll() is not None:
            tail = (directory / "supervisor.log").read_text(errors="replace")[-4000:]
            print(f"testenv: control plane failed to start:\n{tail}", file=sys.stderr)
            return 1
        time.sleep(0.2)
    print(
        f"testenv: up in {time.monotonic() - started:.1f} s (logs: {directory}/cluster/logs)",
        file=sys.stderr,
    )
    print(exports(load_state(directory / "state.json")))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """The supervisor: owns the process group until SIGTERM, or until a component dies."""
    interrupt_on_termination()
    directory = run_dir(args.name)
    cluster = Cluster(directory / "cluster", assets.ensure_binaries(), node_count=args.nodes)
    try:
        cluster.start()
        state = directory / "state.json"
        tmp = state.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(cluster.endpoint()), indent=2) + "\n")
        tmp.rename(state)
        while True:
            dead = [n for n, p in cluster.group.procs.items() if p.poll() is not None]
            if dead:
                print(f"testenv: {dead} exited; stopping the control plane", file=sys.stderr)
                for name in dead:
                    print(cluster.log_tail(name), file=sys.stderr)
                return 1
            time.sleep(1)
    except KeyboardInterrupt:
        return 0
    finally:
        (directory / "state.json").unlink(missing_ok=True)
        cluster.stop()


def cmd_down(args: argparse.Namespace) -> int:
    directory = run_dir(args.name)
    state_file = directory / "state.json"
    pid_file = directory / "supervisor.pid"
    if pid_file.exists():
        supervisor = int(pid_file.read_text())
        if _alive(supervisor):
            os.kill(supervisor, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while _alive(supervisor) and time.monotonic() < deadline:
                time.sleep(0.1)
    if state_file.exists():
        # The supervisor did not clean up (killed hard): finish its job.
        kill_group(load_state(state_file).pgid)
    shutil.rmtree(directory, ignore_errors=True)
    print(f"testenv: {args.name!r} down", file=sys.stderr)
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    running = _running_state(run_dir(args.name))
    if not running:
        print(
            f"testenv: {args.name!r} is not up (run: python -m tools.testenv up)", file=sys.stderr
        )
        return 1
    print(exports(running[0]))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.testenv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build/fetch the pinned binaries (idempotent); print their dir")
    for name, text in (
        ("up", "start a control plane in the background; print shell exports"),
        ("down", "stop it"),
        ("env", "print the shell exports of the running control plane"),
        ("_serve", None),
    ):
        p = sub.add_parser(name, help=text) if text else sub.add_parser(name)
        p.add_argument("--name", default="default", help="run name, for several side by side")
        if name in ("up", "_serve"):
            p.add_argument("--nodes", type=int, default=2, help="fake GPU nodes (8 GPUs each)")
    args = parser.parse_args(argv)
    handlers = {
        "build": cmd_build,
        "up": cmd_up,
        "down": cmd_down,
        "env": cmd_env,
        "_serve": cmd_serve,
    }
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
