"""weightcache.plan: the load-plan contract, its canonical hash, and what it refuses."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tools.plan_fixtures import FIXTURES, read_fixture
from weightcache.checkpoint import TORCH_DTYPES
from weightcache.plan import (
    ITEMSIZE,
    Copy,
    Fill,
    LoadPlan,
    ParamEntry,
    PlanError,
    Region,
    SourceTensor,
    canonical,
    check_plan,
    contiguous_strides,
    decode_plan,
    digits,
    encode_plan,
    plan_hash,
    rebase,
)

SOURCES = {
    "q": SourceTensor("bfloat16", (8, 4)),
    "k": SourceTensor("bfloat16", (4, 4)),
    "v": SourceTensor("bfloat16", (4, 4)),
    "emb": SourceTensor("float32", (10, 4)),
}


def region(t: torch.Tensor) -> Region:
    return Region(t.storage_offset(), list(t.shape), list(t.stride()))


def param(name: str, shape: list[int], dtype: str = "bfloat16", **kw) -> ParamEntry:
    return ParamEntry(name, dtype, shape, contiguous_strides(shape), **kw)


def whole(shape: list[int], offset: int = 0) -> Region:
    return Region(offset, shape, contiguous_strides(shape))


def fused_qkv_plan() -> LoadPlan:
    """qkv [16, 4] from q [8, 4], k and v [4, 4]; emb padded from 10 to 12 rows, cast."""
    return LoadPlan(
        v=1,
        params=[param("qkv", [16, 4]), param("emb", [12, 4], aliases=["lm_head"])],
        copies=[
            Copy("q", whole([8, 4]), "qkv", whole([8, 4])),
            Copy("k", whole([4, 4]), "qkv", whole([4, 4], 32)),
            Copy("v", whole([4, 4]), "qkv", whole([4, 4], 48)),
            Copy("emb", whole([10, 4]), "emb", whole([10, 4])),
        ],
        fills=[Fill("emb", whole([2, 4], 40), 0.0)],
    )


def test_the_dtype_table_is_the_checkpoints() -> None:
    assert set(ITEMSIZE) == set(TORCH_DTYPES)
    assert all(TORCH_DTYPES[n].itemsize == size for n, size in ITEMSIZE.items())


def test_a_valid_plan_passes_with_its_coverage() -> None:
    summary = check_plan(fused_qkv_plan(), SOURCES)
    assert summary.incomplete == []
    assert summary.param_bytes == 16 * 4 * 2 + 12 * 4 * 2
    partial = msgspec.structs.replace(fused_qkv_plan(), fills=[])
    assert check_plan(partial, SOURCES).incomplete == ["emb"]
    assert check_plan(partial, SOURCES).params["emb"].unwritten_bytes == 2 * 4 * 2


def test_a_fused_parameter_missing_a_piece_is_incomplete_by_its_unwritten_bytes() -> None:
    """vLLM's recorded Llama-3-8B plan without the copy of layer 1's up_proj: the up half of
    that layer's gate_up_proj is written by nothing (zeros), its bytes counted."""
    recorded = read_fixture(FIXTURES / "vllm-llama-3-8b.json")
    missing = "model.layers.1.mlp.up_proj.weight"
    copies = [c for c in recorded.plan.copies if c.source != missing]
    assert len(copies) == len(recorded.plan.copies) - 1
    summary = check_plan(msgspec.structs.replace(recorded.plan, copies=copies),
                         recorded.sources())  # fmt: skip
    assert summary.incomplete == ["model.layers.1.mlp.gate_up_proj.weight"]
    fused = summary.params["model.layers.1.mlp.gate_up_proj.weight"]
    assert (fused.unwritten_bytes, fused.nbytes) == (117_440_512, 234_881_024)  # 14336 x 4096


