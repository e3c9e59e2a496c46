"""Where each tensor sits inside the daemon's allocations, and views over them.

Tensors of equal dtype and shape are placed back to back at a fixed step, so
the engine turns a whole group into views with one ``view(count, *shape)`` and
one ``unbind``: attach costs O(groups), not O(tensors), in Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from weightcache.checkpoint import dtype_from_name, dtype_name
from weightcache.plan import ParamEntry, contiguous_strides, dense
from weightcache.protocol import Layout, TensorGroup

# 256 bytes: CUDA's allocation alignment, and a multiple of every element size.
ALIGNMENT = 256


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan_layout(tensors: list[TensorSpec], allocation_alignment: int = ALIGNMENT) -> Layout:
    """One allocation holding every tensor, grouped by (dtype, shape) in first-seen order.

    ``allocation_alignment`` rounds the allocation size (e.g. to the VMM
    granularity); reported bytes are exactly the allocation sizes.
    """
    by_kind: dict[tuple[torch.dtype, tuple[int, ...]], list[str]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.shape), []).append(t.name)
    groups = []
    offset = 0
    for (dtype, shape), names in by_kind.items():
        step = align_up(math.prod(shape) * dtype.itemsize)
        groups.append(TensorGroup(0, dtype_name(dtype), list(shape), offset, step, names))
        offset += step * len(names)
    return Layout(allocation_sizes=[align_up(offset, allocation_alignment)], groups=groups)


def plan_param_layout(params: list[ParamEntry], allocation_alignment: int = ALIGNMENT) -> Layout:
    """An engine's parameter table (a load plan's) as one allocation: grouped by dtype, shape
    and strides; tied names become aliases."""
    by_kind: dict[tuple[str, tuple[int, ...], tuple[int, ...] | None], list[str]] = {}
    aliases: dict[str, str] = {}
    for p in params:
        stride = None if list(p.stride) == contiguous_strides(p.shape) else tuple(p.stride)
        by_kind.setdefault((p.dtype, tuple(p.shape), stride), []).append(p.name)
        aliases.update((alias, p.name) for alias in p.aliases)
    groups = []
    offset = 0
    for (dtype, shape, stride), names in by_kind.items():
        step = align_up(math.prod(shape) * dtype_from_name(dtype).itemsize)
        strides = None if stride is None else list(stride)
        groups.append(TensorGroup(0, dtype, list(shape), offset, step, names, strides))
        offset += step * len(names)
    return Layout(
        allocation_sizes=[align_up(offset, allocation_alignment)], groups=groups, aliases=aliases
    )


def tensor_specs(layout: Layout) -> list[tuple[TensorSpec, int, int]]:
    """(spec, allocation index, byte offset) for every tensor in the layout."""
    out = []
    for g in layout.groups:
        dtype = dtype_from_name(g.dtype)
        for i, name in enumerate(g.names):
            out.append(
                (TensorSpec(name, dtype, tuple(g.shape)), g.allocation, g.offset + i * g.step)
            )
    return out


def check_layout(layout: Layout) -> None:
    """Reject a layout whose groups would read outside their allocation."""
    for g in layout.groups:
        if g.allocation >= len(layout.allocation_sizes):
            raise ValueError(
                f"group {g.names[0]!r} names allocation {g.allocation}, which is absent"
            )
        dtype = dtype_from_name(g.dtype)
        nbytes = math.prod(g.shape) * dtype.itemsize
        if nbytes and (g.step < nbytes or g.step % dtype.itemsize or g.offset % dtype.itemsize):
            raise ValueError(
                f"group {g.names[0]!r} has a step or offset that cannot hold its tensors"
            )
        if g.stride is not None and (
            len(g.stride) != len(g.shape) or not dense(g.shape, g.stride)
        ):
            raise ValueError(f"group {g.names[0]!r} has strides that are not one dense layout")
        end = g.offset + g.step * len(g.names)
        if nbytes and end > layout.allocation_sizes[g.allocation]:
            raise ValueError(f"group {g.names[0]!r} extends past the end of its allocation")
    names = [n for g in layout.groups for n in g.names]
    if len(set(names)) != len(names):
        raise ValueError("a tensor name appears twice in the layout")
    missing = set(layout.aliases.values()) - set(names)
    if missing:
        raise ValueError(f"aliases point at tensors not in the layout: {sorted(missing)[:5]}")


def build_views(buffers: list[torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """Views of every tensor over flat uint8 ``buffers`` (one per allocation), no copies."""
    views: dict[str, torch.Tensor] = {}
    for g in layout.groups:
        dtype = dtype_from_name(g.dtype)
        count = len(g.names)
        numel = math.prod(g.shape)
        buffer = buffers[g.allocation]
        if numel == 0:
            # Zero-size tensors own no bytes; each still gets its own tensor.
            views.update(
                (n, torch.empty(g.shape, dtype=dtype, device=buffer.device)) for n in g.names
            )
            continue
        region = buffer[g.offset : g.offset + count * g.step].view(dtype)
        rows = region.view(count, g.step // dtype.itemsize)[:, :numel]
        if g.stride is None:
            views.update(zip(g.names, rows.view(count, *g.shape).unbind(0), strict=True))
        else:
            # as_strided keeps each row's own storage offset.
            views.update((n, row.as_strided(g.shape, g.stride)) for n, row in zip(
                g.names, rows.unbind(0), strict=True))  # fmt: skip
    for alias, target in layout.aliases.items():
        views[alias] = views[target]
    return views
