"""The daemon's manifest: atomic 0600 file, strict reading, staleness, keyed digests."""

from __future__ import annotations

import hashlib
import os
import stat

import msgspec
import pytest
import torch

from weightcache.daemon.manifest import (
    BLAKE2B,
    BLAKE2B_SLICE,
    LINEAR,
    M31,
    M61,
    Manifest,
    ManifestError,
    algorithm_for,
    allocation_digests,
    build_manifest,
    digests_under,
    inner_keys,
    linear_digest,
    linear_digests,
    manifest_path,
    outer_key,
    read_manifest,
    stale_reason,
    write_manifest,
)
from weightcache.daemon.statedir import StateDirError, prepare_state_dir
from weightcache.layout import TensorSpec, plan_layout
from weightcache.protocol import (
    CacheConfig,
    FileIdentity,
    ModelIdentity,
    ShardSpec,
)

KEY = bytes(range(32))


def config(header: str = "a" * 64, dtype: str | None = None) -> CacheConfig:
    model = ModelIdentity("/models/m", None, [FileIdentity("model.safetensors", 1000, header)])
    return CacheConfig(model, dtype, ShardSpec(), None)


LAYOUT = plan_layout([TensorSpec("w", torch.float32, (4, 6)), TensorSpec("b", torch.int64, (3,))])


def buffers(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
        for size in LAYOUT.allocation_sizes
    ]


def manifest(**changes) -> Manifest:
    m = build_manifest(
        config=config(), transport="memfd", gpu="cpu", layout=LAYOUT, buffers=buffers()
    )
    return msgspec.structs.replace(m, **changes)


# --------------------------------------------------------------------------- file


def test_written_atomically_with_mode_0600_and_read_back(tmp_path) -> None:
    socket = str(tmp_path / "cpu.sock")
    path = manifest_path(socket)
    assert path == str(tmp_path / ".daemon" / "cpu.sock.manifest")
    old = os.umask(0)  # a permissive umask must not widen the file or its directory
    try:
        prepare_state_dir(socket)
        write_manifest(path, manifest(gpu="cpu"))
        first = read_manifest(path)
        write_manifest(path, manifest(transport="vmm_fd"))
    finally:
        os.umask(old)
    assert first.transport == "memfd"
    assert read_manifest(path).transport == "vmm_fd"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / ".daemon").st_mode) == 0o700
    assert sorted(os.listdir(tmp_path / ".daemon")) == ["cpu.sock.manifest"], "temporary left"


def test_missing_manifest_says_so(tmp_path) -> None:
    with pytest.raises(ManifestError, match="no manifest at .*first start"):
        read_manifest(str(tmp_path / "cpu.sock.manifest"))


def write_private(path: str, content: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(content)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{not json", "is not valid"),
        (b'{"v": 2}', "is not valid"),
        (None, "fingerprint does not match its config"),
        (None, "2 digests for 1 allocations"),
    ],
)
def test_inconsistent_manifests_are_refused_with_the_reason(tmp_path, content, message) -> None:
    path = str(tmp_path / "m")
    if content is None:
        good = manifest()
        if "fingerprint" in message:
            bad = msgspec.structs.replace(good, config=config(dtype="float16"))
        else:
            bad = msgspec.structs.replace(good, digests=good.digests * 2)
        content = msgspec.json.encode(bad)
    write_private(path, content)
    with pytest.raises(ManifestError, match=message):
        read_manifest(path)


def test_manifest_owned_by_another_uid_is_refused(tmp_path) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to chown the file to another uid")
    path = str(tmp_path / "m")
    write_manifest(path, manifest())
    os.chown(path, 65534, 65534)
    with pytest.raises(ManifestError, match="owned by uid 65534"):
        read_manifest(path)


# A manifest others could have read (its key) or written, or reached through a link, is
# refused: each case is something an engine could have arranged in a shared directory.
def _readable_by_group(tmp_path) -> tuple[str, str]:
    path = str(tmp_path / ".daemon" / "m")
    write_manifest(path, manifest())
    os.chmod(path, 0o640)
    return path, "has mode 0640: others may have read its key"


def _a_symlink(tmp_path) -> tuple[str, str]:
    real = str(tmp_path / ".daemon" / "real")
    write_manifest(real, manifest())
    os.symlink(real, tmp_path / ".daemon" / "m")
    return str(tmp_path / ".daemon" / "m"), "cannot open manifest"


