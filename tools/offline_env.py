"""Carry a Python environment to a machine without network, one chunk per call.

The GPU machine this project measures on reaches nothing outside itself, and
each call to it carries at most 64 MiB of the working tree (the tracked files
plus the ignored paths the call names in ``carry``). An engine's wheels are
gigabytes, so they travel in chunks, one call each, into a store under /tmp
that lives as long as the machine stays warm:

    here:    python3 tools/offline_env.py pack --out .offline/vllm .whl-vllm/*.whl
    device:  python3 tools/offline_env.py receive .offline/vllm/07 --store /tmp/wc-env
             (one call per chunk, carry=[".offline/vllm/07"]; any order; repeats are skipped)
    device:  python3 tools/offline_env.py install --store /tmp/wc-env --target /tmp/site

``pack`` concatenates the members (wheels as they are; a directory as one
xz-compressed tar) and cuts the stream into chunks of equal size, each in a
folder of its own (``<out>/<NN>/chunk-NN`` beside a copy of
``manifest.json``: the sha256 of every chunk and every member), so a call
carries exactly one path. The chunk size is what fits beside the checkout:
64 MiB less the files git would send less 1 MiB of slack (the manifest, and
the tree growing between ``pack`` and the last call); run ``pack`` in the
checkout that makes the calls, just before. ``receive`` verifies each chunk
it is given and stores it; a chunk already stored and verified is skipped,
a corrupt one is refused by name, and the output says which chunks are still
missing (a machine that went back and came again bare shows it: its store
starts empty). ``install`` checks every chunk again, reassembles each member
and checks its sum, then runs one ``pip install --no-index --no-deps
--no-compile --upgrade --target`` for the wheels (one invocation: pip
replaces top-level folders such as ``nvidia/`` wholesale on ``--upgrade``, so
several would undo each other) and unpacks the tars; a target already holding
this pack is left alone.

Cost, measured on the H200 machine (2026-12-02): about 7 s of device time per
warm call carrying one 60 MiB part (13 parts in about 1.5 min), so the chunk
count times 7 s is what a transfer costs. The machine goes back after 30 s
idle and /tmp goes with it, so the calls must follow one another.

Wheels are stored as they are, not recompressed: measured here, the bulk of
them is CUDA machine code that their own deflate leaves as it is (the torch
2.14 wheel is 555 MB for 1,144 MB of files) and xz gets little more out of
(a 40 MiB slice of ``libtorch_cuda.so``: deflate 99.8 %, xz -6 83 %; of
``libnccl.so``: xz -6 91 %, while the NCCL wheel's deflate already gives 85 %),
at a few MB/s per core, and the GPU machine would spend the seconds saved on
decompressing. Directories (a prepared site-packages) are packed as xz.

``lock`` writes a pip requirements file pinning a directory of wheels by
name, version and sha256 (the committed record of a set); ``fetch``
downloads such a set again with pip for the GPU machine's Python and
platform (``--require-hashes``: the same bytes or nothing).

Standard library only: it runs under the GPU machine's plain python3.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

FORMAT = "weightcache-offline-env/1"
MiB = 1 << 20
# What one call to the GPU machine may carry: the working tree and the carried paths.
CARRY_LIMIT = 64 * MiB
# Room for this chunk's manifest copy and for the tree to grow before the last call.
CARRY_SLACK = 1 * MiB
# Below this a transfer takes more calls than it is worth: something else fills the tree.
MIN_CHUNK = 8 * MiB
SECONDS_PER_CHUNK = 7  # device time per warm call carrying one chunk (measured, above)
BLOCK = 8 * MiB
MANIFEST = "manifest.json"
INSTALLED_MARKER = ".weightcache-offline-env.json"
# The GPU machine: CPython 3.12 on x86-64 glibc. pip matches manylinux tags exactly, so
# every tag a wheel of the set uses is listed.
PYTHON_VERSION = "3.12"
PLATFORMS = tuple(
    f"manylinux_2_{n}_x86_64" for n in (5, 12, 17, 18, 24, 26, 27, 28, 31, 34, 35)
) + ("manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64")
ABIS = ("cp312", "abi3", "none")


class OfflineEnvError(Exception):
    """A refusal the user can act on; the message says what and where."""


# --------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class Member:
    """One file of the payload: a wheel as it is, or a directory as an xz tar."""

    name: str
    kind: str  # "wheel" | "tar.xz"
    offset: int
    size: int
    sha256: str


@dataclass(frozen=True)
class Chunk:
    index: int
    size: int
    sha256: str

    def dirname(self, count: int) -> str:
        return f"{self.index:0{_width(count)}d}"

    def filename(self, count: int) -> str:
        return f"chunk-{self.dirname(count)}"


@dataclass(frozen=True)
class Manifest:
    chunk_bytes: int
    members: tuple[Member, ...]
    chunks: tuple[Chunk, ...]

    @property
    def total_bytes(self) -> int:
        return sum(m.size for m in self.members)

    @property
    def pack_id(self) -> str:
        """Names the payload and its cut: equal ids, equal bytes in equal chunks."""
        members = [(m.name, m.kind, m.offset, m.size, m.sha256) for m in self.members]
        chunks = [(c.index, c.size, c.sha256) for c in self.chunks]
        table = json.dumps([self.chunk_bytes, members, chunks])
        return hashlib.sha256(table.encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "pack_id": self.pack_id,
                "chunk_bytes": self.chunk_bytes,
                "total_bytes": self.total_bytes,
                "members": [vars(m) for m in self.members],
                "chunks": [vars(c) for c in self.chunks],
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str, where: Path) -> Manifest:
        try:
            data = json.loads(text)
            if data.get("format") != FORMAT:
                raise OfflineEnvError(f"{where}: not a {FORMAT} manifest")
            manifest = cls(
                chunk_bytes=data["chunk_bytes"],
                members=tuple(Member(**m) for m in data["members"]),
                chunks=tuple(Chunk(**c) for c in data["chunks"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise OfflineEnvError(f"{where}: unreadable manifest ({exc})") from exc
        if manifest.pack_id != data.get("pack_id"):
            raise OfflineEnvError(f"{where}: the manifest's pack id does not match its table")
        return manifest

    @classmethod
    def read(cls, path: Path) -> Manifest:
        try:
            return cls.from_json(path.read_text(), path)
        except OSError as exc:
            raise OfflineEnvError(f"{path}: {exc.strerror}") from exc


def _width(count: int) -> int:
    return max(2, len(str(count - 1)))


# --------------------------------------------------------------------------- pack


def wheel_project(filename: str) -> str:
    """The normalised project name of a wheel file name (PEP 427, PEP 503)."""
    if not filename.endswith(".whl") or filename.count("-") < 4:
        raise OfflineEnvError(f"{filename}: not a wheel file name")
    return re.sub(r"[-_.]+", "-", filename.split("-", 1)[0]).lower()


def carry_tree_bytes(root: Path) -> int:
    """The bytes a call to the GPU machine sends besides carried paths: files git tracks or
    would track (not ignored), and ``shared/`` if the checkout has one."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root, check=True, capture_output=True,
    ).stdout.decode().split("\0")  # fmt: skip
    paths = {root / p for p in listed if p}
    shared = root / "shared"
    if shared.is_dir():
        paths.update(p for p in shared.rglob("*") if p.is_file())
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def auto_chunk_bytes(tree_bytes: int) -> int:
    """The largest whole-MiB chunk that travels beside a tree of ``tree_bytes``."""
    chunk = (CARRY_LIMIT - CARRY_SLACK - tree_bytes) // MiB * MiB
    if chunk < MIN_CHUNK:
        raise OfflineEnvError(
            f"the working tree sends {tree_bytes:,} bytes of the {CARRY_LIMIT:,} a call may "
            f"carry: {chunk:,} bytes left for a chunk (less than {MIN_CHUNK:,}); "
            "ignore or remove what need not travel"
        )
    return chunk


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _tar_xz(directory: Path, out: Path) -> None:
    # Entries relative to the directory: it unpacks into the target's root.
    with tarfile.open(out, "w:xz", preset=6) as tar:
        for entry in sorted(directory.iterdir()):
            tar.add(entry, arcname=entry.name)


