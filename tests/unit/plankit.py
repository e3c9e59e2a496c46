"""Helpers for load-plan tests: the plain-torch reference execution of a plan.

:func:`reference_params` executes a plan the obvious way, one ``copy_`` and
one ``fill_`` at a time over fresh zeroed tensors: what the daemon's build
must equal, byte for byte.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from weightcache.checkpoint import dtype_from_name
from weightcache.plan import LoadPlan, Region


def strided(flat: torch.Tensor, r: Region) -> torch.Tensor:
    """``r`` over the 1-D tensor ``flat`` (its own storage offset respected)."""
    return flat.as_strided(r.shape, r.stride, flat.storage_offset() + r.offset)


def reference_params(
    plan: LoadPlan, checkpoint: Mapping[str, torch.Tensor], device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Every parameter (and alias) of ``plan``, built from ``checkpoint`` with plain torch."""
    storages = {
        p.name: torch.zeros(math.prod(p.shape), dtype=dtype_from_name(p.dtype), device=device)
        for p in plan.params
    }
    for c in plan.copies:
        src = strided(checkpoint[c.source].reshape(-1), c.src)
        for dtype in c.casts:
            src = src.to(dtype_from_name(dtype))
        strided(storages[c.param], c.dst).copy_(src)
    for f in plan.fills:
        strided(storages[f.param], f.dst).fill_(f.value)
    out = {}
    for p in plan.params:
        view = storages[p.name].as_strided(p.shape, p.stride)
        out.update((name, view) for name in (p.name, *p.aliases))
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
