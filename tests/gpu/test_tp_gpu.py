"""Issue 10 on one GPU: two tensor-parallel rank daemons (vmm_fd) sharing cuda:0.

With a single GPU both ranks' daemons sit on it (distinct sockets, so
distinct locks); rank 1 is pinned by the GPU's UUID. What needs two or more
GPUs (one daemon per GPU, an NCCL TP engine's logits) is not done here; see
docs/tensor-parallel.md.
"""

from __future__ import annotations

import gc

import pytest
import torch
from safetensors.torch import load_file

from weightcache.checkpoint import cache_config, read_checkpoint
from weightcache.client import ConfigMismatch, attach, daemon_status
from weightcache.daemon.loader import load_into_buffers, tensor_specs_for
from weightcache.daemon.resident import load_from_disk
from weightcache.devices import gpu_uuid
from weightcache.layout import build_views, plan_layout
from weightcache.protocol import ShardSpec
from weightcache.shard import split_dim

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

CUDA = torch.device("cuda", 0)
MiB = 1 << 20
TP = 2
PLAN = "llama"


def _spec(rank: int) -> ShardSpec:
    return ShardSpec(tp_size=TP, tp_rank=rank, plan=PLAN)


def _config(llama_dir, rank: int):
    return cache_config(read_checkpoint(llama_dir), CUDA, shard=_spec(rank))


@pytest.fixture
def rank_daemons(llama_dir, daemon_factory):
    shard = ("--transport", "vmm_fd", "--tp-size", str(TP), "--shard-plan", PLAN)
    return [
        daemon_factory(llama_dir, *shard, "--tp-rank", "0", name="rank0"),
        daemon_factory(
            llama_dir, *shard, "--tp-rank", "1", "--gpu-uuid", gpu_uuid(0), name="rank1"
        ),
    ]


def test_rank_shards_concatenate_to_the_checkpoint_and_a_rank_swap_is_refused(
    llama_dir, rank_daemons
):
    reference = {n: t.to(CUDA) for n, t in load_file(llama_dir / "model.safetensors").items()}
    attached = [
        attach(d.socket_path, _config(llama_dir, rank), transports=["vmm_fd"], watchdog=False)
        for rank, d in enumerate(rank_daemons)
    ]
    try:
        assert [a.transport for a in attached] == ["vmm_fd", "vmm_fd"]
        assert {daemon_status(d.socket_path).gpu for d in rank_daemons} == {gpu_uuid(0)}
        split = 0
        for name, original in reference.items():
            shards = [a.tensors[name] for a in attached]
            assert all(s.device == CUDA for s in shards)
            dim = split_dim(PLAN, name)
            if dim is None:
                assert all(torch.equal(s, original) for s in shards), name
                continue
            split += 1
            assert shards[0].shape[dim] == original.shape[dim] // TP, name
            assert torch.equal(torch.cat(shards, dim=dim), original), name
        assert split == 4 * 7 + 2  # q k v o gate up down per layer, embed_tokens, lm_head

        with pytest.raises(ConfigMismatch) as refused:
            attach(
                rank_daemons[1].socket_path,
                _config(llama_dir, 0),
                transports=["vmm_fd"],
                watchdog=False,
            )
        assert refused.value.fields == ["shard.tp_rank"]
    finally:
        for a in attached:
            a.close()


def test_each_rank_reports_its_shards_bytes_as_the_driver_sees_them(llama_dir, rank_daemons):
    reference = load_file(llama_dir / "model.safetensors")
    whole = sum(t.nbytes for t in reference.values())
    replicated = sum(t.nbytes for n, t in reference.items() if split_dim(PLAN, n) is None)
    shard_bytes = replicated + (whole - replicated) // TP

    # As in test_cuda_transports: pay the process's one-time CUDA costs first.
    load_from_disk(llama_dir, CUDA, "vmm_fd", shard=_spec(0)).close()
    gc.collect()
    torch.cuda.empty_cache()
    for rank, daemon in enumerate(rank_daemons):
        status = daemon_status(daemon.socket_path)
        attached = attach(
            daemon.socket_path, _config(llama_dir, rank), transports=["vmm_fd"], watchdog=False
        )
        try:
            held = sum(t.nbytes for t in attached.tensors.values())
            assert held == status.expected_bytes == shard_bytes
            assert attached.preloaded_weights_bytes == status.preloaded_weights_bytes
            assert shard_bytes <= status.preloaded_weights_bytes < whole
        finally:
            attached.close()

        torch.cuda.synchronize()
        before = torch.cuda.mem_get_info(CUDA)[0]
        resident = load_from_disk(llama_dir, CUDA, "vmm_fd", shard=_spec(rank))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        used = before - torch.cuda.mem_get_info(CUDA)[0]
        assert resident.preloaded_weights_bytes == status.preloaded_weights_bytes
        resident.close()
        del resident
        gc.collect()
        # Rounding: the VMM granularity, as in test_cuda_transports.
        assert abs(used - status.preloaded_weights_bytes) <= 4 * MiB, (rank, used)
        print(
            f"rank {rank}: {status.preloaded_weights_bytes} bytes resident "
            f"(shard {shard_bytes}, whole model {whole}); driver saw {used}"
        )


@pytest.mark.parametrize("piece_bytes", [1000, 4096, 64 * MiB])
def test_the_gpu_loader_reads_each_rank_in_any_piece_size_and_casts(llama_dir, piece_bytes):
    """1000: rows split in pieces; 4096: runs of rows gathered on the GPU; 64 MiB: whole."""
    checkpoint = read_checkpoint(llama_dir)
    reference = load_file(llama_dir / "model.safetensors", device="cuda:0")
    for cast in (None, torch.float32):
        views = []
        for rank in range(TP):
            layout = plan_layout(tensor_specs_for(checkpoint, cast, _spec(rank)))
            buffers = [
                torch.zeros(n, dtype=torch.uint8, device=CUDA) for n in layout.allocation_sizes
            ]
            load_into_buffers(
                checkpoint, layout, buffers, cast, workers=4, piece_bytes=piece_bytes,
                shard=_spec(rank),
            )  # fmt: skip
            views.append(build_views(buffers, layout))
        for name, original in reference.items():
            expected = original.to(cast) if cast is not None else original
            dim = split_dim(PLAN, name)
            shards = [v[name] for v in views]
            whole = shards[0] if dim is None else torch.cat(shards, dim=dim)
            assert whole.dtype == expected.dtype
            assert torch.equal(whole, expected), (name, cast)
