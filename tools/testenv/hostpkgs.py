"""Debian packages the real node needs, installed idempotently with apt.

The control plane is built from Go modules; the node's runtime is not:
containerd 1.6 and runc come from Debian, as do the image tools (buildah,
mmdebstrap) and the compiler for the static pause binary.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable

# Package -> why the real node needs it (the error on a machine without apt names both).
NODE_PACKAGES = {
    "containerd": "the container runtime kubelet talks CRI to",
    "runc": "the OCI runtime containerd starts containers with",
    "containernetworking-plugins": "the loopback CNI plugin (the node is Ready with it alone)",
    "buildah": "builds the images from the repo's Dockerfiles without a daemon",
    "mmdebstrap": "makes the Debian base root filesystem of the images",
    "gcc": "compiles the static pause binary from the Kubernetes module",
    "libc6-dev": "static libc for the pause binary",
    "iproute2": "creates the node's network namespace (ip netns)",
    "util-linux": "nsenter, mount and umount",
    "ca-certificates": "TLS to PyPI from inside image builds",
}

Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def installed(package: str) -> bool:
    result = subprocess.run(
        ["dpkg-query", "-W", "-f=${db:Status-Abbrev}", package],
        capture_output=True,
        text=True,
    )
    return result.returncode == 0 and result.stdout.startswith("ii")


def missing_packages(packages: Iterable[str] = NODE_PACKAGES) -> list[str]:
    if shutil.which("dpkg-query") is None:
        return list(packages)
    return [p for p in packages if not installed(p)]


def describe(packages: Iterable[str]) -> str:
    return "; ".join(f"{p} ({NODE_PACKAGES.get(p, 'needed')})" for p in packages)


def ensure_packages(packages: Iterable[str] = NODE_PACKAGES, log: Log = _stderr) -> None:
    """Install whatever is missing with apt-get (as root); a no-op when all are present.

    Fails with a message naming each missing package and what it is for when
    this machine cannot install them (no apt, not root, apt failing).
    """
    missing = missing_packages(packages)
    if not missing:
        return
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        raise RuntimeError(
            "testenv: the real node needs Debian packages that are not installed: "
            f"{describe(missing)}; install them as root with apt-get "
            "(this machine has no apt-get or this is not root)"
        )
    log(f"testenv: apt-get install {' '.join(missing)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = [
        "apt-get",
        "install",
        "-y",
        "-q",
        "--no-install-recommends",
        *missing,
    ]
    result = subprocess.run(install, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        # Fresh machines often have no (or stale) package lists.
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=False)
        result = subprocess.run(install, env=env, capture_output=True, text=True)
    still = missing_packages(missing)
    if result.returncode != 0 or still:
        raise RuntimeError(
            f"testenv: apt-get could not install {describe(still or missing)}:\n"
            + (result.stderr or result.stdout)[-3000:]
        )
