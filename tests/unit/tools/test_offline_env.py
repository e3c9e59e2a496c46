"""tools/offline_env.py: wheels and directories cut into chunks, received in any order,
verified, reassembled and installed with the same bytes (real files, real pip)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tools import offline_env as oe

REPO = Path(__file__).resolve().parents[3]


def make_wheel(folder: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """A pure-Python wheel pip installs: ``files`` plus its dist-info (METADATA, WHEEL,
    RECORD with each file's hash)."""
    dist = f"{name}-{version}.dist-info"
    entries = dict(files)
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    entries[f"{dist}/METADATA"] = metadata.encode()
    entries[f"{dist}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = []
    for path, data in entries.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    entries[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as z:
        for path, data in entries.items():
            z.writestr(path, data)
    return wheel


@pytest.fixture
def payload(tmp_path: Path) -> dict:
    """Two wheels of random (incompressible) module data and a directory with an
    executable file, the kinds of member the tool packs."""
    rng = random.Random(1)
    src = tmp_path / "src"
    src.mkdir()
    alpha = {"alpha/__init__.py": b"X = 1\n", "alpha/data.bin": rng.randbytes(9000)}
    beta = {"beta/__init__.py": b"Y = 2\n", "beta/blob.bin": rng.randbytes(13000)}
    wheels = [make_wheel(src, "alpha", "1.0", alpha), make_wheel(src, "beta_pkg", "2.3", beta)]
    tree = src / "site"
    (tree / "gamma" / "sub").mkdir(parents=True)
    (tree / "gamma" / "__init__.py").write_text("Z = 3\n")
    (tree / "gamma" / "sub" / "table.bin").write_bytes(rng.randbytes(7000))
    tool = tree / "bin" / "tool"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\necho hi\n")
    tool.chmod(0o755)
    files = {**alpha, **{k: v for k, v in beta.items()}}
    return {"inputs": [*wheels, tree], "files": files, "tree": tree}


def chunk_dirs(out: Path) -> list[Path]:
    return sorted(p for p in out.iterdir() if p.is_dir() and (p / oe.MANIFEST).is_file())


def test_pack_then_chunks_in_any_order_with_a_repeat_install_the_same_bytes(
    tmp_path: Path, payload: dict
) -> None:
    out = tmp_path / "pack"
    manifest = oe.pack(payload["inputs"], out, chunk_bytes=4096)
    count = len(manifest.chunks)
    assert count == -(-manifest.total_bytes // 4096) and count > 5
    # Members straddle chunks: the reassembly reads across chunk files.
    assert any(m.offset // 4096 != (m.offset + m.size - 1) // 4096 for m in manifest.members)
    assert [m.kind for m in manifest.members] == ["wheel", "wheel", "tar.xz"]
    dirs = chunk_dirs(out)
    assert [d.name for d in dirs] == [f"{i:02d}" for i in range(count)]
    for d in dirs:  # one carried path holds everything a call needs
        assert sorted(p.name for p in d.iterdir()) == [f"chunk-{d.name}", oe.MANIFEST]

    store = oe.Store(tmp_path / "store")
    order = dirs[:]
    random.Random(7).shuffle(order)
    order.insert(3, order[1])  # the same chunk carried twice
    seen: set[int] = set()
    for d in order:
        done, status = oe.receive([d], store)
        index = int(d.name)
        if index in seen:
            assert done == [f"chunk {d.name}: already stored, skipped"]
        else:
            assert done[0].startswith(f"chunk {d.name}: stored")
        seen.add(index)
        assert set(status.present) == seen
        assert set(status.missing) == set(range(count)) - seen
    assert status.describe().endswith("; complete")

    target = tmp_path / "site"
    message = oe.install(store, target)
    assert f"pack {manifest.pack_id}" in message
    for rel, data in payload["files"].items():
        assert (target / rel).read_bytes() == data, rel
    for path in payload["tree"].rglob("*"):
        if path.is_file():
            unpacked = target / path.relative_to(payload["tree"])
            assert unpacked.read_bytes() == path.read_bytes()
            assert stat.S_IMODE(unpacked.stat().st_mode) & 0o100 == stat.S_IMODE(
                path.stat().st_mode
            ) & 0o100
    assert (target / "alpha-1.0.dist-info" / "METADATA").is_file()  # installed by pip
    assert "already holds" in oe.install(store, target)


def test_a_corrupt_chunk_is_refused_by_name_and_a_good_copy_then_stored(
    tmp_path: Path, payload: dict
) -> None:
    out = tmp_path / "pack"
    oe.pack(payload["inputs"], out, chunk_bytes=4096)
    dirs = chunk_dirs(out)
    bad = tmp_path / "bad" / dirs[3].name
    shutil.copytree(dirs[3], bad)
    data = bytearray((bad / f"chunk-{bad.name}").read_bytes())
    data[100] ^= 0x01
    (bad / f"chunk-{bad.name}").write_bytes(bytes(data))

    store = oe.Store(tmp_path / "store")
    oe.receive([dirs[0]], store)
    with pytest.raises(oe.OfflineEnvError, match=rf"chunk 03 \({bad}/chunk-03\) is corrupt"):
        oe.receive([bad], store)
    status = store.status()
    assert 3 in status.missing and status.present == (0,)
    assert not any(p.name.endswith(".tmp") for p in store.chunks_dir.iterdir())
    done, status = oe.receive([dirs[3]], store)
    assert done == ["chunk 03: stored, 4,096 bytes, sha256 ok"]
    assert status.present == (0, 3)


def test_a_stored_chunk_damaged_later_is_received_again_and_install_checks_every_chunk(
    tmp_path: Path, payload: dict
) -> None:
    out = tmp_path / "pack"
    manifest = oe.pack(payload["inputs"], out, chunk_bytes=4096)
    store = oe.Store(tmp_path / "store")
    oe.receive([out], store)  # a whole pack at once (local use)
    stored = store.chunk_path(manifest, manifest.chunks[2])
    stored.write_bytes(b"\0" * stored.stat().st_size)
    with pytest.raises(oe.OfflineEnvError, match=r"cannot install: .*missing 02$"):
        oe.install(store, tmp_path / "site")
    assert not (tmp_path / "site").exists()
    done, status = oe.receive([chunk_dirs(out)[2]], store)
    assert done[0].startswith("chunk 02: stored") and not status.missing


def test_install_refuses_while_chunks_are_missing_naming_them(
    tmp_path: Path, payload: dict
) -> None:
    out = tmp_path / "pack"
    manifest = oe.pack(payload["inputs"], out, chunk_bytes=4096)
    last = len(manifest.chunks) - 1
    store = oe.Store(tmp_path / "store")
    for d in chunk_dirs(out):
        if int(d.name) not in (1, 2, last):
            oe.receive([d], store)
    with pytest.raises(oe.OfflineEnvError, match=rf"missing 01-02, {last:02d}$"):
        oe.install(store, tmp_path / "site")


def test_a_store_refuses_chunks_of_another_pack(tmp_path: Path, payload: dict) -> None:
    first = oe.pack(payload["inputs"][:1], tmp_path / "one", chunk_bytes=4096)
    second = oe.pack(payload["inputs"][1:2], tmp_path / "two", chunk_bytes=4096)
    assert first.pack_id != second.pack_id
    store = oe.Store(tmp_path / "store")
    oe.receive([chunk_dirs(tmp_path / "one")[0]], store)
    with pytest.raises(oe.OfflineEnvError, match=f"belongs to pack {second.pack_id}"):
        oe.receive([chunk_dirs(tmp_path / "two")[0]], store)


def test_a_manifest_whose_table_was_edited_is_refused(tmp_path: Path, payload: dict) -> None:
    out = tmp_path / "pack"
    oe.pack(payload["inputs"], out, chunk_bytes=4096)
    path = chunk_dirs(out)[0] / oe.MANIFEST
    data = json.loads(path.read_text())
    data["chunks"][0]["sha256"] = "0" * 64
    path.write_text(json.dumps(data))
    with pytest.raises(oe.OfflineEnvError, match="pack id does not match"):
        oe.receive([path.parent], oe.Store(tmp_path / "store"))


def test_two_versions_of_one_project_are_refused(tmp_path: Path) -> None:
    a = make_wheel(tmp_path, "Foo_Bar", "1.0", {"foo/__init__.py": b""})
    b = make_wheel(tmp_path, "foo.bar", "2.0", {"foo/__init__.py": b""})
    with pytest.raises(oe.OfflineEnvError, match="two wheels of foo-bar"):
        oe.pack([a, b], tmp_path / "pack", chunk_bytes=4096)


def test_pack_replaces_an_earlier_pack_but_nothing_else(tmp_path: Path, payload: dict) -> None:
    out = tmp_path / "pack"
    oe.pack(payload["inputs"], out, chunk_bytes=4096)
    smaller = oe.pack(payload["inputs"][:1], out, chunk_bytes=4096)
    assert len(chunk_dirs(out)) == len(smaller.chunks)
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep").write_text("mine")
    with pytest.raises(oe.OfflineEnvError, match="holds no earlier pack"):
        oe.pack(payload["inputs"], other, chunk_bytes=4096)
    assert (other / "keep").read_text() == "mine"


@pytest.mark.parametrize("tree", [0, 5_248_475, 40 * oe.MiB + 1])
def test_the_automatic_chunk_is_the_largest_whole_mib_that_fits_beside_the_tree(tree: int):
    chunk = oe.auto_chunk_bytes(tree)
    assert chunk % oe.MiB == 0
    assert tree + chunk + oe.CARRY_SLACK <= oe.CARRY_LIMIT
    assert tree + chunk + oe.MiB + oe.CARRY_SLACK > oe.CARRY_LIMIT


def test_a_tree_too_large_for_a_useful_chunk_is_refused() -> None:
    with pytest.raises(oe.OfflineEnvError, match="ignore or remove"):
        oe.auto_chunk_bytes(oe.CARRY_LIMIT - oe.CARRY_SLACK - oe.MIN_CHUNK + 1)


def test_the_carried_tree_counts_tracked_and_untracked_files_but_not_ignored_ones(
    tmp_path: Path,
) -> None:
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / ".gitignore").write_text("/.offline/\n")
    (tmp_path / "tracked.txt").write_bytes(b"a" * 1000)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    (tmp_path / "untracked.txt").write_bytes(b"b" * 300)
    (tmp_path / ".offline").mkdir()
    (tmp_path / ".offline" / "chunk").write_bytes(b"c" * 5000)
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "note").write_bytes(b"d" * 70)
    expected = 1000 + 300 + 70 + len((tmp_path / ".gitignore").read_bytes())
    assert oe.carry_tree_bytes(tmp_path) == expected
    # shared/ travels even where git ignores it.
    (tmp_path / ".gitignore").write_text("/.offline/\n/shared/\n")
    expected = 1000 + 300 + 70 + len((tmp_path / ".gitignore").read_bytes())
    assert oe.carry_tree_bytes(tmp_path) == expected


def test_lock_pins_each_wheel_by_hash_and_size_and_reads_back(tmp_path: Path) -> None:
    wheels = [
        make_wheel(tmp_path, "zeta", "0.1", {"zeta.py": b"z"}),
        make_wheel(tmp_path, "Alpha_Beta", "3.2.1", {"ab.py": b"ab" * 50}),
    ]
    entries = oe.lock_entries(wheels)
    assert [e.name for e in entries] == ["alpha-beta", "zeta"]
    text = "# header\n\n" + "\n".join(e.line() for e in entries) + "\n"
    assert oe.parse_lock(text) == entries
    ab = entries[0]
    assert ab.sha256 == hashlib.sha256(wheels[1].read_bytes()).hexdigest()
    assert ab.size == wheels[1].stat().st_size and ab.version == "3.2.1"
    with pytest.raises(oe.OfflineEnvError, match="line 2"):
        oe.parse_lock("# x\nalpha==1.0\n")

    dest = tmp_path / "dest"
    dest.mkdir()
    shutil.copy(wheels[0], dest)
    (dest / wheels[1].name).write_bytes(b"not the wheel")
    assert oe.check_fetched(entries, dest) == [f"{wheels[1].name}: differs from the lock"]
    os.remove(dest / wheels[0].name)
    assert f"{wheels[0].name}: missing" in oe.check_fetched(entries, dest)


def test_fetch_asks_pip_for_the_gpu_machines_python_with_hashes_required(tmp_path: Path):
    command = oe.pip_download_command(tmp_path / "lock.txt", tmp_path / "d", python="py")
    assert command[:3] == ["py", "-m", "pip"]
    assert "--require-hashes" in command and "--no-deps" in command
    assert command[command.index("--python-version") + 1] == "3.12"
    assert command[-2:] == ["-r", str(tmp_path / "lock.txt")]
    platforms = {command[i + 1] for i, arg in enumerate(command) if arg == "--platform"}
    assert {"manylinux_2_28_x86_64", "manylinux2014_x86_64"} <= platforms


def test_ranges_name_runs_of_chunks() -> None:
    assert oe.ranges([7, 0, 1, 2, 5, 8]) == "00-02, 05, 07-08"
    assert oe.ranges([12], width=3) == "012"


def test_the_command_line_runs_under_an_isolated_python(tmp_path: Path, payload: dict) -> None:
    """As on the GPU machine: a plain interpreter (-I: no PYTHONPATH, no project), the
    tool run as a file, one chunk per call."""
    tool = str(REPO / "tools" / "offline_env.py")
    data = random.Random(3).randbytes(1_500_000)
    big = make_wheel(tmp_path, "big", "1.0", {"big/data.bin": data})

    def run(*args: str) -> str:
        result = subprocess.run([sys.executable, "-I", tool, *args], cwd=tmp_path,
                                capture_output=True, text=True)  # fmt: skip
        assert result.returncode == 0, result.stderr
        return result.stdout

    inputs = [str(big), *map(str, payload["inputs"])]
    printed = run("pack", "--out", "pk", "--chunk-mib", "1", *inputs)
    assert "into 2 chunk(s) of 1,048,576 bytes" in printed and "about 14 s" in printed
    assert "receive pk/00 --store /tmp/wc-env" in printed
    assert "store st: 1 of 2 chunks" in run("receive", "pk/01", "--store", "st")
    assert "missing 00" in run("status", "--store", "st")
    assert "; complete" in run("receive", "pk/00", "--store", "st")
    assert "installed pack" in run("install", "--store", "st", "--target", "site")
    assert (tmp_path / "site" / "big" / "data.bin").read_bytes() == data

    bad = subprocess.run(
        [sys.executable, "-I", tool, "install", "--store", "nowhere", "--target", "x"],
        cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    assert bad.returncode == 2 and "holds no pack yet" in bad.stderr
