"""Load plans: how an engine's parameters are filled from checkpoint tensors (pure, torch-free).

An engine's weight loading, traced once on the engine side
(:mod:`weightcache.integrations.trace`), becomes a :class:`LoadPlan`:

- ``params``: the engine's parameter table (name, dtype, shape, element
  strides; tied names as ``aliases``). Each parameter owns one dense storage.
- ``copies``: a region of a checkpoint tensor (by name; element offset,
  shape and strides into the tensor's row-major elements, so any narrow,
  slice, select, transpose or broadcast of it) copied into a region of one
  parameter's storage, with the dtype casts on the way (``casts``, applied in
  order before the final cast to the parameter's dtype).
- ``fills``: a region of a parameter set to a constant (vocabulary padding).

Bytes nothing writes are zero. The daemon executes a plan from the bytes it
verified; the engine maps the result by name. A plan is content-addressed:
:func:`plan_hash` is the SHA-256 of its canonical form (:func:`canonical`),
computed by the daemon itself, and joins the ``CacheConfig`` of the layout it
builds. :func:`check_plan` refuses, naming the copy or parameter, anything
that could read outside a checkpoint tensor, write outside a parameter,
write an element twice, or ask for far more memory than the checkpoint holds.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Literal

import msgspec

PLAN_VERSION = 1

# torch's names (as the wire and checkpoint.TORCH_DTYPES spell them) and element sizes.
ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
DtypeName = Literal[
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
    "bool", "float8_e4m3fn", "float8_e5m2",
]  # fmt: skip

MAX_DIMS = 8
MAX_CASTS = 3
MAX_PARAMS = 1 << 20
MAX_COPIES = 1 << 22
MAX_FILLS = 1 << 20
MAX_ALIASES = 64
# Elements of one tensor or region: 2^48 (a 256 TiB float8 tensor) bounds every product.
MAX_ELEMENTS = 1 << 48
# Runs expanded to prove that regions whose extents meet do not overlap.
OVERLAP_RUN_BUDGET = 1 << 20

Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_ELEMENTS)]
Dims = Annotated[list[Count], msgspec.Meta(max_length=MAX_DIMS)]
TensorName = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]


class PlanError(ValueError):
    """A plan the daemon will not execute; the message names the copy or parameter."""


class Region(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """Elements ``offset + sum(i[k] * stride[k])`` for every index ``i`` within ``shape``."""

    offset: Count
    shape: Dims
    stride: Dims


class ParamEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: TensorName
    dtype: DtypeName
    shape: Dims
    stride: Dims
    # Other names of the same parameter (tied weights).
    aliases: Annotated[list[TensorName], msgspec.Meta(max_length=MAX_ALIASES)] = []


class Copy(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    source: TensorName
    src: Region
    param: TensorName
    dst: Region
    # Intermediate dtypes the source passes through, in order, before the parameter's.
    casts: Annotated[list[DtypeName], msgspec.Meta(max_length=MAX_CASTS)] = []


class Fill(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    param: TensorName
    dst: Region
    value: float


class LoadPlan(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    v: Literal[1]
    params: Annotated[list[ParamEntry], msgspec.Meta(min_length=1, max_length=MAX_PARAMS)]
    copies: Annotated[list[Copy], msgspec.Meta(max_length=MAX_COPIES)]
    fills: Annotated[list[Fill], msgspec.Meta(max_length=MAX_FILLS)] = []


@dataclass(frozen=True)
class SourceTensor:
    """A checkpoint tensor as the plan sees it (``checkpoint.TensorRecord`` fits)."""

    dtype: str
    shape: tuple[int, ...]


# --------------------------------------------------------------------------- canonical form


def _region_key(r: Region) -> tuple:
    return (r.offset, tuple(r.shape), tuple(r.stride))


def normal_region(r: Region) -> Region:
    """The same elements, spelled one way: a dimension of size 1 has stride 0."""
    if all(s != 1 or st == 0 for s, st in zip(r.shape, r.stride, strict=False)):
        return r
    stride = [0 if s == 1 else st for s, st in zip(r.shape, r.stride, strict=False)]
    return Region(r.offset, list(r.shape), stride)


def canonical(plan: LoadPlan) -> LoadPlan:
    """The plan in one order and spelling: parameters by name, copies and fills by where they
    write. Writes never overlap in a valid plan, so the order does not change the result."""
    copies = [
        Copy(c.source, normal_region(c.src), c.param, normal_region(c.dst), list(c.casts))
        for c in plan.copies
    ]
    fills = [Fill(f.param, normal_region(f.dst), f.value) for f in plan.fills]
    params = [
        ParamEntry(p.name, p.dtype, list(p.shape), list(p.stride), sorted(p.aliases))
        for p in plan.params
    ]
    return LoadPlan(
        v=PLAN_VERSION,
        params=sorted(params, key=lambda p: p.name),
        copies=sorted(
            copies,
            key=lambda c: (c.param, _region_key(c.dst), c.source, _region_key(c.src), c.casts),
        ),
        fills=sorted(fills, key=lambda f: (f.param, _region_key(f.dst), f.value)),
    )


def encode_plan(plan: LoadPlan) -> bytes:
    """The canonical plan as sorted-key JSON (what is hashed, and what fixtures store)."""
    return msgspec.json.encode(canonical(plan), order="sorted")


def decode_plan(data: bytes) -> LoadPlan:
    try:
        return msgspec.json.decode(data, type=LoadPlan)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise PlanError(f"not a load plan: {exc}") from None


def plan_hash(plan: LoadPlan) -> str:
    """Hex SHA-256 of the canonical plan: the layout's name on the wire and in configs."""
    return hashlib.sha256(b"weightcache-load-plan\0" + encode_plan(plan)).hexdigest()