def pack(inputs: Sequence[Path], out: Path, chunk_bytes: int) -> Manifest:
    """Pack wheels and directories into ``out``: ``out/manifest.json`` and one folder per
    chunk (``out/NN/chunk-NN`` and a copy of the manifest). ``out`` is replaced."""
    if chunk_bytes <= 0:
        raise OfflineEnvError("the chunk size must be positive")
    projects: dict[str, Path] = {}
    for path in inputs:
        if path.is_file() and path.name.endswith(".whl"):
            project = wheel_project(path.name)
            if project in projects:
                # pip refuses two versions of one project in one install.
                raise OfflineEnvError(
                    f"two wheels of {project}: {projects[project].name} and {path.name}"
                )
            projects[project] = path
        elif not path.is_dir():
            raise OfflineEnvError(f"{path}: neither a wheel nor a directory")
    if out.exists():
        if not (out / MANIFEST).is_file() and any(out.iterdir()):
            raise OfflineEnvError(f"{out} exists and holds no earlier pack: not replacing it")
        shutil.rmtree(out)
    build = out / ".build"
    build.mkdir(parents=True)
    sources: list[tuple[Path, str, str]] = []  # (file, member name, kind)
    for path in inputs:
        if path.is_dir():
            tar = build / f"{path.resolve().name}.tar.xz"
            _tar_xz(path, tar)
            sources.append((tar, tar.name, "tar.xz"))
        else:
            sources.append((path, path.name, "wheel"))
    names = [name for _, name, _ in sources]
    if len(set(names)) != len(names):
        raise OfflineEnvError(f"two members share a name: {sorted(names)}")

    members, offset = [], 0
    for path, name, kind in sources:
        size = path.stat().st_size
        members.append(Member(name, kind, offset, size, _sha256_file(path)))
        offset += size
    count = max(1, -(-offset // chunk_bytes))
    with _ChunkWriter(out, chunk_bytes, count) as writer:
        for path, _, _ in sources:
            with path.open("rb") as f:
                while block := f.read(BLOCK):
                    writer.write(block)
        chunks = writer.finish()
    manifest = Manifest(chunk_bytes, tuple(members), tuple(chunks))
    text = manifest.to_json()
    (out / MANIFEST).write_text(text)
    for chunk in chunks:
        (out / chunk.dirname(count) / MANIFEST).write_text(text)
    shutil.rmtree(build)
    return manifest


class _ChunkWriter:
    """Cuts one byte stream into ``out/NN/chunk-NN`` files, hashing each."""

    def __init__(self, out: Path, chunk_bytes: int, count: int) -> None:
        self.out, self.chunk_bytes, self.count = out, chunk_bytes, count
        self.chunks: list[Chunk] = []
        self._file = None
        self._digest = hashlib.sha256()
        self._size = 0

    def __enter__(self) -> _ChunkWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self._file is None:
                self._open()
            take = min(len(view), self.chunk_bytes - self._size)
            self._file.write(view[:take])
            self._digest.update(view[:take])
            self._size += take
            view = view[take:]
            if self._size == self.chunk_bytes:
                self._close()

    def finish(self) -> list[Chunk]:
        if self._file is None and not self.chunks:  # an empty payload: one empty chunk
            self._open()
        if self._file is not None:
            self._close()
        if len(self.chunks) != self.count:
            raise OfflineEnvError(f"wrote {len(self.chunks)} chunks, expected {self.count}")
        return self.chunks

    def _open(self) -> None:
        chunk = Chunk(len(self.chunks), 0, "")
        folder = self.out / chunk.dirname(self.count)
        folder.mkdir()
        self._file = (folder / chunk.filename(self.count)).open("wb")
        self._digest, self._size = hashlib.sha256(), 0

    def _close(self) -> None:
        assert self._file is not None
        self._file.close()
        self._file = None
        self.chunks.append(Chunk(len(self.chunks), self._size, self._digest.hexdigest()))


# --------------------------------------------------------------------------- the store


@dataclass(frozen=True)
class StoreStatus:
    manifest: Manifest
    present: tuple[int, ...]

    @property
    def missing(self) -> tuple[int, ...]:
        have = set(self.present)
        return tuple(c.index for c in self.manifest.chunks if c.index not in have)

    def describe(self) -> str:
        count = len(self.manifest.chunks)
        line = (
            f"{len(self.present)} of {count} chunks of pack {self.manifest.pack_id} "
            f"({self.manifest.total_bytes:,} bytes)"
        )
        if self.missing:
            line += f"; missing {ranges(self.missing, _width(count))}"
        else:
            line += "; complete"
        return line


def ranges(indices: Iterable[int], width: int = 2) -> str:
    """``0 1 2 5 7 8`` -> ``00-02, 05, 07-08``."""
    spans: list[list[int]] = []
    for i in sorted(indices):
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(
        f"{a:0{width}d}" if a == b else f"{a:0{width}d}-{b:0{width}d}" for a, b in spans
    )


class Store:
    """Verified chunks of one pack under a directory (``/tmp/...`` on the GPU machine)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.chunks_dir = root / "chunks"

    def manifest(self) -> Manifest | None:
        path = self.root / MANIFEST
        return Manifest.read(path) if path.exists() else None

    def adopt(self, manifest: Manifest, where: Path) -> None:
        """Take ``manifest`` as the store's pack; refuse another pack's chunks."""
        held = self.manifest()
        if held is None:
            self.chunks_dir.mkdir(parents=True, exist_ok=True)
            _write_atomic(self.root / MANIFEST, manifest.to_json().encode())
        elif held.pack_id != manifest.pack_id:
            raise OfflineEnvError(
                f"{where} belongs to pack {manifest.pack_id}, the store {self.root} holds "
                f"pack {held.pack_id}: use another --store, or remove it"
            )

    def chunk_path(self, manifest: Manifest, chunk: Chunk) -> Path:
        return self.chunks_dir / chunk.filename(len(manifest.chunks))

    def verified(self, manifest: Manifest, chunk: Chunk) -> bool:
        path = self.chunk_path(manifest, chunk)
        return (
            path.is_file()
            and path.stat().st_size == chunk.size
            and _sha256_file(path) == chunk.sha256
        )

    def status(self) -> StoreStatus:
        manifest = self.manifest()
        if manifest is None:
            raise OfflineEnvError(f"{self.root} holds no pack yet (nothing received)")
        present = tuple(c.index for c in manifest.chunks if self.verified(manifest, c))
        return StoreStatus(manifest, present)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def chunk_sources(source: Path) -> list[tuple[Path, Path]]:
    """(manifest, chunk file) pairs under ``source``: one chunk's folder, or a whole pack."""
    if (source / MANIFEST).is_file() and any(source.glob("chunk-*")):
        return [(source / MANIFEST, p) for p in sorted(source.glob("chunk-*"))]
    found = sorted(p for p in source.glob("*/chunk-*") if (p.parent / MANIFEST).is_file())
    if not found:
        raise OfflineEnvError(f"{source}: no chunk here (expected <pack>/<NN>/chunk-NN)")
    return [(p.parent / MANIFEST, p) for p in found]


def receive(sources: Sequence[Path], store: Store) -> tuple[list[str], StoreStatus]:
    """Verify and store every chunk under ``sources``; returns what happened to each and the
    store's status. A chunk that fails its sum is refused (:class:`OfflineEnvError`)."""
    done: list[str] = []
    for source in sources:
        for manifest_path, path in chunk_sources(source):
            manifest = Manifest.read(manifest_path)
            count = len(manifest.chunks)
            by_name = {c.filename(count): c for c in manifest.chunks}
            chunk = by_name.get(path.name)
            if chunk is None:
                raise OfflineEnvError(f"{path}: not a chunk of pack {manifest.pack_id}")
            store.adopt(manifest, path)
            label = f"chunk {chunk.dirname(count)}"
            if store.verified(manifest, chunk):
                done.append(f"{label}: already stored, skipped")
                continue
            target = store.chunk_path(manifest, chunk)
            tmp = target.with_name(target.name + ".tmp")
            digest, size = hashlib.sha256(), 0
            with path.open("rb") as src, tmp.open("wb") as dst:
                while block := src.read(BLOCK):
                    digest.update(block)
                    size += len(block)
                    dst.write(block)
            if size != chunk.size or digest.hexdigest() != chunk.sha256:
                tmp.unlink()
                raise OfflineEnvError(
                    f"{label} ({path}) is corrupt: {size:,} bytes, sha256 "
                    f"{digest.hexdigest()[:16]}..., expected {chunk.size:,} bytes, "
                    f"{chunk.sha256[:16]}...; not stored"
                )
            os.replace(tmp, target)
            done.append(f"{label}: stored, {size:,} bytes, sha256 ok")
    return done, store.status()


# --------------------------------------------------------------------------- install


def _read_span(store: Store, manifest: Manifest, offset: int, size: int) -> Iterator[bytes]:
    """The payload's bytes [offset, offset + size), read across chunk files."""
    while size > 0:
        index, within = divmod(offset, manifest.chunk_bytes)
        chunk = manifest.chunks[index]
        with store.chunk_path(manifest, chunk).open("rb") as f:
            f.seek(within)
            take = min(size, chunk.size - within)
            left = take
            while left:
                block = f.read(min(BLOCK, left))
                if not block:
                    raise OfflineEnvError(f"chunk {index} ended early")
                left -= len(block)
                yield block
        offset += take
        size -= take


def assemble(store: Store) -> tuple[Manifest, list[tuple[Member, Path]]]:
    """Check every chunk, then rebuild every member under ``<store>/files`` and check its
    sum; refuses, naming them, while chunks are missing or corrupt."""
    status = store.status()
    if status.missing:
        raise OfflineEnvError(f"cannot install: {status.describe()}")
    manifest = status.manifest
    files = store.root / "files"
    files.mkdir(exist_ok=True)
    built = []
    for member in manifest.members:
        path = files / member.name
        if not (path.is_file() and path.stat().st_size == member.size
                and _sha256_file(path) == member.sha256):  # fmt: skip
            digest = hashlib.sha256()
            tmp = path.with_name(path.name + ".tmp")
            with tmp.open("wb") as out:
                for block in _read_span(store, manifest, member.offset, member.size):
                    digest.update(block)
                    out.write(block)
            if digest.hexdigest() != member.sha256:
                tmp.unlink()
                raise OfflineEnvError(f"{member.name}: sha256 differs from the manifest's")
            os.replace(tmp, path)
        built.append((member, path))
    return manifest, built


def install(store: Store, target: Path, python: str = sys.executable) -> str:
    """Install the store's pack into ``target`` (wheels through pip, tars unpacked)."""
    manifest, built = assemble(store)
    marker = target / INSTALLED_MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("pack_id") == manifest.pack_id:
        return f"{target} already holds pack {manifest.pack_id}; nothing to do"
    target.mkdir(parents=True, exist_ok=True)
    wheels = [str(path) for member, path in built if member.kind == "wheel"]
    if wheels:
        subprocess.run(
            [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
             "--no-cache-dir", "--upgrade", "--target", str(target), *wheels],
            check=True,
        )  # fmt: skip
    for member, path in built:
        if member.kind == "tar.xz":
            with tarfile.open(path, "r:xz") as tar:
                tar.extractall(target, filter="data")
    _write_atomic(
        marker,
        json.dumps({"pack_id": manifest.pack_id, "members": [m.name for m in manifest.members]})
        .encode(),
    )
    return (
        f"installed pack {manifest.pack_id} into {target}: {len(wheels)} wheel(s), "
        f"{len(built) - len(wheels)} tar(s), {manifest.total_bytes:,} bytes"
    )


# --------------------------------------------------------------------------- lock / fetch

_LOCK_LINE = re.compile(
    r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>\S+)\s+--hash=sha256:(?P<sha>[0-9a-f]{64})"
    r"\s+#\s+(?P<file>\S+\.whl)\s+(?P<size>[0-9,]+)\s+bytes\s*$"
)


@dataclass(frozen=True)
class Locked:
    name: str
    version: str
    sha256: str
    filename: str
    size: int

    def line(self) -> str:
        return (
            f"{self.name}=={self.version} --hash=sha256:{self.sha256}  "
            f"# {self.filename} {self.size:,} bytes"
        )


def lock_entries(wheels: Iterable[Path]) -> list[Locked]:
    """One pin per wheel: name and version from its file name, its sha256 and size."""
    entries = []
    for path in wheels:
        project = wheel_project(path.name)
        version = path.name.split("-")[1]
        entries.append(
            Locked(project, version, _sha256_file(path), path.name, path.stat().st_size)
        )
    return sorted(entries, key=lambda e: e.name)


def parse_lock(text: str) -> list[Locked]:
    """The pins of a lock file written by :func:`lock_entries` (comments and blanks skipped;
    any other line is refused)."""
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = _LOCK_LINE.match(line)
        if match is None:
            raise OfflineEnvError(f"line {number}: not a pin of this tool's format: {line!r}")
        entries.append(
            Locked(match["name"], match["version"], match["sha"], match["file"],
                   int(match["size"].replace(",", "")))
        )  # fmt: skip
    return entries


def pip_download_command(lock: Path, dest: Path, python: str = sys.executable) -> list[str]:
    """pip's command that fetches a lock file's wheels for the GPU machine."""
    command = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--require-hashes", "--python-version", PYTHON_VERSION,
               "--implementation", "cp"]  # fmt: skip
    for platform in PLATFORMS:
        command += ["--platform", platform]
    for abi in ABIS:
        command += ["--abi", abi]
    return command + ["-d", str(dest), "-r", str(lock)]


