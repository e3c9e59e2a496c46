"""Shard plans (pure): which dim each tensor splits along, and the byte ranges a rank reads.

The ranges are checked against torch: concatenating a rank's ranges of the
tensor's bytes must give exactly ``torch.chunk(tensor, tp_size, dim)[rank]``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightcache.protocol import ShardSpec
from weightcache.shard import (
    PLAN_NAMES,
    ShardError,
    check_spec,
    plan_shards,
    shard_tensor,
    split_dim,
)


@pytest.mark.parametrize(
    ("name", "dim"),
    [
        ("model.layers.0.self_attn.q_proj.weight", 0),
        ("model.layers.0.self_attn.k_proj.weight", 0),
        ("model.layers.0.self_attn.v_proj.weight", 0),
        ("model.layers.31.self_attn.q_proj.bias", 0),
        ("model.layers.0.mlp.gate_proj.weight", 0),
        ("model.layers.0.mlp.up_proj.weight", 0),
        ("model.embed_tokens.weight", 0),
        ("lm_head.weight", 0),
        ("model.layers.0.self_attn.o_proj.weight", 1),
        ("model.layers.0.mlp.down_proj.weight", 1),
        # Row-parallel biases are added once after the all-reduce: whole on every rank.
        ("model.layers.0.self_attn.o_proj.bias", None),
        ("model.layers.0.input_layernorm.weight", None),
        ("model.layers.0.post_attention_layernorm.weight", None),
        ("model.norm.weight", None),
        ("model.layers.0.self_attn.rotary_emb.inv_freq", None),
        # A name that only contains a rule's word is not that layer.
        ("model.layers.0.self_attn.q_proj_scale", None),
        ("model.my_lm_head.weight", None),
    ],
)
def test_llama_plan_splits_column_and_vocab_parallel_on_dim_0_row_parallel_on_dim_1(name, dim):
    assert split_dim("llama", name) == dim


def test_no_plan_replicates_everything():
    assert split_dim(None, "model.layers.0.self_attn.q_proj.weight") is None


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _check_against_torch(shape, dtype, dim, tp_size):
    numel = math.prod(shape)
    source = torch.arange(numel, dtype=torch.int32).to(dtype).reshape(shape)
    data = _bytes(source)
    expected = torch.chunk(source, tp_size, dim) if numel else None
    for rank in range(tp_size):
        shard = shard_tensor("t", tuple(shape), len(data), dim, tp_size, rank)
        got = b"".join(data[a:b] for a, b in shard.ranges)
        assert shard.nbytes == len(got)
        assert all(a <= b for a, b in shard.ranges)
        assert all(b <= c for (_, b), (c, _) in zip(shard.ranges, shard.ranges[1:], strict=False))
        if expected is not None:
            assert shard.shape == tuple(expected[rank].shape)
            assert got == _bytes(expected[rank])
        else:
            assert got == b""
            assert math.prod(shard.shape) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
@pytest.mark.parametrize(
    ("shape", "dim"), [((8, 6), 0), ((8, 6), 1), ((4, 6, 10), 1), ((4, 6, 10), 2), ((12,), 0)]
)
def test_ranges_give_exactly_torch_chunk(shape, dim, dtype):
    for tp_size in (1, 2):
        _check_against_torch(shape, dtype, dim, tp_size)


@settings(max_examples=60, deadline=None)
@given(
    tp_size=st.sampled_from([1, 2, 3, 4, 8]),
    data=st.data(),
)
def test_ranges_give_exactly_torch_chunk_for_any_shape(tp_size, data):
    rank_count = data.draw(st.integers(1, 4))
    shape = data.draw(st.lists(st.integers(0, 5), min_size=rank_count, max_size=rank_count))
    dim = data.draw(st.integers(0, rank_count - 1))
    shape[dim] *= tp_size  # divisible; the error for the rest is checked below
    _check_against_torch(tuple(shape), torch.float16, dim, tp_size)


def test_dim_0_is_one_contiguous_range_and_dim_1_one_range_per_row():
    rows, cols = 6, 8
    column = shard_tensor("q", (rows, cols), rows * cols * 2, 0, 2, 1)
    assert column.ranges == [(rows // 2 * cols * 2, rows * cols * 2)]
    row = shard_tensor("o", (rows, cols), rows * cols * 2, 1, 2, 1)
    assert row.ranges == [(r * cols * 2 + 8, r * cols * 2 + 16) for r in range(rows)]
    assert row.shape == (rows, cols // 2)


def test_a_split_dim_not_divisible_by_tp_size_is_refused_naming_the_tensor():
    with pytest.raises(
        ShardError, match=r"'model.layers.3.mlp.down_proj.weight'.*dim 1.*tp_size 4"
    ):
        shard_tensor("model.layers.3.mlp.down_proj.weight", (8, 6), 96, 1, 4, 0)
    with pytest.raises(ShardError, match=r"'x'.*no dim 1"):
        shard_tensor("x", (8,), 32, 1, 2, 0)


class _T:
    def __init__(self, name: str, shape: tuple[int, ...], itemsize: int = 2) -> None:
        self.name, self.shape, self.nbytes = name, shape, math.prod(shape) * itemsize


LLAMA = [
    _T("model.embed_tokens.weight", (32, 8)),
    _T("model.layers.0.self_attn.q_proj.weight", (8, 8)),
    _T("model.layers.0.self_attn.o_proj.weight", (8, 8)),
    _T("model.layers.0.mlp.down_proj.weight", (8, 12)),
    _T("model.norm.weight", (8,)),
    _T("lm_head.weight", (32, 8)),
]


def test_plan_shards_gives_every_tensor_its_rank_local_shape_in_order():
    shards = plan_shards(LLAMA, ShardSpec(tp_size=2, tp_rank=1, plan="llama"))
    assert list(shards) == [t.name for t in LLAMA]
    assert {n: s.shape for n, s in shards.items()} == {
        "model.embed_tokens.weight": (16, 8),
        "model.layers.0.self_attn.q_proj.weight": (4, 8),
        "model.layers.0.self_attn.o_proj.weight": (8, 4),
        "model.layers.0.mlp.down_proj.weight": (8, 6),
        "model.norm.weight": (8,),
        "lm_head.weight": (16, 8),
    }
    assert shards["model.norm.weight"].dim is None
    assert shards["model.norm.weight"].ranges == [(0, 16)]


def test_plan_shards_refuses_the_first_tensor_that_does_not_split():
    bad = [*LLAMA, _T("model.layers.1.mlp.gate_proj.weight", (10, 8))]
    with pytest.raises(ShardError, match="'model.layers.1.mlp.gate_proj.weight'.*10.*tp_size 4"):
        plan_shards(bad, ShardSpec(tp_size=4, tp_rank=0, plan="llama"))


def test_without_tp_every_tensor_is_whole():
    shards = plan_shards(LLAMA, ShardSpec())
    assert all(s.ranges == [(0, t.nbytes)] and s.shape == t.shape
               for s, t in zip(shards.values(), LLAMA, strict=True))  # fmt: skip


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (ShardSpec(tp_size=2, tp_rank=0, plan=None), "tp_size 2 needs a shard plan"),
        (ShardSpec(tp_size=2, tp_rank=0, plan="gpt"), "unknown shard plan 'gpt'"),
        (ShardSpec(tp_size=2, tp_rank=2, plan="llama"), r"rank 2 of 2"),
    ],
)
def test_bad_specs_are_refused_saying_why(spec, message):
    with pytest.raises(ShardError, match=message):
        check_spec(spec)


def test_plan_names_are_the_known_plans():
    assert PLAN_NAMES == ("llama",)
    check_spec(ShardSpec(tp_size=1, tp_rank=0, plan="llama"))
