"""Checkpoints of a recorded model's shape (tests/fixtures/plans) filled with random bytes:
real file sizes and tensor tables without the real weights, which the GPU machine cannot
download."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from tools.plan_fixtures import Fixture
from weightcache.checkpoint import dtype_from_name

SHARD_BYTES = 4 << 30  # checkpoint files of about 4 GiB, as published checkpoints are cut


def write_random_checkpoint(fixture: Fixture, out: Path, seed: int = 0) -> int:
    """The fixture's checkpoint table as safetensors files of random bytes (made on the GPU,
    one file at a time); returns the bytes written."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator(device="cuda").manual_seed(seed)
    shards: list[list[tuple[str, str, list[int]]]] = [[]]
    size = 0
    for entry in fixture.checkpoint:
        nbytes = dtype_from_name(entry[1]).itemsize * math.prod(entry[2])
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    total = 0
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for tensor, dtype_name, shape in shard:
            dtype = dtype_from_name(dtype_name)
            raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8,
                                device="cuda", generator=generator)  # fmt: skip
            tensors[tensor] = raw.view(dtype).view(shape).cpu()
            weight_map[tensor] = name
            total += raw.numel()
        save_file(tensors, str(out / name))
        del tensors
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return total
