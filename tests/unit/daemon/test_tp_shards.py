"""Tensor parallelism on CPU: one real daemon per rank, each holding its shard of a Llama.

The checkpoint is a real ``LlamaForCausalLM`` (tiny config, random weights)
saved by transformers as safetensors. Two daemons (rank 0 and rank 1, memfd,
distinct sockets) load with ``--shard-plan llama``; engines attach per rank
through the real client. The KV check runs two real gloo ranks, each attached
to its own daemon.
"""

from __future__ import annotations

import json
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from tests.unit.wc_harness import DaemonFactory, DaemonProcess, wait_until
from weightcache.checkpoint import cache_config, read_checkpoint
from weightcache.client import ConfigMismatch, attach
from weightcache.daemon.loader import load_into_buffers, plan_chunks, tensor_specs_for
from weightcache.daemon.resident import load_from_disk
from weightcache.layout import build_views, plan_layout
from weightcache.protocol import ShardSpec
from weightcache.shard import plan_shards, split_dim

TP = 2
PLAN = "llama"
CPU = torch.device("cpu")


def _spec(rank: int) -> ShardSpec:
    return ShardSpec(tp_size=TP, tp_rank=rank, plan=PLAN)


def _rank_args(rank: int, tp_size: int = TP) -> tuple[str, ...]:
    return ("--tp-size", str(tp_size), "--tp-rank", str(rank), "--shard-plan", PLAN)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=250,  # even, but not divisible by 3 (see the tp_size 3 test)
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(llama_dir / "model.safetensors")


@pytest.fixture(scope="module")
def rank_daemons(module_daemons: DaemonFactory, llama_dir: Path) -> list[DaemonProcess]:
    started = [
        module_daemons(llama_dir, *_rank_args(rank), "--transport", "memfd", wait=False)
        for rank in range(TP)
    ]
    for daemon in started:
        daemon.wait_ready()
    return started


def _config(llama_dir: Path, rank: int):
    return cache_config(read_checkpoint(llama_dir), CPU, shard=_spec(rank))