def check_fetched(entries: Sequence[Locked], dest: Path) -> list[str]:
    """What is wrong with ``dest`` against the lock (missing or differing files)."""
    problems = []
    for entry in entries:
        path = dest / entry.filename
        if not path.is_file():
            problems.append(f"{entry.filename}: missing")
        elif path.stat().st_size != entry.size or _sha256_file(path) != entry.sha256:
            problems.append(f"{entry.filename}: differs from the lock")
    return problems


# --------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="offline_env", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="cut wheels / directories into chunks that fit one call")
    p.add_argument("inputs", nargs="+", type=Path, help="wheel files and directories")
    p.add_argument("--out", required=True, type=Path, help="e.g. .offline/vllm (git-ignored)")
    p.add_argument("--chunk-mib", type=int,
                   help="chunk size (default: what fits beside this checkout's tree)")  # fmt: skip
    p = sub.add_parser("receive", help="verify and store chunks (on the GPU machine)")
    p.add_argument("sources", nargs="+", type=Path, help="a chunk's folder, or a whole pack")
    p.add_argument("--store", required=True, type=Path)
    p = sub.add_parser("status", help="which chunks a store holds")
    p.add_argument("--store", required=True, type=Path)
    p = sub.add_parser("install", help="verify everything, then install / unpack")
    p.add_argument("--store", required=True, type=Path)
    p.add_argument("--target", required=True, type=Path)
    p = sub.add_parser("lock", help="print pins (name, version, sha256, size) of wheels")
    p.add_argument("wheels", nargs="+", type=Path)
    p = sub.add_parser("fetch", help="download a lock file's wheels for the GPU machine")
    p.add_argument("lock", type=Path)
    p.add_argument("--dest", required=True, type=Path)
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except OfflineEnvError as exc:
        print(f"offline_env: {exc}", file=sys.stderr, flush=True)
        return 2