def test_the_hash_ignores_order_and_spelling_but_not_content() -> None:
    plan = fused_qkv_plan()
    shuffled = LoadPlan(
        v=1,
        params=plan.params[::-1],
        copies=plan.copies[::-1],
        fills=plan.fills,
    )
    # A size-1 dim's stride addresses nothing: another spelling of the same copy.
    respelled = msgspec.structs.replace(
        plan,
        copies=[*plan.copies[:3], Copy("emb", Region(0, [1, 10, 4], [77, 4, 1]), "emb",
                                       Region(0, [1, 10, 4], [5, 4, 1]))],
    )  # fmt: skip
    assert plan_hash(shuffled) == plan_hash(plan)
    assert plan_hash(respelled) != plan_hash(plan)  # a 3-dim region is other content
    moved = msgspec.structs.replace(
        plan, copies=[*plan.copies[:2], Copy("v", whole([4, 4]), "qkv", whole([4, 4], 44))]
    )
    assert plan_hash(moved) != plan_hash(plan)
    cast = msgspec.structs.replace(
        plan, copies=[*plan.copies[:3], Copy("emb", whole([10, 4]), "emb", whole([10, 4]),
                                             ["float16"])]
    )  # fmt: skip
    assert plan_hash(cast) != plan_hash(plan)
    assert decode_plan(encode_plan(plan)) == canonical(plan)
    assert plan_hash(decode_plan(encode_plan(plan))) == plan_hash(plan)


def refused(plan: LoadPlan, match: str, sources=SOURCES, **kw) -> None:
    with pytest.raises(PlanError, match=match):
        check_plan(plan, sources, **kw)


def with_copies(*copies: Copy, params=None) -> LoadPlan:
    return LoadPlan(v=1, params=params or [param("qkv", [16, 4])], copies=list(copies))


def test_unknown_tensors_and_parameters_are_refused_by_name() -> None:
    refused(with_copies(Copy("x", whole([4]), "qkv", whole([4]))),
            r"copy 0 \(x -> qkv\): the checkpoint has no tensor 'x'")  # fmt: skip
    refused(with_copies(Copy("q", whole([4]), "kqv", whole([4]))),
            r"copy 0 \(q -> kqv\): the plan has no parameter 'kqv'")  # fmt: skip
    plan = LoadPlan(v=1, params=[param("p", [4])], copies=[], fills=[Fill("r", whole([1]), 0)])
    refused(plan, r"fill 0 \(r\): the plan has no parameter 'r'")


def test_regions_out_of_range_are_refused() -> None:
    refused(with_copies(Copy("k", Region(8, [4, 4], [4, 1]), "qkv", whole([4, 4]))),
            r"source region reaches element 23, past the 16 elements of its tensor \(shape "
            r"\[4, 4\]\)")  # fmt: skip
    refused(with_copies(Copy("q", whole([8, 4]), "qkv", whole([8, 4], 40))),
            "destination region reaches element 71, past the 64 elements")  # fmt: skip
    # A stride reaching out of range counts, not only the offset.
    refused(with_copies(Copy("k", Region(0, [4, 4], [5, 1]), "qkv", whole([4, 4]))),
            "source region reaches element 18")  # fmt: skip
    refused(with_copies(Copy("k", whole([4, 4]), "qkv", whole([2, 8]))),
            r"source region shape \[4, 4\] differs from the destination's \[2, 8\]")  # fmt: skip
    refused(with_copies(Copy("k", Region(0, [4, 4], [4]), "qkv", whole([4, 4]))),
            "source region has 2 dims but 1 strides")  # fmt: skip


def test_overlapping_writes_are_refused() -> None:
    refused(
        with_copies(
            Copy("q", whole([8, 4]), "qkv", whole([8, 4])),
            Copy("k", whole([4, 4]), "qkv", whole([4, 4], 28)),
        ),
        r"copy 1 \(k -> qkv\) overlaps copy 0 \(q -> qkv\) in 'qkv' at element 28",
    )
    # Interleaved columns that do not meet pass; shifting one by a column makes them meet.
    even = Region(0, [16, 2], [4, 2])
    odd = Region(1, [16, 2], [4, 2])
    ok = with_copies(Copy("q", Region(0, [16, 2], [2, 1]), "qkv", even),
                     Copy("q", Region(0, [16, 2], [2, 1]), "qkv", odd))  # fmt: skip
    assert check_plan(ok, SOURCES).incomplete == []
    refused(with_copies(Copy("q", Region(0, [16, 2], [2, 1]), "qkv", even),
                        Copy("q", Region(0, [15, 2], [2, 1]), "qkv", Region(2, [15, 2], [4, 2]))),
            "overlaps")  # fmt: skip
    refused(with_copies(Copy("q", whole([4]), "qkv", Region(0, [4], [0]))),
            "the destination region writes some element twice")  # fmt: skip
    plan = LoadPlan(v=1, params=[param("p", [4])], copies=[],
                    fills=[Fill("p", whole([3]), 0), Fill("p", whole([2], 2), 1)])  # fmt: skip
    refused(plan, r"fill 1 \(p\) overlaps fill 0 \(p\)")
    # Overlap checks that would expand too many runs are refused, not slow.
    refused(ok, "interleave too finely", run_budget=20)