def test_the_rank_shards_concatenate_to_the_original_tensors(
    rank_daemons, llama_dir, reference
) -> None:
    attached = [
        attach(d.socket, _config(llama_dir, rank), transports=["memfd"])
        for rank, d in enumerate(rank_daemons)
    ]
    try:
        split = {"dim 0": 0, "dim 1": 0, "whole": 0}
        for name, original in reference.items():
            shards = [a.tensors[name] for a in attached]
            dim = split_dim(PLAN, name)
            if dim is None:
                split["whole"] += 1
                assert all(torch.equal(s, original) for s in shards), name
                continue
            split[f"dim {dim}"] += 1
            assert [s.shape[dim] for s in shards] == [original.shape[dim] // TP] * TP, name
            assert shards[0].dtype == original.dtype
            assert torch.equal(torch.cat(shards, dim=dim), original), name
            assert not torch.equal(shards[0], shards[1]), name
        # Every kind of split took part: q/k/v/gate/up/embed/lm_head, o/down, norms.
        assert split == {"dim 0": 2 * 5 + 2, "dim 1": 2 * 2, "whole": 2 * 2 + 1}
    finally:
        for a in attached:
            a.close()


def test_an_engine_attaching_to_the_other_ranks_daemon_is_refused_naming_the_rank(
    rank_daemons, llama_dir
) -> None:
    with pytest.raises(ConfigMismatch) as refused:
        attach(rank_daemons[1].socket, _config(llama_dir, 0), transports=["memfd"])
    assert refused.value.fields == ["shard.tp_rank"]
    assert "shard.tp_rank" in str(refused.value)
    # A daemon holding the whole model is not a rank's daemon either.
    whole = cache_config(read_checkpoint(llama_dir), CPU)
    with pytest.raises(ConfigMismatch) as refused:
        attach(rank_daemons[0].socket, whole, transports=["memfd"])
    assert refused.value.fields == ["shard.plan", "shard.tp_size"]


def test_each_rank_reports_the_bytes_of_its_own_shard(rank_daemons, llama_dir, reference) -> None:
    whole = sum(t.nbytes for t in reference.values())
    replicated = sum(t.nbytes for n, t in reference.items() if split_dim(PLAN, n) is None)
    expected_shard = replicated + (whole - replicated) // TP
    for rank, daemon in enumerate(rank_daemons):
        status = daemon.status()
        attached = attach(daemon.socket, _config(llama_dir, rank), transports=["memfd"])
        try:
            held = sum(t.nbytes for t in attached.tensors.values())
            assert held == expected_shard
            assert status.expected_bytes == expected_shard
            assert attached.preloaded_weights_bytes == status.preloaded_weights_bytes
            # memfd: exactly the allocation, which holds the shard plus alignment only.
            assert expected_shard <= status.preloaded_weights_bytes < whole
            assert status.preloaded_weights_bytes == sum(
                b.numel() for b in attached._memory.buffers
            )
        finally:
            attached.close()


def test_a_restarted_rank_daemon_readopts_its_shard_from_the_ranks_engine(
    daemons: DaemonFactory, llama_dir, reference
) -> None:
    daemon = daemons(llama_dir, *_rank_args(1), "--transport", "memfd")
    engine = attach(daemon.socket, _config(llama_dir, 1), transports=["memfd"])
    try:
        daemon.kill()
        status = daemon.start().status()  # the successor, on the same socket
        assert status.readopted and status.load_source == "readopted", status.load_reason
        assert status.fingerprint == engine.fingerprint
        again = attach(daemon.socket, _config(llama_dir, 1), transports=["memfd"])
        try:
            for name, original in reference.items():
                dim = split_dim(PLAN, name)
                expected = original if dim is None else torch.chunk(original, TP, dim)[1]
                assert torch.equal(again.tensors[name], expected), name
        finally:
            again.close()
    finally:
        engine.close()


def test_a_split_dim_not_divisible_by_tp_size_fails_the_load_naming_the_tensor(
    daemons: DaemonFactory, llama_dir
) -> None:
    daemon = daemons(llama_dir, *_rank_args(1, tp_size=3), "--transport", "memfd", wait=False)
    code = wait_until(lambda: daemon.proc.poll(), "the daemon to give up", within=120)
    assert code == 1
    log = daemon.log()
    assert "not divisible by tp_size 3" in log
    assert "'model.embed_tokens.weight'" in log or "'lm_head.weight'" in log


def test_tp_size_without_a_plan_is_a_usage_error(daemons: DaemonFactory, llama_dir) -> None:
    daemon = daemons(llama_dir, "--tp-size", "2", "--tp-rank", "1", wait=False)
    assert daemon.proc.wait(60) == 2
    assert "tp_size 2 needs a shard plan" in daemon.log()


@pytest.mark.parametrize("piece_bytes", [100, 1000, 1 << 20])
def test_the_plan_reads_exactly_each_ranks_ranges_in_bounded_chunks(llama_dir, piece_bytes):
    """100: pieces smaller than a row; 1000: runs of 3 rows; 1 MiB: a whole shard per piece."""
    checkpoint = read_checkpoint(llama_dir)
    for rank in range(TP):
        layout = plan_layout(tensor_specs_for(checkpoint, None, _spec(rank)))
        chunks = plan_chunks(checkpoint, layout, None, piece_bytes, _spec(rank))
        read: dict[str, list[tuple[int, int]]] = {}
        for chunk in chunks:
            spans = [p.span_end - p.start for p in chunk.pieces]
            assert chunk.file_end - chunk.file_start <= max(piece_bytes, *spans)
            for p in chunk.pieces:
                assert chunk.file_start <= p.record.file_offset + p.start
                assert p.record.file_offset + p.span_end <= chunk.file_end
                rows = [(p.start + i * p.stride, p.end + i * p.stride) for i in range(p.rows)]
                read.setdefault(p.record.name, []).extend(rows)
        shards = plan_shards(checkpoint.tensors, _spec(rank))
        for name, shard in shards.items():
            merged: list[tuple[int, int]] = []
            for a, b in read[name]:  # pieces split ranges; join them back in order
                if merged and merged[-1][1] == a:
                    merged[-1] = (merged[-1][0], b)
                else:
                    merged.append((a, b))
            assert merged == shard.ranges, name
    assert any(p.rows > 1 for c in chunks for p in c.pieces) == (piece_bytes > 100)


@pytest.mark.parametrize("piece_bytes", [100, 1000, 1 << 20])
def test_the_loader_reads_each_rank_in_any_piece_size_and_casts(
    llama_dir, reference, piece_bytes
) -> None:
    """Pieces smaller than a row, runs of rows, and chunks spanning other ranks' bytes."""
    checkpoint = read_checkpoint(llama_dir)
    for cast in (None, torch.bfloat16):
        views = []
        for rank in range(TP):
            specs = tensor_specs_for(checkpoint, cast, _spec(rank))
            layout = plan_layout(specs)
            buffers = [torch.zeros(n, dtype=torch.uint8) for n in layout.allocation_sizes]
            load_into_buffers(
                checkpoint,
                layout,
                buffers,
                cast,
                workers=3,
                piece_bytes=piece_bytes,
                shard=_spec(rank),
            )
            views.append(build_views(buffers, layout))
        for name, original in reference.items():
            expected = original.to(cast) if cast is not None else original
            dim = split_dim(PLAN, name)
            shards = [v[name] for v in views]
            whole = shards[0] if dim is None else torch.cat(shards, dim=dim)
            assert whole.dtype == expected.dtype
            assert torch.equal(whole, expected), (name, cast)


# --------------------------------------------------------------------------- KV across ranks

GiB = 1 << 30
F = 0.85
# Free bytes each rank's device had before anything was loaded: rank 1 is the scarcer.
FREE_EMPTY = [80 * GiB, 79 * GiB]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, sockets: list[str], model: str, out_dir: str) -> None:
    from weightcache.kv import KVBaseline, kv_budget_bytes, min_across_ranks

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=TP,
        timeout=timedelta(seconds=60),
    )
    try:
        config = _config(Path(model), rank)
        free_empty = FREE_EMPTY[rank]

        # With the daemon: its shard is already resident when the engine samples.
        attached = attach(sockets[rank], config, transports=["memfd"])
        preloaded = attached.preloaded_weights_bytes
        raw = free_empty - preloaded
        baseline = KVBaseline.sample("cpu", sampler=lambda _device: raw)
        baseline.account_preloaded_weights(preloaded)
        daemon_budget = kv_budget_bytes(raw, baseline.min_across_ranks(), F)
        uncorrected = kv_budget_bytes(raw, min_across_ranks(raw), F)

        # Cold start: this rank loads its own shard, costing it the same memory.
        cold = load_from_disk(model, CPU, "memfd", shard=_spec(rank))
        try:
            cold_views = build_views(cold.memory.buffers, cold.layout)
            same = all(torch.equal(cold_views[n], t) for n, t in attached.tensors.items())
            cold_pre = min_across_ranks(free_empty)
            cold_budget = kv_budget_bytes(free_empty - cold.preloaded_weights_bytes, cold_pre, F)
        finally:
            cold.close()
        attached.close()
        result = {
            "preloaded": preloaded,
            "sizing": baseline.sizing_bytes,
            "daemon": daemon_budget,
            "cold": cold_budget,
            "uncorrected": uncorrected,
            "same_tensors": same,
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_each_rank_corrects_with_its_own_bytes_then_min_gives_the_cold_tp_budget(
    rank_daemons, llama_dir, tmp_path
) -> None:
    # fork: spawned children re-import torch (15 s on two cores); CPU and gloo only.
    mp.start_processes(
        _rank_main,
        args=(_free_port(), [d.socket for d in rank_daemons], str(llama_dir), str(tmp_path)),
        nprocs=TP,
        join=True,
        start_method="fork",
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(TP)]
    for rank, result in enumerate(results):
        assert result["preloaded"] == rank_daemons[rank].status().preloaded_weights_bytes > 0
        assert result["same_tensors"]
        assert result["sizing"] == min(FREE_EMPTY)
        assert result["daemon"] == result["cold"]
        # Without the correction the pool is sized from a baseline W too low.
        assert result["uncorrected"] != result["cold"]