def _run(args: argparse.Namespace) -> int:
    say = _say
    started = time.monotonic()
    if args.command == "pack":
        if args.chunk_mib is not None:
            chunk = args.chunk_mib * MiB
        else:
            root = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], check=True,
                                       capture_output=True, text=True).stdout.strip())  # fmt: skip
            tree = carry_tree_bytes(root)
            chunk = auto_chunk_bytes(tree)
            say(f"the checkout {root} sends {tree:,} bytes a call: chunks of {chunk // MiB} MiB")
        manifest = pack(args.inputs, args.out, chunk)
        count = len(manifest.chunks)
        say(f"packed {len(manifest.members)} member(s), {manifest.total_bytes:,} bytes, into "
            f"{count} chunk(s) of {chunk:,} bytes under {args.out} (pack {manifest.pack_id}); "
            f"about {count * SECONDS_PER_CHUNK} s of device time to carry, one call each:")
        first = manifest.chunks[0].dirname(count)
        say(f"  carry=[\"{args.out}/{first}\"]  python3 tools/offline_env.py receive "
            f"{args.out}/{first} --store /tmp/wc-env   (and so on to "
            f"{manifest.chunks[-1].dirname(count)})")  # fmt: skip
    elif args.command == "receive":
        done, status = receive(args.sources, Store(args.store))
        for line in done:
            say(line)
        say(f"store {args.store}: {status.describe()}")
    elif args.command == "status":
        say(f"store {args.store}: {Store(args.store).status().describe()}")
    elif args.command == "install":
        say(install(Store(args.store), args.target))
        say(f"{time.monotonic() - started:.1f} s")
    elif args.command == "lock":
        entries = lock_entries(args.wheels)
        for entry in entries:
            print(entry.line())
        total = sum(e.size for e in entries)
        print(f"# {len(entries)} wheels, {total:,} bytes")
    elif args.command == "fetch":
        entries = parse_lock(args.lock.read_text())
        subprocess.run(pip_download_command(args.lock, args.dest), check=True)
        problems = check_fetched(entries, args.dest)
        if problems:
            raise OfflineEnvError("; ".join(problems))
        say(f"{len(entries)} wheels, {sum(e.size for e in entries):,} bytes in {args.dest}")
    return 0


def _say(line: str) -> None:
    print(f"offline_env: {line}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
