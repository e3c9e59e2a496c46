"""Container images for the real node, built without Docker and cached by their inputs.

Layers, bottom up (each an image in buildah's store, tagged with a digest of
everything that went into it, so an unchanged input is never rebuilt):

- `python`: a Debian root filesystem made by mmdebstrap (python3, pip), the
  local stand-in for the Dockerfiles' public `python:*-slim` base;
- `torch`: `python` plus torch from PyPI (about 6 GB with its CUDA wheels,
  the only torch reachable here), keyed by the torch version alone, so code
  changes rebuild only the thin layers above it;
- `operator` (also the CSI plugin's), `sidecar`, `minilm-engine`: the repository's
  Dockerfiles, built
  by `buildah bud --isolation chroot` with `BASE_IMAGE` pointing at the local
  base (`operator` on `python`: no torch);
- `pause`: kubelet's sandbox image, `build/pause/linux/pause.c` of the pinned
  Kubernetes module compiled with `gcc -static`.

Images reach the node's containerd as docker archives (`buildah push ... |
ctr images import`), named `localhost/weightcache/<name>:<key>` and run with
`imagePullPolicy: Never`; nothing is pulled from a registry.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tools import csi_stubs
from tools.testenv import assets
from tools.testenv.node import NodeSpec
from tools.testenv.nodeconfig import DEFAULT_NAME

REPO = Path(__file__).resolve().parents[2]
PREFIX = "localhost/weightcache"
DEBIAN_SUITE = "bookworm"
DEBIAN_PACKAGES = ("python3", "python3-pip", "python-is-python3", "ca-certificates")
# The torch layer; numpy because torch warns on import without it (as pytorch/pytorch ships it).
TORCH_REQUIREMENTS = ("torch==2.15.0", "numpy==2.4.6")
PAUSE_VERSION = "3.10.1"
PAUSE_CFLAGS = ("-Os", "-Wall", "-Werror", "-static", f"-DVERSION=v{PAUSE_VERSION}-weightcache")
ENV_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
HOST_PIP_CONF = Path("/etc/pip.conf")
# Every builder and importer runs with this umask, whatever the caller's: files an
# image gets (and the directories containerd unpacks them into) must not depend on
# it. A test process once ran with 0117 (a race elsewhere), and the images it
# built and imported had root directories other uids could not enter.
UMASK = 0o022
# Files no build reads (the Dockerfiles' .dockerignore drops them too).
IGNORED_PARTS = ("__pycache__", ".pytest_cache", ".ruff_cache")
IGNORED_SUFFIXES = (".pyc", ".egg-info")

Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class DockerfileImage:
    """An image built from a Dockerfile of the repository, with the repo root as context."""

    name: str
    dockerfile: str
    base: str  # the image BASE_IMAGE points at: "python", "torch" or another DockerfileImage
    inputs: tuple[str, ...]  # repo paths the build context sends (as its .dockerignore says)
    build_args: tuple[tuple[str, str], ...] = field(default=())


DOCKERFILE_IMAGES = (
    DockerfileImage("operator", "operator/Dockerfile", "python",
                    ("pyproject.toml", "sidecar", "operator", "csi")),
    DockerfileImage("sidecar", "sidecar/Dockerfile", "torch",
                    ("pyproject.toml", "sidecar", "operator")),
    DockerfileImage("minilm-engine", "examples/minilm-engine.Dockerfile", "torch",
                    ("pyproject.toml", "sidecar", "operator",
                     "examples/minilm_engine.py", "examples/minilm_engine_pod.py")),
)
IMAGE_NAMES = ("pause", "python", "torch", *(i.name for i in DOCKERFILE_IMAGES))


def cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    return assets.cache_root(env) / "images"


def digest_inputs(parts: Iterable[bytes | str], paths: Iterable[Path] = (),
                  root: Path = REPO) -> str:
    """Hex digest of the recipe parts and every file under paths (names and contents)."""
    h = hashlib.sha256()
    for part in parts:
        h.update((part.encode() if isinstance(part, str) else part) + b"\0")
    for path in paths:
        for file in sorted(_files(path)):
            h.update(str(file.relative_to(root)).encode() + b"\0")
            h.update(file.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _files(path: Path) -> Iterator[Path]:
    if path.is_file():
        yield path
        return
    for file in path.rglob("*"):
        if not file.is_file() or any(p in IGNORED_PARTS for p in file.parts):
            continue
        if file.suffix in IGNORED_SUFFIXES or any(p.endswith(".egg-info") for p in file.parts):
            continue
        yield file


class Buildah:
    """buildah on a store of our own in the cache (not the machine's /var/lib/containers)."""

    def __init__(self, root: Path, log: Log = _stderr) -> None:
        self.root = root
        self.log = log

    def argv(self, *args: str) -> list[str]:
        return ["buildah", f"--root={self.root / 'storage'}", f"--runroot={self.root / 'run'}",
                "--storage-driver=overlay", *args]

    def __call__(self, *args: str, capture: bool = True) -> str:
        """Run buildah; uncaptured output goes to stderr (stdout may be `up`'s exports)."""
        if capture:
            result = subprocess.run(self.argv(*args), capture_output=True, text=True,
                                    umask=UMASK)
        else:
            result = subprocess.run(self.argv(*args), stdout=sys.stderr, text=True, umask=UMASK)
        if result.returncode != 0:
            detail = (result.stderr or "")[-4000:] if capture else ""
            raise RuntimeError(f"buildah {' '.join(args)} failed ({result.returncode}): {detail}")
        return result.stdout if capture else ""

    def tags(self) -> set[str]:
        out = self("images", "--format", "{{.Name}}:{{.Tag}}")
        return {line.strip() for line in out.splitlines() if line.strip()}

    def sizes(self) -> dict[str, str]:
        out = self("images", "--format", "{{.Name}}:{{.Tag}} {{.Size}}")
        return dict(line.split(" ", 1) for line in out.splitlines() if " " in line)

    def network_volumes(self) -> list[str]:
        """Bind the host's CA bundle and pip config into RUN steps that reach PyPI."""
        volumes = []
        for path in (HOST_CA_BUNDLE, HOST_PIP_CONF):
            if path.exists():
                volumes += ["--volume", f"{path}:{path}:ro"]
        return volumes


@dataclass
class ImageSet:
    """What ensure_images built: name -> ref, plus the figures the set-up measured."""

    refs: dict[str, str]
    seconds: dict[str, float]
    built: list[str]
    buildah_root: Path

    def loader(self, names: Sequence[str] | None = None) -> Callable[[list[str], Log], None]:
        """For RealNode: import the named images into its containerd. The default, all
        but the torch base (whose layers arrive with the images built on it), also
        deletes older generations from the store; a subset leaves the rest alone."""
        wanted = [self.refs[n] for n in (names or [n for n in self.refs if n != "torch"])]
        buildah = Buildah(self.buildah_root)

        def load(ctr: list[str], log: Log) -> None:
            import_into(buildah, ctr, wanted, log, prune=names is None)

        return load


def node_spec(log: Log = _stderr, name: str = DEFAULT_NAME,
              names: Sequence[str] | None = None) -> NodeSpec:
    """Build (or find) every image and describe the real node that runs them (`names`
    only, when given: a quicker start on a cold store)."""
    images = ensure_images(log)
    unknown = set(names or ()) - set(images.refs)
    if unknown:
        raise ValueError(f"no such images: {sorted(unknown)} (known: {sorted(images.refs)})")
    return NodeSpec(pause_image=images.refs["pause"], load_images=images.loader(names),
                    store_cache=cache_dir(), name=name)


def _kubernetes_module_dir() -> Path:
    """The pinned k8s.io/kubernetes module source (downloaded by the control-plane build)."""
    out = subprocess.run(
        [assets._go(), "mod", "download", "-json", "k8s.io/kubernetes"],
        cwd=assets.SOURCE_DIR / "controlplane", capture_output=True, text=True, check=True,
        env={**os.environ, **assets.GO_BUILD_ENV},
    ).stdout
    return Path(json.loads(out)["Dir"])


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def ensure_images(log: Log = _stderr, env: Mapping[str, str] = os.environ) -> ImageSet:
    """Build whatever image is missing for the current inputs; return every ref.

    Idempotent and safe across processes (a lock); a warm call only lists tags.
    Old tags of the same images are removed afterwards, so the store holds one
    generation (plus the torch layer, which rarely changes).
    """
    # The operator image carries the CSI plugin, whose stubs are generated, not committed.
    csi_stubs.generate()
    root = cache_dir(env)
    buildah = Buildah(root / "buildah", log)
    seconds: dict[str, float] = {}
    built: list[str] = []
    with _locked(root / "build.lock"):
        present = buildah.tags()
        refs: dict[str, str] = {}

        def need(name: str, key: str, build: Callable[[str], None]) -> None:
            ref = f"{PREFIX}/{name}:{key}"
            refs[name] = ref
            if ref in present:
                return
            log(f"testenv: building image {ref}")
            started = time.monotonic()
            build(ref)
            seconds[name] = round(time.monotonic() - started, 1)
            built.append(name)
            log(f"testenv: built {ref} in {seconds[name]} s")

        pause_c = _kubernetes_module_dir() / "build" / "pause" / "linux" / "pause.c"
        need("pause", digest_inputs([*PAUSE_CFLAGS, pause_c.read_bytes()]),
             lambda ref: _build_pause(buildah, pause_c, ref))
        need("python", digest_inputs([DEBIAN_SUITE, *DEBIAN_PACKAGES, ENV_PATH, "v1"]),
             lambda ref: _build_python(buildah, ref))
        need("torch", digest_inputs([refs["python"], *TORCH_REQUIREMENTS]),
             lambda ref: _build_torch(buildah, refs["python"], ref))
        for image in DOCKERFILE_IMAGES:
            base = refs[image.base]
            key = digest_inputs([base, image.dockerfile, *map("=".join, image.build_args)],
                                [REPO / image.dockerfile, *(REPO / p for p in image.inputs)])
            need(image.name, key,
                 lambda ref, i=image, b=base: _build_dockerfile(buildah, i, b, ref))
        _prune(buildah, set(refs.values()))
    return ImageSet(refs, seconds, built, buildah.root)


# Another checkout sharing the cache (a worktree of other sources) builds its own
# generation beside ours and imports it into its node minutes later: a generation
# is pruned only once it is this old, never while a concurrent run may still need it.
PRUNE_AFTER_SECONDS = 3 * 3600


def _prune(buildah: Buildah, keep: set[str]) -> None:
    """Drop older generations of our images (older than PRUNE_AFTER_SECONDS) and whatever
    they alone held."""
    buildah("rm", "--all")
    out = buildah("images", "--format", "{{.Name}}:{{.Tag}} {{.CreatedAtRaw}}")
    for ref, _ in stale_generations(out, keep, time.time()):
        buildah("rmi", "--force", ref)
    buildah("rmi", "--prune")


def stale_generations(listing: str, keep: set[str], now: float
                      ) -> list[tuple[str, float]]:
    """From `buildah images` lines `<ref> <created>`: our refs not kept and old enough to go.
    A creation time that cannot be read counts as old."""
    stale = []
    for line in listing.splitlines():
        ref, _, created = line.strip().partition(" ")
        if not ref.startswith(PREFIX + "/") or ref in keep:
            continue
        when = _created(created.strip())
        if when is None or now - when >= PRUNE_AFTER_SECONDS:
            stale.append((ref, when or 0.0))
    return stale


def _created(text: str) -> float | None:
    """buildah's CreatedAtRaw, e.g. `2026-12-01 16:17:09.883210333 +0000 UTC`, as epoch seconds."""
    import datetime

    parts = text.split()
    if len(parts) < 3:
        return None
    try:
        day = datetime.datetime.strptime(f"{parts[0]} {parts[1][:15]} {parts[2]}",
                                         "%Y-%m-%d %H:%M:%S.%f %z")
    except ValueError:
        try:
            day = datetime.datetime.strptime(f"{parts[0]} {parts[1][:8]} {parts[2]}",
                                             "%Y-%m-%d %H:%M:%S %z")
        except ValueError:
            return None
    return day.timestamp()


def _build_pause(buildah: Buildah, source: Path, ref: str) -> None:
    with tempfile.TemporaryDirectory(prefix="wc-pause-") as tmp:
        binary = Path(tmp) / "pause"
        subprocess.run(["gcc", *PAUSE_CFLAGS, "-o", str(binary), str(source)], check=True,
                       umask=UMASK)
        container = buildah("from", "scratch").strip()
        try:
            buildah("copy", "--chmod", "0755", container, str(binary), "/pause")
            buildah("config", "--entrypoint", '["/pause"]', "--user", "65535:65535", container)
            buildah("commit", "--quiet", container, ref)
        finally:
            buildah("rm", container)


def _build_python(buildah: Buildah, ref: str) -> None:
    with tempfile.TemporaryDirectory(prefix="wc-rootfs-", dir=buildah.root) as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        result = subprocess.run(
            ["mmdebstrap", "--variant=minbase", f"--include={','.join(DEBIAN_PACKAGES)}",
             # Like python:*-slim: pip installs into the system interpreter.
             "--customize-hook=rm -f \"$1\"/usr/lib/python3*/EXTERNALLY-MANAGED",
             DEBIAN_SUITE, str(rootfs)],
            capture_output=True, text=True, umask=UMASK,
        )
        if result.returncode != 0:
            raise RuntimeError(f"mmdebstrap failed: {result.stderr[-3000:]}")
        container = buildah("from", "scratch").strip()
        try:
            buildah("add", container, str(rootfs), "/")
            buildah("config", "--env", ENV_PATH, "--env", "LANG=C.UTF-8", "--cmd", "python3",
                    container)
            buildah("commit", "--quiet", container, ref)
        finally:
            buildah("rm", container)


def _build_torch(buildah: Buildah, python_ref: str, ref: str) -> None:
    container = buildah("from", "--pull=never", python_ref).strip()
    try:
        buildah("run", "--isolation=chroot", *buildah.network_volumes(), container, "--",
                "pip", "install", "--no-cache-dir", "--root-user-action=ignore",
                *TORCH_REQUIREMENTS, capture=False)
        buildah("commit", "--quiet", container, ref)
    finally:
        buildah("rm", container)


def _build_dockerfile(buildah: Buildah, image: DockerfileImage, base: str, ref: str) -> None:
    ignore = REPO / f"{image.dockerfile}.dockerignore"
    args = ["bud", "--isolation=chroot", "--pull=never", "--quiet", "--layers=false",
            "-f", str(REPO / image.dockerfile), "--build-arg", f"BASE_IMAGE={base}",
            *(a for k, v in image.build_args for a in ("--build-arg", f"{k}={v}")),
            *buildah.network_volumes(), "-t", ref]
    if ignore.exists():
        args += ["--ignorefile", str(ignore)]
    buildah(*args, str(REPO), capture=False)


def import_into(buildah: Buildah, ctr: list[str], refs: Sequence[str], log: Log,
                prune: bool = True) -> None:
    """Make containerd hold `refs`: import what it lacks (a docker archive streamed from
    buildah); with `prune`, delete our other images (older generations)."""
    listed = subprocess.run([*ctr, "images", "list", "--quiet"], capture_output=True, text=True,
                            check=True).stdout.split()
    present = set(listed)
    for ref in refs:
        if ref in present:
            continue
        started = time.monotonic()
        push = subprocess.Popen(
            buildah.argv("push", "--quiet", ref, f"docker-archive:/dev/stdout:{ref}"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, umask=UMASK,
        )
        imported = subprocess.run([*ctr, "images", "import", "-"], stdin=push.stdout,
                                  capture_output=True, text=True, umask=UMASK)
        assert push.stdout is not None
        push.stdout.close()
        push_err = push.stderr.read().decode(errors="replace") if push.stderr else ""
        if push.wait() != 0 or imported.returncode != 0:
            raise RuntimeError(f"testenv: importing {ref} into containerd failed: "
                               f"{push_err[-2000:]} {imported.stderr[-2000:]}")
        log(f"testenv: imported {ref} into the node in {time.monotonic() - started:.1f} s")
        # At once, not after the last import: the next archive is ingested whole (a torch
        # image's 6 GB) before it unpacks, and a small disk once held no more.
        discard_unpacked_layers(ctr)
    if prune:
        listing = subprocess.run([*ctr, "images", "list"], capture_output=True, text=True,
                                 check=True).stdout
        stale = stale_images(listing, set(refs))
        if stale:
            subprocess.run([*ctr, "images", "remove", "--sync", *stale], capture_output=True,
                           check=True)
    discard_unpacked_layers(ctr)


def stale_images(images_list: str, wanted: set[str]) -> list[str]:
    """From `ctr images list` output: our images that are not wanted, and the `sha256:<id>`
    references CRI adds for every image, unless they point at a wanted one (they would keep
    an old generation's snapshots alive)."""
    rows = [line.split() for line in images_list.splitlines()[1:] if line.strip()]
    keep = {row[2] for row in rows if row[0] in wanted}
    return [row[0] for row in rows
            if row[0] not in wanted and row[2] not in keep
            and (row[0].startswith(PREFIX + "/") or row[0].startswith("sha256:"))]


def layer_digests(content_list: str) -> set[str]:
    """Layers the manifests in `ctr content list` output reference (their gc labels)."""
    layers = set()
    for line in content_list.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 2:
            continue
        for label in fields[-1].split(","):
            key, _, value = label.partition("=")
            if key.startswith("containerd.io/gc.ref.content.l."):
                layers.add(value)
    return layers


def discard_unpacked_layers(ctr: list[str]) -> None:
    """Delete the layer blobs once unpacked, as CRI's discard_unpacked_layers does for
    pulls: containers run from the snapshots, and the blobs would double the store
    (6 GB of torch). A later import writes a missing blob again and skips its unpack."""
    listing = subprocess.run([*ctr, "content", "list"], capture_output=True, text=True,
                             check=True).stdout
    present = {line.split()[0] for line in listing.splitlines()[1:] if line.strip()}
    layers = sorted(layer_digests(listing) & present)
    if layers:
        subprocess.run([*ctr, "content", "remove", *layers], capture_output=True, check=True)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m tools.testenv.images`: build (or find) every image; print name, ref, size."""
    del argv
    images = ensure_images()
    sizes = Buildah(images.buildah_root).sizes()
    for name, ref in images.refs.items():
        print(f"{name:14} {ref}  {sizes.get(ref, '?')}")
    if images.seconds:
        print(json.dumps({"built_seconds": images.seconds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
