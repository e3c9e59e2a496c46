"""weightcache.checkpoint: which files, what their headers say, and the CacheConfig from them."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import save_file

from weightcache.checkpoint import (
    CheckpointError,
    cache_config,
    checkpoint_files,
    dtype_from_name,
    read_checkpoint,
    read_file_header,
)
from weightcache.protocol import LAYOUT_VERSION, ShardSpec


def write_raw(path: Path, header: object, data: bytes = b"", header_len: int | None = None) -> Path:
    """A safetensors-shaped file with any header we like, valid or not."""
    encoded = header if isinstance(header, bytes) else json.dumps(header).encode()
    length = len(encoded) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", length) + encoded + data)
    return path


def test_headers_locate_every_tensor_in_the_file(tmp_path: Path) -> None:
    tensors = {
        "w": torch.arange(12, dtype=torch.float32).view(3, 4),
        "ids": torch.tensor([1, 2, 3], dtype=torch.int64),
        "half": torch.ones(2, 2, dtype=torch.bfloat16),
        "flag": torch.tensor([True, False]),
        "empty": torch.empty(0, 5),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    parsed = read_file_header(path)
    assert parsed.size == path.stat().st_size
    records = {t.name: t for t in parsed.tensors}
    assert set(records) == set(tensors)  # __metadata__ is not a tensor
    raw = path.read_bytes()
    for name, tensor in tensors.items():
        record = records[name]
        assert record.dtype == tensor.dtype and record.shape == tuple(tensor.shape)
        assert record.nbytes == tensor.numel() * tensor.element_size()
        on_disk = raw[record.file_offset : record.file_offset + record.nbytes]
        assert on_disk == tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def test_header_digest_covers_the_header_bytes(tmp_path: Path, minilm_dir: Path) -> None:
    raw = (minilm_dir / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    parsed = read_file_header(minilm_dir / "model.safetensors")
    assert parsed.header_sha256 == hashlib.sha256(raw[: 8 + length]).hexdigest()
    assert len(parsed.tensors) == 104

    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"w": torch.zeros(4)}, first, metadata={"rev": "1"})
    save_file({"w": torch.zeros(4)}, second, metadata={"rev": "2"})
    assert read_file_header(first).header_sha256 != read_file_header(second).header_sha256


def test_without_an_index_every_safetensors_file_is_read_in_name_order(tmp_path: Path) -> None:
    save_file({"b": torch.zeros(1)}, tmp_path / "b.safetensors")
    save_file({"a": torch.zeros(1)}, tmp_path / "a.safetensors")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert [p.name for p in checkpoint_files(tmp_path)] == ["a.safetensors", "b.safetensors"]


def test_the_index_decides_which_files_are_read(tmp_path: Path) -> None:
    save_file({"x.w": torch.ones(2)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"y.w": torch.ones(3)}, tmp_path / "model-00002-of-00002.safetensors")
    save_file({"stray": torch.ones(1)}, tmp_path / "consolidated.safetensors")
    index = {
        "metadata": {"total_size": 20},
        "weight_map": {
            "y.w": "model-00002-of-00002.safetensors",
            "x.w": "model-00001-of-00002.safetensors",
        },
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    checkpoint = read_checkpoint(tmp_path)
    assert [f.path.name for f in checkpoint.files] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert sorted(t.name for t in checkpoint.tensors) == ["x.w", "y.w"]


@pytest.mark.parametrize(
    ("index", "message"),
    [
        ("{not json", "not a valid safetensors index"),
        ('{"metadata": {}}', "not a valid safetensors index"),
        ('{"weight_map": [1, 2]}', "not a valid safetensors index"),
        ('{"weight_map": {"w": 5}}', "not a valid safetensors index"),
        ('{"weight_map": {"w": "../elsewhere.safetensors"}}', "escapes the model directory"),
        ('{"weight_map": {"w": ".hidden.safetensors"}}', "escapes the model directory"),
        ('{"weight_map": {}}', "no \\*.safetensors files"),
    ],
)
def test_bad_indexes_are_rejected(tmp_path: Path, index: str, message: str) -> None:
    save_file({"w": torch.ones(1)}, tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match=message):
        read_checkpoint(tmp_path)


def test_an_index_naming_a_missing_file_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"w": "gone.safetensors"}}'
    )
    with pytest.raises(CheckpointError, match="gone.safetensors: cannot read"):
        read_checkpoint(tmp_path)


def test_missing_and_empty_directories_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        read_checkpoint(tmp_path)


ENTRY = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    ("header", "data", "header_len", "message"),
    [
        (b"", b"", None, "shorter than a safetensors header"),
        ({"w": ENTRY}, b"\0" * 8, 1 << 40, "header length 1099511627776 is not plausible"),
        ({"w": ENTRY}, b"", 500, "header length 500 is not plausible"),
        (b"{nope", b"", None, "header is not JSON"),
        (b"\xff\xfe", b"", None, "header is not JSON"),
        ([1, 2], b"", None, "header is not a JSON object"),
        ({"w": {"shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "malformed header entry"),
        ({"w": {**ENTRY, "dtype": "F99"}}, b"\0" * 8, None, "malformed header entry"),
        ({"w": {**ENTRY, "shape": "2"}}, b"\0" * 8, None, "malformed header entry"),
        ({"w": {**ENTRY, "shape": [2.5]}}, b"\0" * 8, None, "malformed header entry"),
        ({"w": {**ENTRY, "shape": [True, 2]}}, b"\0" * 8, None, "malformed header entry"),
        ({"w": {**ENTRY, "data_offsets": ["0", "8"]}}, b"\0" * 8, None, "malformed header entry"),
        ({"w": {**ENTRY, "dtype": ["F32"]}}, b"\0" * 8, None, "malformed header entry"),
        ({"w": {**ENTRY, "data_offsets": [0]}}, b"\0" * 8, None, "malformed header entry"),
        ({"w": "F32"}, b"", None, "malformed header entry"),
        ({"w": {**ENTRY, "data_offsets": [0, 4]}}, b"\0" * 8, None, "do not match its shape"),
        ({"w": {**ENTRY, "shape": [-2]}}, b"\0" * 8, None, "do not match its shape"),
        ({"w": {**ENTRY, "data_offsets": [-8, 0]}}, b"\0" * 8, None, "do not match its shape"),
        ({"w": ENTRY}, b"\0" * 7, None, "extends past the end of the file"),
    ],
)
def test_malformed_headers_are_rejected_naming_file_and_tensor(
    tmp_path: Path, header, data: bytes, header_len, message: str
) -> None:
    path = tmp_path / "bad.safetensors"
    if header == b"":
        path.write_bytes(b"\x01\x02")
    else:
        write_raw(path, header, data, header_len)
    with pytest.raises(CheckpointError, match=message) as info:
        read_checkpoint(tmp_path)
    assert str(path) in str(info.value)
    if "entry" in message or "shape" in message or "past the end" in message:
        assert "'w'" in str(info.value)


def test_a_tensor_in_two_files_is_rejected(tmp_path: Path) -> None:
    save_file({"w": torch.ones(1)}, tmp_path / "a.safetensors")
    save_file({"w": torch.ones(1)}, tmp_path / "b.safetensors")
    with pytest.raises(CheckpointError, match="'w' appears in more than one file"):
        read_checkpoint(tmp_path)


def test_cache_config_records_identity_dtype_shard_and_versions(tmp_path: Path) -> None:
    save_file({"w": torch.ones(3)}, tmp_path / "model.safetensors")
    checkpoint = read_checkpoint(tmp_path)
    config = cache_config(
        checkpoint,
        torch.device("cpu"),
        torch.bfloat16,
        ShardSpec(tp_size=2, tp_rank=1),
        revision="abc123",
    )
    assert config.model.path == str(tmp_path.resolve())
    assert config.model.revision == "abc123"
    [identity] = config.model.files
    assert identity.name == "model.safetensors"
    assert identity.size == (tmp_path / "model.safetensors").stat().st_size
    assert identity.header_sha256 == checkpoint.files[0].header_sha256
    assert config.dtype == "bfloat16"
    assert config.shard == ShardSpec(tp_size=2, tp_rank=1)
    assert config.device_capability is None
    assert "torch_version" not in msgspec.to_builtins(config)  # the engine's torch is free
    assert config.layout_version == LAYOUT_VERSION
    plain = cache_config(checkpoint, torch.device("cpu"))
    assert plain.dtype is None and plain.shard == ShardSpec() and plain.model.revision is None


def test_dtype_names_are_torch_names() -> None:
    assert dtype_from_name("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'bf16'; expected one of"):
        dtype_from_name("bf16")
