"""weightcache.layout: grouping, offsets, and zero-copy views that keep every tensor's shape."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightcache.layout import (
    ALIGNMENT,
    TensorSpec,
    build_views,
    check_layout,
    plan_layout,
    plan_param_layout,
    tensor_specs,
)
from weightcache.protocol import Layout, TensorGroup

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def random_tensor(spec: TensorSpec, generator: torch.Generator) -> torch.Tensor:
    raw = torch.randint(0, 256, (spec.nbytes,), dtype=torch.uint8, generator=generator)
    if spec.dtype == torch.bool:
        raw = raw % 2
    return raw.view(spec.dtype).view(spec.shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (random bytes make NaNs, which ``torch.equal`` calls unequal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def fill(layout: Layout, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Flat buffers holding ``tensors`` where the layout says, as a loader would write them."""
    buffers = [torch.zeros(size, dtype=torch.uint8) for size in layout.allocation_sizes]
    for spec, allocation, offset in tensor_specs(layout):
        if spec.nbytes == 0:
            continue
        data = tensors[spec.name].contiguous().view(-1).view(torch.uint8)
        buffers[allocation][offset : offset + spec.nbytes] = data
    return buffers


def test_groups_by_dtype_and_shape_in_first_seen_order() -> None:
    specs = [
        TensorSpec("a.w", torch.float32, (4, 3)),
        TensorSpec("a.b", torch.float32, (3,)),
        TensorSpec("b.w", torch.float32, (4, 3)),
        TensorSpec("b.b", torch.float32, (3,)),
        TensorSpec("c.w", torch.bfloat16, (4, 3)),
    ]
    layout = plan_layout(specs)
    assert [(g.dtype, g.shape, g.names) for g in layout.groups] == [
        ("float32", [4, 3], ["a.w", "b.w"]),
        ("float32", [3], ["a.b", "b.b"]),
        ("bfloat16", [4, 3], ["c.w"]),
    ]
    # Every tensor starts on a 256-byte boundary, groups back to back.
    assert [(g.offset, g.step) for g in layout.groups] == [(0, 256), (512, 256), (1024, 256)]
    assert layout.allocation_sizes == [1280]
    check_layout(layout)


def test_allocation_rounds_up_to_the_requested_granularity() -> None:
    specs = [TensorSpec("w", torch.float32, (1000,))]
    layout = plan_layout(specs, allocation_alignment=2 * 1024 * 1024)
    assert layout.allocation_sizes == [2 * 1024 * 1024]
    assert layout.groups[0].step == 4096


def test_views_share_the_buffer_and_keep_dtype_shape_stride_and_offset() -> None:
    specs = [
        TensorSpec("emb", torch.float16, (7, 5)),
        TensorSpec("ids", torch.int64, (9,)),
        TensorSpec("mask", torch.bool, (2, 3, 4)),
        TensorSpec("emb2", torch.float16, (7, 5)),
        TensorSpec("scalar", torch.float32, ()),
    ]
    generator = torch.Generator().manual_seed(0)
    tensors = {s.name: random_tensor(s, generator) for s in specs}
    layout = plan_layout(specs)
    buffers = fill(layout, tensors)
    views = build_views(buffers, layout)
    storage = buffers[0].untyped_storage().data_ptr()
    for spec, _, offset in tensor_specs(layout):
        view = views[spec.name]
        assert view.dtype == spec.dtype
        assert tuple(view.shape) == spec.shape
        assert view.stride() == torch.empty(spec.shape).stride()
        assert view.is_contiguous()
        assert view.untyped_storage().data_ptr() == storage
        assert view.storage_offset() * spec.dtype.itemsize == offset
        assert same_bits(view, tensors[spec.name])
    # No copy: a byte written to the buffer shows through the view.
    offset = next(o for s, _, o in tensor_specs(layout) if s.name == "ids")
    buffers[0][offset : offset + 8] = torch.tensor([42], dtype=torch.int64).view(torch.uint8)
    assert views["ids"][0].item() == 42


def test_zero_size_tensors_get_their_own_empty_views() -> None:
    specs = [
        TensorSpec("empty", torch.float32, (0, 4)),
        TensorSpec("also_empty", torch.float32, (0, 4)),
        TensorSpec("w", torch.float32, (2,)),
    ]
    layout = plan_layout(specs)
    assert layout.groups[0].step == 0
    check_layout(layout)
    views = build_views(fill(layout, {"w": torch.ones(2)}), layout)
    for name in ("empty", "also_empty"):
        assert views[name].shape == (0, 4) and views[name].dtype == torch.float32
    assert views["empty"] is not views["also_empty"]
    assert torch.equal(views["w"], torch.ones(2))


def test_a_layout_of_only_zero_size_tensors() -> None:
    layout = plan_layout([TensorSpec("nothing", torch.int8, (3, 0))])
    assert layout.allocation_sizes == [0]
    views = build_views([torch.empty(0, dtype=torch.uint8)], layout)
    assert views["nothing"].shape == (3, 0)


