"""CLI: python -m tools.testenv {build,up,down,env}.

`up` leaves the control plane running under a detached supervisor process
(the owner of the process group, see procs.py) and prints shell exports;
`down` stops it; `env` prints the exports again. State lives in
<cache>/runs/<name>/state.json.

`--real-node` (build, up) adds a real node beside the kwok nodes: kubelet +
containerd + runc in a network namespace of its own, running hostNetwork
pods from images built from the repo's Dockerfiles (tools/testenv/README.md).
`build --real-node` installs its Debian packages and builds the images.
"""

from __future__ import annotations

import argparse
import concurrent.futures
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

from tools.testenv import assets, hostpkgs, images, nodeclean
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
    if not args.real_node:
        binaries = assets.ensure_binaries()
        print(binaries["kube-apiserver"].parent)
        print(f"testenv: binaries ready in {time.monotonic() - started:.1f} s", file=sys.stderr)
        return 0
    hostpkgs.ensure_packages()
    # The Go build is CPU-bound; the images mostly wait on PyPI, Debian and the disk:
    # build both at once (a cold set-up saves the shorter of the two).
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        binaries_job = pool.submit(assets.ensure_binaries)
        images_job = pool.submit(images.ensure_images)
        binaries = binaries_job.result()
        print(f"testenv: binaries ready in {time.monotonic() - started:.1f} s", file=sys.stderr)
        built = images_job.result()
    print(binaries["kube-apiserver"].parent)
    for name, ref in built.refs.items():
        print(f"testenv: image {name}: {ref}", file=sys.stderr)
    print(f"testenv: real node set-up ready in {time.monotonic() - started:.1f} s "
          f"(images built: {built.seconds or 'none, all cached'})", file=sys.stderr)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    directory = run_dir(args.name)
    running = _running_state(directory)
    if running:
        print(f"testenv: {args.name!r} already up", file=sys.stderr)
        print(exports(running[0]))
        return 0
    if args.real_node:
        hostpkgs.ensure_packages()
        images.ensure_images()
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
                *(["--real-node"] if args.real_node else []),
                *([f"--images={args.images}"] if args.images else []),
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
    names = [n for n in args.images.split(",") if n] if args.images else None
    spec = images.node_spec(names=names) if args.real_node else None
    cluster = Cluster(
        directory / "cluster", assets.ensure_binaries(), node_count=args.nodes, real_node=spec
    )
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
    node_state = directory / "cluster" / "node" / "node.json"
    if node_state.exists():
        # Normally the node's guard has done this already; do it if it could not.
        for problem in nodeclean.teardown(node_state):
            print(f"testenv: {problem}", file=sys.stderr)
    left = nodeclean.mounts_under(str(directory.resolve()))
    if left:
        # Removing the directory would delete what those mounts show.
        print(f"testenv: mounts left under {directory}, kept: {left}", file=sys.stderr)
        return 1
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
    build = sub.add_parser(
        "build", help="build/fetch the pinned binaries (idempotent); print their dir"
    )
    build.add_argument(
        "--real-node",
        action="store_true",
        help="also install the real node's Debian packages and build its images",
    )
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
            p.add_argument(
                "--real-node",
                action="store_true",
                help="also run a real node (kubelet + containerd + runc; root, Debian packages,"
                " images: built on first use, minutes)",
            )
            p.add_argument(
                "--images",
                default="",
                help="with --real-node: load only these images (comma-separated, e.g."
                " pause,python) into the node; default all",
            )
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