def _dir_a_symlink(tmp_path) -> tuple[str, str]:
    write_manifest(str(tmp_path / ".daemon" / "m"), manifest())
    os.rename(tmp_path / ".daemon", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", tmp_path / ".daemon")
    return str(tmp_path / ".daemon" / "m"), "is a symlink or not a directory"


def _dir_open_to_group(tmp_path) -> tuple[str, str]:
    write_manifest(str(tmp_path / ".daemon" / "m"), manifest())
    os.chmod(tmp_path / ".daemon", 0o750)
    return str(tmp_path / ".daemon" / "m"), "has mode 0750: others may enter it"


def _dir_of_another_uid(tmp_path) -> tuple[str, str]:
    write_manifest(str(tmp_path / ".daemon" / "m"), manifest())
    os.chown(tmp_path / ".daemon", 65534, 65534)
    return str(tmp_path / ".daemon" / "m"), "is owned by uid 65534, not this daemon's"


def _a_directory(tmp_path) -> tuple[str, str]:
    # Once raised IsADirectoryError from fdopen, and the daemon stopped instead of reloading.
    (tmp_path / ".daemon" / "m" / "in-the-way").mkdir(parents=True)
    return str(tmp_path / ".daemon" / "m"), "is not a regular file"


@pytest.mark.parametrize(
    "arrange",
    [_readable_by_group, _a_symlink, _dir_a_symlink, _dir_open_to_group, _dir_of_another_uid,
     _a_directory],
)
def test_a_manifest_others_could_touch_is_refused(tmp_path, arrange) -> None:
    if os.getuid() != 0 and arrange is _dir_of_another_uid:
        pytest.skip("needs root to chown the directory to another uid")
    prepare_state_dir(str(tmp_path / "cpu.sock"))
    path, message = arrange(tmp_path)
    with pytest.raises(ManifestError, match=message):
        read_manifest(path)


def test_the_private_dir_is_never_followed_or_borrowed(tmp_path) -> None:
    socket = str(tmp_path / "cpu.sock")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    os.symlink(elsewhere, tmp_path / ".daemon")
    with pytest.raises(StateDirError, match="is a symlink or not a directory"):
        prepare_state_dir(socket)
    assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o755
    os.unlink(tmp_path / ".daemon")
    if os.getuid() == 0:
        os.mkdir(tmp_path / ".daemon", 0o777)
        os.chown(tmp_path / ".daemon", 65534, 65534)
        with pytest.raises(StateDirError, match="owned by uid 65534"):
            prepare_state_dir(socket)


def test_a_manifest_matching_what_would_load_is_not_stale() -> None:
    m = manifest()
    assert stale_reason(m, config=config(), transport="memfd", gpu="cpu") is None


def test_staleness_names_what_changed() -> None:
    m = manifest()
    same = dict(config=config(), transport="memfd", gpu="cpu")
    changed_header = stale_reason(m, **{**same, "config": config(header="b" * 64)})
    assert "model.files[0].header_sha256" in changed_header
    assert "dtype" in stale_reason(m, **{**same, "config": config(dtype="bfloat16")})
    assert "vmm_fd" in stale_reason(m, **{**same, "transport": "vmm_fd"})
    assert "GPU-1" in stale_reason(m, **{**same, "gpu": "GPU-1"})
    sharded = msgspec.structs.replace(config(), shard=ShardSpec(tp_size=2, tp_rank=1))
    assert "shard.tp_rank" in stale_reason(m, **{**same, "config": sharded})


# --------------------------------------------------------------------------- digests


def reference_linear_digest(buffer: torch.Tensor, key: bytes, chunk: int) -> str:
    """The documented formula, in plain Python integers (no overflow to worry about)."""
    halfwords = [v & 0xFFFF for v in buffer.view(torch.int16).tolist()]
    lanes = []
    for lane in range(2):
        k = inner_keys(key, lane, min(chunk, len(halfwords))).tolist()
        total = 0
        for j, start in enumerate(range(0, len(halfwords), chunk)):
            part = halfwords[start : start + chunk]
            s = sum(a * b for a, b in zip(k[: len(part)], part, strict=True)) % M31
            total = (total + outer_key(key, lane, j) * s) % M61
        lanes.append(total)
    return "".join(f"{h:016x}" for h in lanes)


@pytest.mark.parametrize("size", [0, 256, 4096, 4096 + 768])
def test_linear_digest_equals_the_documented_formula(size) -> None:
    # Worst case for int64 overflow: every halfword 0xFFFF.
    full = torch.full((size,), 255, dtype=torch.uint8)
    random = torch.randint(0, 256, (size,), dtype=torch.uint8)
    for buffer in (full, random):
        assert linear_digest(buffer, KEY, 1024) == reference_linear_digest(buffer, KEY, 1024)


def test_linear_digest_catches_any_single_changed_byte() -> None:
    buffer = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    digest = linear_digest(buffer, KEY, 512)
    for position in [0, 1, 511, 512, 1023, 2048, 4095]:
        for flip in (1, 0x80):
            forged = buffer.clone()
            forged[position] ^= flip
            assert linear_digest(forged, KEY, 512) != digest, (position, flip)


def test_linear_digest_sees_words_that_are_congruent_mod_the_prime() -> None:
    # As 32-bit words, 0 and 2^31 - 1 are equal mod M31; halfwords keep them apart.
    zero = torch.zeros(256, dtype=torch.uint8)
    forged = zero.clone()
    forged.view(torch.int32)[0] = M31
    assert linear_digest(zero, KEY) != linear_digest(forged, KEY)


def test_digests_depend_on_the_key() -> None:
    buffer = torch.randint(0, 256, (1024,), dtype=torch.uint8)
    other = bytes(32)
    assert linear_digest(buffer, KEY) != linear_digest(buffer, other)
    assert allocation_digests([buffer], BLAKE2B, KEY) != allocation_digests(
        [buffer], BLAKE2B, other
    )


def test_linear_digest_refuses_sizes_it_cannot_cover() -> None:
    with pytest.raises(ValueError, match="multiples of 256 bytes"):
        linear_digest(torch.zeros(100, dtype=torch.uint8), KEY)


def test_cpu_digest_is_keyed_blake2b_of_the_bytes() -> None:
    buffer = torch.randint(0, 256, (3000,), dtype=torch.uint8)
    expected = hashlib.blake2b(bytes(buffer.tolist()), key=KEY, digest_size=32).hexdigest()
    assert allocation_digests([buffer], BLAKE2B, KEY) == [expected]
    assert algorithm_for(torch.device("cpu")) == BLAKE2B
    assert algorithm_for(torch.device("cuda", 0)) == LINEAR
    with pytest.raises(ValueError, match="unknown checksum algorithm"):
        allocation_digests([buffer], "crc32", KEY)


def test_every_manifest_gets_a_fresh_key() -> None:
    a, b = manifest(), manifest()
    assert a.checksum == BLAKE2B
    assert a.checksum_key != b.checksum_key
    assert a.digests != b.digests
    key = bytes.fromhex(a.checksum_key)
    assert allocation_digests(buffers(), a.checksum, key) == a.digests
    assert allocation_digests(buffers(seed=1), a.checksum, key) != a.digests


def test_digests_under_several_keys_equal_one_key_at_a_time() -> None:
    # A seeded daemon checks its copy under its neighbour's key and digests it under its
    # own in one pass; each must be what a pass of its own would give.
    other = bytes(range(32))
    buffer = torch.randint(0, 256, (40 * 1024 + 512,), dtype=torch.uint8)
    both = linear_digests(buffer, [KEY, other], 4096)
    assert both == [reference_linear_digest(buffer, k, 4096) for k in (KEY, other)]
    memfd_bytes = torch.randint(0, 256, (BLAKE2B_SLICE + 1000,), dtype=torch.uint8)
    for algorithm, buffers_ in ((LINEAR, [buffer]), (BLAKE2B, [memfd_bytes, buffer[:300]])):
        together = digests_under(buffers_, algorithm, [KEY, other])
        assert together == [
            [allocation_digests([b], algorithm, k)[0] for k in (KEY, other)] for b in buffers_
        ]


def test_engine_layout_manifests_are_found_per_socket_and_removed(tmp_path) -> None:
    from weightcache.daemon.manifest import layout_plans, remove_manifest
    from weightcache.daemon.statedir import prepare_state_dir

    sock, other = str(tmp_path / "gpu-A.sock"), str(tmp_path / "gpu-B.sock")
    prepare_state_dir(sock)
    a, b = "a" * 64, "b" * 64
    for path in (manifest_path(sock), manifest_path(sock, a), manifest_path(other, b),
                 manifest_path(sock, b) + ".tmp-7"):  # fmt: skip
        open(path, "w").close()
    assert manifest_path(sock, a).endswith("/.daemon/gpu-A.sock.layout-" + a + ".manifest")
    assert layout_plans(sock) == [a] and layout_plans(other) == [b]
    remove_manifest(sock, a)
    remove_manifest(sock, a)  # already gone: nothing to do
    assert layout_plans(sock) == []
    assert os.path.exists(manifest_path(sock))