# --------------------------------------------------------------------------- geometry


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def extent(r: Region) -> tuple[int, int] | None:
    """[first, last] element a region touches; None for an empty region."""
    if any(s == 0 for s in r.shape):
        return None
    return r.offset, r.offset + sum((s - 1) * st for s, st in zip(r.shape, r.stride, strict=True))


def dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether shape/stride lay out exactly ``numel`` consecutive elements (any dim order)."""
    dims = sorted((st, s) for s, st in zip(shape, stride, strict=True) if s != 1)
    if any(s == 0 for _, s in dims):
        return True
    expected = 1
    for st, s in dims:
        if st != expected:
            return False
        expected *= s
    return True


def contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides = []
    running = 1
    for s in reversed(shape):
        strides.append(running)
        running *= max(s, 1)
    return strides[::-1]


def nested(r: Region) -> bool:
    """Whether each stride reaches past everything the smaller ones cover, so no element is
    addressed twice (every view that slices a dense tensor is nested)."""
    reach = 0
    for st, s in sorted((st, s) for s, st in zip(r.shape, r.stride, strict=True) if s > 1):
        if st <= reach:
            return False
        reach += (s - 1) * st
    return True


def runs(r: Region, budget: int) -> list[tuple[int, int]] | None:
    """A nested region as sorted ``(start, length)`` runs of consecutive elements; None when
    it has more than ``budget`` runs."""
    dims = sorted(((st, s) for s, st in zip(r.shape, r.stride, strict=True) if s > 1), reverse=True)
    if any(s == 0 for s in r.shape):
        return []
    length = 1
    while dims and dims[-1][0] == length:
        length *= dims.pop()[1]
    count = numel([s for _, s in dims])
    if count > budget:
        return None
    starts = [r.offset]
    for st, s in dims:
        starts = [a + i * st for a in starts for i in range(s)]
    return [(a, length) for a in starts]


def locate(g: Region, frame: Region) -> tuple[list[int], list[list[int]]] | None:
    """``g``'s elements as indices into the nested region ``frame`` (both over one storage):
    the start index, and for each of ``g``'s dims the index step it makes. None unless every
    element of ``g`` is ``frame``'s element ``start + sum(i[m] * step[m])``, i.e. ``g`` is a
    strided box of ``frame`` (what a chain of narrow/slice/select/transpose/expand gives)."""
    order = sorted((k for k, s in enumerate(frame.shape) if s > 1), key=lambda k: -frame.stride[k])

    def split(value: int) -> list[int] | None:
        out = [0] * len(frame.shape)
        for k in order:
            out[k], value = divmod(value, frame.stride[k])
        return out if value == 0 else None

    if g.offset < frame.offset:
        return None
    start = split(g.offset - frame.offset)
    if start is None:
        return None
    steps = []
    for s, st in zip(g.shape, g.stride, strict=True):
        step = [0] * len(frame.shape) if s <= 1 else split(st)
        if step is None:
            return None
        steps.append(step)
    for k, size in enumerate(frame.shape):
        reach = start[k] + sum((s - 1) * step[k] for s, step in zip(g.shape, steps, strict=True))
        if reach >= max(size, 1):
            return None
    return start, steps


def digits(r: Region, shape: Sequence[int]) -> tuple[list[int], list[list[int]]] | None:
    """:func:`locate` in a whole row-major tensor of ``shape``."""
    return locate(r, Region(0, list(shape), contiguous_strides(shape)))


def narrow(r: Region, dim: int, start: int, length: int) -> Region:
    shape = list(r.shape)
    shape[dim] = length
    return Region(r.offset + start * r.stride[dim], shape, list(r.stride))


def select(r: Region, dim: int, index: int) -> Region:
    return Region(
        r.offset + index * r.stride[dim],
        [s for k, s in enumerate(r.shape) if k != dim],
        [st for k, st in enumerate(r.stride) if k != dim],
    )


def through(g: Region, frame: Region, image: Region) -> Region | None:
    """Where ``g`` (a strided box of ``frame``) lands in ``image``, a region of the same shape
    as ``frame`` over another storage; None if ``g`` is no box of ``frame``."""
    found = locate(g, frame)
    if found is None:
        return None
    start, steps = found
    offset = image.offset + sum(a * st for a, st in zip(start, image.stride, strict=True))
    stride = [sum(d * st for d, st in zip(step, image.stride, strict=True)) for step in steps]
    return Region(offset, list(g.shape), stride)


def rebase(r: Region, shape: Sequence[int], box_start: Sequence[int],
           box_shape: Sequence[int]) -> Region | None:  # fmt: skip
    """``r`` (elements of a row-major tensor of ``shape``) as elements of the sub-box
    ``box_start``/``box_shape`` of it stored row-major on its own; None unless ``r`` lies
    inside the box (a tensor-parallel shard, for instance)."""
    found = digits(r, shape)
    if found is None:
        return None
    start, steps = found
    for k, (lo, n) in enumerate(zip(box_start, box_shape, strict=True)):
        reach = start[k] + sum((s - 1) * step[k] for s, step in zip(r.shape, steps, strict=True))
        if start[k] < lo or (numel(r.shape) and reach >= lo + n):
            return None
    inner = contiguous_strides(box_shape)
    offset = sum((a - lo) * st for a, lo, st in zip(start, box_start, inner, strict=True))
    stride = [sum(d * st for d, st in zip(step, inner, strict=True)) for step in steps]
    return Region(offset, list(r.shape), stride)


# --------------------------------------------------------------------------- validation


@dataclass
class ParamCoverage:
    entry: ParamEntry
    numel: int
    written: int = 0

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.entry.dtype]

    @property
    def complete(self) -> bool:
        return self.written == self.numel

    @property
    def unwritten_bytes(self) -> int:
        """The bytes no copy or fill writes (zeros in the layout)."""
        return (self.numel - self.written) * ITEMSIZE[self.entry.dtype]


@dataclass
class PlanSummary:
    """What a valid plan asks for."""

    params: dict[str, ParamCoverage] = field(default_factory=dict)

    @property
    def param_bytes(self) -> int:
        return sum(p.nbytes for p in self.params.values())

    @property
    def incomplete(self) -> list[str]:
        """Parameters with bytes no copy or fill writes (they hold zeros)."""
        return [name for name, p in self.params.items() if not p.complete]


def max_plan_elements(sources: Mapping[str, SourceTensor]) -> int:
    """The most parameter elements a plan may ask for: the checkpoint's, plus 1/8 and 16 Mi
    for padding (vocabularies padded to a multiple, experts to a tile)."""
    total = sum(numel(t.shape) for t in sources.values())
    return total + total // 8 + (1 << 24)


def check_plan(
    plan: LoadPlan,
    sources: Mapping[str, SourceTensor],
    *,
    max_elements: int | None = None,
    run_budget: int = OVERLAP_RUN_BUDGET,
) -> PlanSummary:
    """Refuse (PlanError, naming what) a plan that reads outside a checkpoint tensor, writes
    outside a parameter or twice to one element, names unknown tensors or parameters, or
    holds more elements than ``max_elements`` (default :func:`max_plan_elements`)."""
    limit = max_plan_elements(sources) if max_elements is None else max_elements
    summary = PlanSummary()
    names: set[str] = set()
    total = 0
    for p in plan.params:
        _check_param(p, names)
        count = numel(p.shape)
        total += count
        if total > limit:
            raise PlanError(
                f"the plan's parameters hold over {limit} elements, more than the "
                f"checkpoint's (+1/8 for padding); refused at {p.name!r}"
            )
        summary.params[p.name] = ParamCoverage(p, count)
    writes: dict[str, list[tuple[Region, str]]] = {}
    for i, c in enumerate(plan.copies):
        what = f"copy {i} ({c.source} -> {c.param})"
        source = sources.get(c.source)
        if source is None:
            raise PlanError(f"{what}: the checkpoint has no tensor {c.source!r}")
        _check_region(c.src, numel(source.shape), what, "source", source.shape)
        param = _param(summary, c.param, what)
        if list(c.src.shape) != list(c.dst.shape):
            raise PlanError(
                f"{what}: source region shape {list(c.src.shape)} differs from the "
                f"destination's {list(c.dst.shape)}"
            )
        _check_region(c.dst, param.numel, what, "destination", tuple(param.entry.shape))
        writes.setdefault(c.param, []).append((c.dst, what))
    for i, f in enumerate(plan.fills):
        what = f"fill {i} ({f.param})"
        param = _param(summary, f.param, what)
        if not math.isfinite(f.value):
            raise PlanError(f"{what}: fill value {f.value} is not finite")
        _check_region(f.dst, param.numel, what, "destination", tuple(param.entry.shape))
        writes.setdefault(f.param, []).append((f.dst, what))
    budget = [run_budget]
    for name, regions in writes.items():
        for r, what in regions:
            if not nested(r):
                raise PlanError(f"{what}: the destination region writes some element twice")
        _check_disjoint(name, regions, budget)
        summary.params[name].written = sum(numel(r.shape) for r, _ in regions)
    return summary


def _check_param(p: ParamEntry, names: set[str]) -> None:
    if len(p.shape) != len(p.stride):
        raise PlanError(f"parameter {p.name!r}: {len(p.shape)} dims but {len(p.stride)} strides")
    if numel(p.shape) > MAX_ELEMENTS:
        raise PlanError(f"parameter {p.name!r}: shape {p.shape} is absurdly large")
    if not dense(p.shape, p.stride):
        raise PlanError(
            f"parameter {p.name!r}: strides {p.stride} for shape {p.shape} do not lay out "
            "one dense storage"
        )
    for name in (p.name, *p.aliases):
        if name in names:
            raise PlanError(f"parameter name {name!r} appears twice in the plan")
        names.add(name)


def _param(summary: PlanSummary, name: str, what: str) -> ParamCoverage:
    param = summary.params.get(name)
    if param is None:
        raise PlanError(f"{what}: the plan has no parameter {name!r}")
    return param


def _check_region(r: Region, size: int, what: str, side: str, shape: Sequence[int]) -> None:
    if len(r.shape) != len(r.stride):
        raise PlanError(
            f"{what}: {side} region has {len(r.shape)} dims but {len(r.stride)} strides"
        )
    if numel(r.shape) > MAX_ELEMENTS:
        raise PlanError(f"{what}: {side} region shape {r.shape} is absurdly large")
    span = extent(r)
    if span is not None and span[1] >= size:
        raise PlanError(
            f"{what}: {side} region reaches element {span[1]}, past the {size} elements of "
            f"its tensor (shape {list(shape)})"
        )


def _check_disjoint(name: str, regions: list[tuple[Region, str]], budget: list[int]) -> None:
    """No two regions of one parameter share an element: extents first, runs where they meet."""
    spans = sorted((span, i) for i, (r, _) in enumerate(regions) if (span := extent(r)) is not None)
    cluster: list[int] = []
    reach = -1
    for (lo, hi), i in [*spans, ((None, None), -1)]:  # type: ignore[list-item]
        if i >= 0 and lo <= reach:
            cluster.append(i)
            reach = max(reach, hi)
            continue
        if len(cluster) > 1:
            _check_runs(name, [regions[j] for j in cluster], budget)
        if i >= 0:
            cluster, reach = [i], hi


def _check_runs(name: str, regions: list[tuple[Region, str]], budget: list[int]) -> None:
    tagged: list[tuple[int, int, str]] = []
    for r, what in regions:
        expanded = runs(r, budget[0])
        if expanded is None:
            raise PlanError(
                f"{what}: writes into {name!r} interleave too finely to check for overlap"
            )
        budget[0] -= len(expanded)
        tagged += [(a, n, what) for a, n in expanded]
    tagged.sort()
    for (a, n, first), (b, _, second) in _pairs(tagged):
        if b < a + n:
            raise PlanError(f"{second} overlaps {first} in {name!r} at element {b}")


def _pairs(items: list) -> Iterator[tuple]:
    return zip(items, items[1:], strict=False)
