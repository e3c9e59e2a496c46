"""The loader's plan (pure) and its reads, on real safetensors files."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from weightcache.checkpoint import read_checkpoint
from weightcache.daemon.loader import load_into_buffers, plan_chunks, tensor_specs_for
from weightcache.layout import build_views, plan_layout


def _checkpoint(tmp_path):
    torch.manual_seed(0)
    tensors = {
        "a.weight": torch.randn(64, 33),
        "b.bias": torch.randn(7),
        "c.empty": torch.empty(0, 4),
        "d.ids": torch.arange(10, dtype=torch.int64),
        "e.big": torch.randn(300, 17),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    return read_checkpoint(tmp_path), tensors


def test_chunks_cover_every_byte_once_in_file_order(tmp_path):
    checkpoint, _ = _checkpoint(tmp_path)
    specs = tensor_specs_for(checkpoint, None)
    chunks = plan_chunks(checkpoint, plan_layout(specs), None, piece_bytes=1000)
    covered = {}
    for chunk in chunks:
        assert chunk.file_end - chunk.file_start <= max(
            1000, max(p.end - p.start for p in chunk.pieces)
        )
        for piece in chunk.pieces:
            assert piece.start % piece.record.dtype.itemsize == 0
            covered.setdefault(piece.record.name, []).append((piece.start, piece.end))
    for record in checkpoint.tensors:
        ranges = sorted(covered.get(record.name, []))
        assert sum(e - s for s, e in ranges) == record.nbytes
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))


def test_small_pieces_and_cast_give_the_same_tensors_as_safetensors(tmp_path):
    checkpoint, _ = _checkpoint(tmp_path)
    reference = load_file(tmp_path / "model.safetensors")
    for cast in (None, torch.bfloat16):
        specs = tensor_specs_for(checkpoint, cast)
        layout = plan_layout(specs)
        buffers = [torch.zeros(size, dtype=torch.uint8) for size in layout.allocation_sizes]
        # 104 bytes: pieces split tensors mid-way, at element boundaries.
        load_into_buffers(checkpoint, layout, buffers, cast, workers=3, piece_bytes=104)
        views = build_views(buffers, layout)
        for name, tensor in reference.items():
            expected = (
                tensor.to(cast) if cast is not None and tensor.is_floating_point() else tensor
            )
            assert views[name].dtype == expected.dtype
            assert torch.equal(views[name], expected), name