def test_broadcast_reads_are_allowed() -> None:
    plan = with_copies(Copy("k", Region(0, [16, 4], [0, 1]), "qkv", whole([16, 4])))
    assert check_plan(plan, SOURCES).incomplete == []


def test_parameters_must_be_dense_unique_and_bounded() -> None:
    refused(
        LoadPlan(v=1, params=[ParamEntry("p", "float32", [4, 4], [8, 1])], copies=[]),
        r"parameter 'p': strides \[8, 1\] for shape \[4, 4\] do not lay out one dense",
    )
    transposed = LoadPlan(v=1, params=[ParamEntry("p", "float32", [4, 3], [1, 4])], copies=[])
    assert check_plan(transposed, SOURCES).param_bytes == 48
    refused(LoadPlan(v=1, params=[param("p", [4]), param("q", [4], aliases=["p"])], copies=[]),
            "parameter name 'p' appears twice")  # fmt: skip
    # More elements than the checkpoint holds (+1/8 and 16 Mi of padding): refused.
    refused(LoadPlan(v=1, params=[param("p", [1 << 25])], copies=[]),
            "more than the checkpoint's")  # fmt: skip
    refused(LoadPlan(v=1, params=[param("p", [100])], copies=[]), "more than the checkpoint's",
            max_elements=99)  # fmt: skip
    plan = LoadPlan(v=1, params=[param("p", [4])], copies=[],
                    fills=[Fill("p", whole([4]), math.inf)])  # fmt: skip
    refused(plan, "fill value inf is not finite")


def test_absurd_counts_are_refused_by_the_decoder() -> None:
    too_many_dims = {"v": 1, "params": [{"name": "p", "dtype": "float32", "shape": [1] * 9,
                                         "stride": [1] * 9}], "copies": []}  # fmt: skip
    with pytest.raises(PlanError, match=r"\$.params\[0\].shape"):
        decode_plan(msgspec.json.encode(too_many_dims))
    huge = {"v": 1, "params": [{"name": "p", "dtype": "float32", "shape": [1 << 49],
                                "stride": [1]}], "copies": []}  # fmt: skip
    with pytest.raises(PlanError, match=r"\$.params\[0\].shape\[0\]"):
        decode_plan(msgspec.json.encode(huge))
    with pytest.raises(PlanError, match="dtype"):
        decode_plan(
            msgspec.json.encode(
                {
                    "v": 1,
                    "params": [{"name": "p", "dtype": "complex64", "shape": [1], "stride": [1]}],
                    "copies": [],
                }
            )
        )
    with pytest.raises(PlanError, match="params"):
        decode_plan(b'{"v": 1, "params": [], "copies": []}')


# --------------------------------------------------------------------------- geometry vs torch


@st.composite
def viewed(draw):
    """A row-major tensor shape and a chain of torch views over it."""
    shape = draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
    base = torch.arange(math.prod(shape)).view(shape)
    t = base
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["narrow", "step", "select", "transpose", "expand"]))
        if t.dim() == 0:
            break
        d = draw(st.integers(0, t.dim() - 1))
        n = t.shape[d]
        if op == "narrow" and n:
            start = draw(st.integers(0, n - 1))
            t = t.narrow(d, start, draw(st.integers(1, n - start)))
        elif op == "step" and n:
            every = slice(None, None, draw(st.integers(1, 3)))
            t = t[(slice(None),) * d + (every,)]
        elif op == "select" and n and t.dim() > 1:
            t = t.select(d, draw(st.integers(0, n - 1)))
        elif op == "transpose":
            t = t.transpose(d, draw(st.integers(0, t.dim() - 1)))
        elif op == "expand":
            t = t.unsqueeze(d).expand(*t.shape[:d], draw(st.integers(1, 3)), *t.shape[d:])
    return shape, base, t


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(viewed(), st.data())
def test_digits_and_rebase_agree_with_torch(case, data) -> None:
    shape, base, view = case
    r = region(view)
    found = digits(r, shape)
    assert found is not None  # every view chain of a dense tensor is a strided box
    start, steps = found
    if view.numel():
        index = [torch.full(view.shape, a) for a in start]
        for m, step in enumerate(steps):
            pos = torch.arange(view.shape[m]).view([-1 if k == m else 1 for k in range(view.dim())])
            index = [i + pos * s for i, s in zip(index, step, strict=True)]
        assert torch.equal(base[tuple(index)], view)
    # A box around the view, stored on its own: the rebased region reads the same elements.
    if view.numel():
        lo = [a for a in start]
        hi = [a + sum((view.shape[m] - 1) * steps[m][k] for m in range(view.dim())) + 1
              for k, a in enumerate(start)]  # fmt: skip
        box_start = [data.draw(st.integers(0, a)) for a in lo]
        box_shape = [data.draw(st.integers(h, s)) - b for h, s, b in zip(hi, shape, box_start,
                                                                          strict=True)]  # fmt: skip
        box = base[tuple(slice(b, b + n) for b, n in zip(box_start, box_shape, strict=True))]
        moved = rebase(r, shape, box_start, box_shape)
        assert moved is not None
        stored = box.clone().view(-1)  # its own storage, as a shard is
        assert torch.equal(stored.as_strided(moved.shape, moved.stride, moved.offset), view)
        # A box starting one row later, or ending one row earlier, does not hold the view.
        if lo[0] + 1 < shape[0]:
            later = [lo[0] + 1, *box_start[1:]]
            assert rebase(r, shape, later, [shape[0] - lo[0] - 1, *box_shape[1:]]) is None
        assert rebase(r, shape, box_start, [hi[0] - box_start[0] - 1, *box_shape[1:]]) is None


