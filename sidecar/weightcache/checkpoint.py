"""Reading a safetensors checkpoint directory: files, headers, identity, CacheConfig.

Daemons and engines both compute the CacheConfig from the same directory, so
the engine can ask for exactly what it expects. Only the headers are read
here; tensor bytes are read by the daemon's loader straight into their
destination.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from weightcache.plan import SourceTensor
from weightcache.protocol import (
    LAYOUT_VERSION,
    CacheConfig,
    FileIdentity,
    ModelIdentity,
    ShardSpec,
)

MAX_HEADER_BYTES = 100 * 1024 * 1024

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

# Names used on the wire and in CLI flags: torch's own ("bfloat16", ...).
TORCH_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in SAFETENSORS_DTYPES.values()
}


class CheckpointError(ValueError):
    """The checkpoint directory or one of its files is not usable."""


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(
            f"unknown dtype {name!r}; expected one of {sorted(TORCH_DTYPES)}"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor's bytes live on disk."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    file_offset: int
    nbytes: int


@dataclass(frozen=True)
class CheckpointFile:
    path: Path
    size: int
    header_sha256: str
    tensors: tuple[TensorRecord, ...]


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The files to load: those named by model.safetensors.index.json, else every *.safetensors."""
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {str(model_dir)!r} does not exist")
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from None
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise CheckpointError(
                f"{index}: not a valid safetensors index (weight_map must map names to file names)"
            )
        names = sorted(set(weight_map.values()))
        for name in names:
            if "/" in name or name.startswith("."):
                raise CheckpointError(f"{index}: file name {name!r} escapes the model directory")
        files = [model_dir / name for name in names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {str(model_dir)!r}")
    return files


def read_file_header(path: Path) -> CheckpointFile:
    """Parse and validate one safetensors header without reading tensor data."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) != 8:
                raise CheckpointError(f"{path}: shorter than a safetensors header")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise CheckpointError(f"{path}: header length {header_len} is not plausible")
            header_bytes = f.read(header_len)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        header = json.loads(header_bytes)
    except ValueError as exc:
        raise CheckpointError(f"{path}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    data_start = 8 + header_len
    tensors = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        tensors.append(_tensor_record(path, name, info, data_start, size))
    digest = hashlib.sha256(prefix + header_bytes).hexdigest()
    return CheckpointFile(path, size, digest, tuple(tensors))


def _ints(value: object) -> tuple[int, ...]:
    """A JSON list of integers; int() would also take "12" (as [1, 2]), 2.5 or true."""
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise ValueError(f"expected a list of integers, got {value!r}")
    return tuple(value)


def _tensor_record(path: Path, name: str, info: object, data_start: int, size: int) -> TensorRecord:
    try:
        dtype = SAFETENSORS_DTYPES[info["dtype"]]  # type: ignore[index]
        shape = _ints(info["shape"])  # type: ignore[index]
        begin, end = _ints(info["data_offsets"])  # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry") from None
    nbytes = math.prod(shape) * dtype.itemsize
    if any(d < 0 for d in shape) or end - begin != nbytes or begin < 0:
        raise CheckpointError(f"{path}: tensor {name!r} offsets do not match its shape and dtype")
    if data_start + end > size:
        raise CheckpointError(f"{path}: tensor {name!r} extends past the end of the file")
    return TensorRecord(name, path, dtype, shape, data_start + begin, nbytes)


@dataclass(frozen=True)
class Checkpoint:
    model_dir: Path
    files: tuple[CheckpointFile, ...]

    @property
    def tensors(self) -> list[TensorRecord]:
        return [t for f in self.files for t in f.tensors]


def checkpoint_sources(checkpoint: Checkpoint) -> dict[str, SourceTensor]:
    """The checkpoint's tensors as a load plan names them (headers only)."""
    return {t.name: SourceTensor(dtype_name(t.dtype), t.shape) for t in checkpoint.tensors}


def read_checkpoint(model_dir: str | os.PathLike[str]) -> Checkpoint:
    model_dir = Path(model_dir).resolve()
    files = tuple(read_file_header(p) for p in checkpoint_files(model_dir))
    seen: set[str] = set()
    for f in files:
        for t in f.tensors:
            if t.name in seen:
                raise CheckpointError(f"tensor {t.name!r} appears in more than one file")
            seen.add(t.name)
    return Checkpoint(model_dir, files)


def device_capability(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def cache_config(
    checkpoint: Checkpoint,
    device: torch.device,
    dtype: torch.dtype | None = None,
    shard: ShardSpec | None = None,
    revision: str | None = None,
) -> CacheConfig:
    """The config both sides compute: the engine passes it, the daemon compares it."""
    model = ModelIdentity(
        path=str(checkpoint.model_dir),
        revision=revision,
        files=[FileIdentity(f.path.name, f.size, f.header_sha256) for f in checkpoint.files],
    )
    return CacheConfig(
        model=model,
        dtype=None if dtype is None else dtype_name(dtype),
        shard=shard or ShardSpec(),
        device_capability=device_capability(device),
        layout_version=LAYOUT_VERSION,
    )