def test_aliases_are_the_same_tensor() -> None:
    base = plan_layout([TensorSpec("embed", torch.float32, (4, 2))])
    layout = Layout(base.allocation_sizes, base.groups, aliases={"lm_head": "embed"})
    check_layout(layout)
    views = build_views(fill(layout, {"embed": torch.arange(8.0).view(4, 2)}), layout)
    assert views["lm_head"] is views["embed"]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(DTYPES),
            st.lists(st.integers(min_value=0, max_value=5), min_size=0, max_size=3),
        ),
        min_size=1,
        max_size=12,
    ),
    st.integers(min_value=0, max_value=2**31),
)
def test_any_mix_of_tensors_survives_the_round_trip(kinds, seed) -> None:
    specs = [TensorSpec(f"t{i}", dtype, tuple(shape)) for i, (dtype, shape) in enumerate(kinds)]
    generator = torch.Generator().manual_seed(seed)
    tensors = {s.name: random_tensor(s, generator) for s in specs}
    layout = plan_layout(specs)
    check_layout(layout)
    assert sum(len(g.names) for g in layout.groups) == len(specs)
    assert len(layout.groups) == len({(s.dtype, s.shape) for s in specs})
    assert layout.allocation_sizes[0] % ALIGNMENT == 0
    assert layout.allocation_sizes[0] >= sum(s.nbytes for s in specs)
    views = build_views(fill(layout, tensors), layout)
    for spec in specs:
        assert views[spec.name].dtype == spec.dtype
        assert tuple(views[spec.name].shape) == spec.shape
        assert same_bits(views[spec.name], tensors[spec.name])
    # Tensors never overlap: each one's bytes lie in its own step-sized slot.
    slots = sorted((offset, offset + s.nbytes) for s, _, offset in tensor_specs(layout))
    for (_, end), (start, _) in zip(slots, slots[1:], strict=False):
        assert end <= start


def group(**overrides) -> TensorGroup:
    fields = dict(allocation=0, dtype="float32", shape=[4], offset=0, step=16, names=["w"])
    fields.update(overrides)
    return TensorGroup(**fields)


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (Layout([64], [group(allocation=1)]), "allocation 1, which is absent"),
        (Layout([64], [group(step=8)]), "step or offset"),
        (Layout([64], [group(offset=2)]), "step or offset"),
        (Layout([64], [group(step=18)]), "step or offset"),
        (Layout([64], [group(offset=56)]), "past the end"),
        (Layout([64], [group(names=["a", "b", "c", "d", "e"])]), "past the end"),
        (Layout([64], [group(), group(offset=16)]), "appears twice"),
        (Layout([64], [group()], aliases={"x": "y"}), "not in the layout"),
        (Layout([64], [group(dtype="complex64")]), "unknown dtype"),
    ],
)
def test_check_layout_rejects_layouts_that_read_outside_their_memory(layout, message) -> None:
    with pytest.raises(ValueError, match=message):
        check_layout(layout)


def test_tensor_specs_lists_every_tensor_with_its_place() -> None:
    layout = Layout(
        [4096],
        [
            group(shape=[2, 2], offset=0, step=256, names=["a", "b"]),
            group(dtype="int8", shape=[3], offset=512, step=256, names=["c"]),
        ],
    )
    assert [(s.name, s.dtype, s.shape, a, o) for s, a, o in tensor_specs(layout)] == [
        ("a", torch.float32, (2, 2), 0, 0),
        ("b", torch.float32, (2, 2), 0, 256),
        ("c", torch.int8, (3,), 0, 512),
    ]
    assert math.prod(layout.groups[0].shape) == 4


def test_an_engines_parameter_table_lays_out_with_strides_and_aliases() -> None:
    from weightcache.plan import ParamEntry

    params = [
        ParamEntry("qkv", "bfloat16", [6, 4], [4, 1], aliases=[]),
        ParamEntry("o", "bfloat16", [6, 4], [4, 1]),
        ParamEntry("w_t", "float32", [4, 3], [1, 4]),  # a transposed parameter
        ParamEntry("embed", "float32", [5, 2], [2, 1], aliases=["lm_head"]),
    ]
    layout = plan_param_layout(params, allocation_alignment=4096)
    check_layout(layout)
    assert [(g.names, g.stride) for g in layout.groups] == [
        (["qkv", "o"], None),
        (["w_t"], [1, 4]),
        (["embed"], None),
    ]
    assert layout.aliases == {"lm_head": "embed"}
    assert layout.allocation_sizes == [4096]
    buffer = torch.arange(4096, dtype=torch.uint8)
    views = build_views([buffer], layout)
    w_t = views["w_t"]
    assert w_t.shape == (4, 3) and w_t.stride() == (1, 4)
    offset = layout.groups[1].offset
    assert w_t.data_ptr() == buffer.data_ptr() + offset
    dense_bytes = buffer[offset : offset + 48].view(torch.float32).view(3, 4)
    assert torch.equal(w_t, dense_bytes.t())
    assert views["lm_head"] is views["embed"]
    bad = Layout([4096], [TensorGroup(0, "float32", [4, 3], 0, 64, ["x"], [4, 1])])
    with pytest.raises(ValueError, match="strides that are not one dense layout"):
        check_layout(bad)
