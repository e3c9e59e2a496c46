"""weightcache.daemon.build: a load plan executed from the checkpoint layout or from disk
equals the plain-torch reference of the same plan, and the engine's own load, bit for bit."""

from __future__ import annotations

import msgspec
import pytest
import torch

from tests.unit.plankit import reference_params, same_bits
from tests.unit.toyengine import (
    ToyEngine,
    checkpoint,
    meta_model,
    real_load,
    save_checkpoint,
    sources,
)
from weightcache.checkpoint import cache_config, read_checkpoint
from weightcache.daemon.build import build_layout
from weightcache.daemon.provenance import stamp
from weightcache.daemon.resident import load_from_disk
from weightcache.integrations.trace import trace_load
from weightcache.layout import build_views
from weightcache.plan import check_plan, plan_hash
from weightcache.protocol import ShardSpec
from weightcache.transport import get_daemon_transport_backend

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    tensors = checkpoint()
    return save_checkpoint(tmp_path_factory.mktemp("toy"), tensors), tensors


def traced(**kw):
    model = meta_model(**kw)
    report = trace_load(model, sources(checkpoint()), model.load_weights)
    assert report.copied == {}
    return report.plan


def build(model_dir, plan, resident):
    headers = read_checkpoint(model_dir)
    summary = check_plan(plan, {n: s for n, s in sources(checkpoint()).items()})
    base = resident.config if resident else cache_config(headers, CPU)
    backend = get_daemon_transport_backend("memfd")
    return build_layout(plan, plan_hash(plan), summary, base, headers, backend, CPU, resident)


@pytest.mark.parametrize(
    ("engine", "daemon", "source"),
    [
        (dict(), dict(), "resident"),
        (dict(style="cat"), dict(), "resident"),
        # The daemon's float32 -> bfloat16 cast is the plan's own first cast: still resident.
        (dict(), dict(dtype=torch.bfloat16), "resident"),
        # A float16 hop first: the bfloat16 layout cannot serve it; those copies read disk.
        (dict(style="cast"), dict(dtype=torch.bfloat16), "resident+disk"),
        # Rank 1 of 2 from a rank-1 daemon: q/k/v, o_proj, embed rows inside its shard.
        (dict(tp_rank=1, tp_size=2), dict(shard=ShardSpec(2, 1, "llama")), "resident"),
        # Rank 0's padded vocabulary reads row 15, which the daemon's even split gives rank 1.
        (dict(tp_rank=0, tp_size=2), dict(shard=ShardSpec(2, 0, "llama")), "resident+disk"),
        # Another rank's daemon holds none of rank 1's split tensors.
        (dict(tp_rank=1, tp_size=2), dict(shard=ShardSpec(2, 0, "llama")), "resident+disk"),
    ],
)
def test_a_built_layout_is_the_engines_own_load(toy, engine, daemon, source) -> None:
    model_dir, tensors = toy
    plan = traced(**engine)
    resident = load_from_disk(model_dir, CPU, "memfd", **daemon)
    built, stats = build(model_dir, plan, resident)
    try:
        assert built.load_source == source
        assert built.config == msgspec.structs.replace(resident.config, plan=plan_hash(plan))
        views = build_views(built.memory.buffers, built.layout)
        expected = reference_params(plan, tensors)
        engine_load = real_load(ToyEngine(**engine), tensors)
        assert sorted(views) == sorted(expected) == sorted(engine_load)
        assert [n for n in views if not same_bits(views[n], expected[n])] == []
        assert [n for n in views if not same_bits(views[n], engine_load[n])] == []
        assert built.expected_bytes == sum(
            t.numel() * t.itemsize for n, t in engine_load.items() if n != "lm_head"
        )
        if source == "resident":
            assert stats.copies_disk == 0 and stats.bytes_from_disk == 0
    finally:
        built.close()
        resident.close()


@pytest.mark.parametrize("direct_bytes", [1 << 30, 64])
def test_resident_copies_issued_in_several_batches_give_the_same_bytes(
    toy, monkeypatch, direct_bytes
) -> None:
    """Batches of two pairs; with 64, copies of 64 bytes or more go alone, the rest batched."""
    from weightcache.daemon import build as build_module

    monkeypatch.setattr(build_module._CopyBatch, "LIMIT", 2)
    monkeypatch.setattr(build_module._CopyBatch, "DIRECT_BYTES", direct_bytes)
    model_dir, tensors = toy
    plan = traced()
    resident = load_from_disk(model_dir, CPU, "memfd")
    built, stats = build(model_dir, plan, resident)
    try:
        assert stats.copies_resident > 2 * build_module._CopyBatch.LIMIT
        views = build_views(built.memory.buffers, built.layout)
        expected = reference_params(plan, tensors)
        assert [n for n in views if not same_bits(views[n], expected[n])] == []
    finally:
        built.close()
        resident.close()


def test_without_a_checkpoint_layout_everything_comes_from_disk(toy) -> None:
    model_dir, tensors = toy
    plan = traced(tp_rank=1, tp_size=2)
    built, stats = build(model_dir, plan, None)
    try:
        assert built.load_source == "disk" and stats.copies_resident == 0
        assert built.source == stamp(model_dir)  # its provenance: the files it read
        # A row-parallel shard reads only its rows' spans, not whole tensors twice over.
        assert stats.bytes_from_disk <= sum(t.numel() * 4 for t in tensors.values())
        views = build_views(built.memory.buffers, built.layout)
        expected = reference_params(plan, tensors)
        assert [n for n in views if not same_bits(views[n], expected[n])] == []
    finally:
        built.close()


def test_large_disk_reads_go_in_pieces(toy, monkeypatch) -> None:
    """A copy whose source spans more than PIECE_BYTES is read in pieces of its outer dims."""
    import weightcache.daemon.build as build_module

    model_dir, tensors = toy
    monkeypatch.setattr(build_module, "PIECE_BYTES", 100)
    reads = []
    real_read = build_module._read
    monkeypatch.setattr(
        build_module, "_read", lambda fd, r, lo, hi, p: reads.append(hi - lo) or real_read(
            fd, r, lo, hi, p)
    )  # fmt: skip
    plan = traced(tp_rank=1, tp_size=2)
    built, _ = build(model_dir, plan, None)
    try:
        assert reads and max(reads) * 4 <= 100 + 4 * 24  # a piece, or one row of 24 elements
        views = build_views(built.memory.buffers, built.layout)
        expected = reference_params(plan, tensors)
        assert [n for n in views if not same_bits(views[n], expected[n])] == []
    finally:
        built.close()


def test_a_built_memfd_layout_is_sealed_and_read_only(toy) -> None:
    import fcntl

    model_dir, _ = toy
    built, _ = build(model_dir, traced(), None)
    try:
        for fd in built.export.fds:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            assert seals & fcntl.F_SEAL_WRITE
        assert built.preloaded_weights_bytes == sum(built.layout.allocation_sizes)
    finally:
        built.close()