def test_a_region_that_wraps_rows_is_no_box() -> None:
    # Elements 2..5 of a [2, 4] tensor: two of row 0 and two of row 1, not a strided box.
    assert digits(Region(2, [4], [1]), [2, 4]) is None
    assert rebase(Region(0, [2, 4], [4, 1]), [4, 4], [1, 0], [3, 4]) is None


# --------------------------------------------------------------------------- fuzz: valid is safe


def execute(plan: LoadPlan, sources: dict[str, SourceTensor]) -> dict[str, torch.Tensor]:
    """Write counts: for every parameter element, how many copies and fills write it."""
    counts = {p.name: torch.zeros(math.prod(p.shape), dtype=torch.int64) for p in plan.params}
    for write in [*plan.copies, *plan.fills]:
        if isinstance(write, Copy):
            size = math.prod(sources[write.source].shape)
            torch.arange(size).as_strided(write.src.shape, write.src.stride, write.src.offset)
        target = counts[write.param]
        index = torch.arange(target.numel()).as_strided(
            write.dst.shape, write.dst.stride, write.dst.offset
        )
        target.index_add_(0, index.reshape(-1), torch.ones(index.numel(), dtype=torch.int64))
    return counts


dims = st.lists(st.integers(0, 6), min_size=0, max_size=3)
regions = st.builds(lambda o, sh, sd: Region(o, sh, sd[: len(sh)] + [0] * (len(sh) - len(sd))),
                    st.integers(0, 40), dims, st.lists(st.integers(0, 12), max_size=3))  # fmt: skip


@st.composite
def plans(draw):
    params = [param(f"p{i}", draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
              for i in range(draw(st.integers(1, 3)))]  # fmt: skip
    names = [p.name for p in params] + ["nope"]
    copies = [Copy(draw(st.sampled_from([*SOURCES, "x"])), draw(regions),
                   draw(st.sampled_from(names)), draw(regions)) for _ in range(draw(
                       st.integers(0, 4)))]  # fmt: skip
    copies = [msgspec.structs.replace(c, src=msgspec.structs.replace(c.src, shape=c.dst.shape,
              stride=(c.src.stride + [0] * 3)[: len(c.dst.shape)]))
              if draw(st.booleans()) else c for c in copies]  # fmt: skip
    fills = [Fill(draw(st.sampled_from(names)), draw(regions), 0.0)
             for _ in range(draw(st.integers(0, 2)))]  # fmt: skip
    return LoadPlan(v=1, params=params, copies=copies, fills=fills)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans())
def test_a_plan_that_passes_never_reads_or_writes_out_of_range_nor_twice(plan) -> None:
    try:
        summary = check_plan(plan, SOURCES)
    except PlanError:
        return
    counts = execute(plan, SOURCES)  # as_strided and index_add_ raise on out-of-range
    for name, count in counts.items():
        assert int(count.max()) <= 1, name
        assert summary.params[name].complete == bool((count == 1).all())


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_garbage_is_refused_as_a_plan_error(data) -> None:
    try:
        plan = decode_plan(data)
    except PlanError:
        return
    try:
        check_plan(plan, SOURCES)
    except PlanError:
        pass
