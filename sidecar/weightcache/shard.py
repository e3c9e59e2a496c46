"""Tensor-parallel shard plans: which slice of each checkpoint tensor a rank holds.

A plan maps a tensor name to the dimension it is split along (or ``None``:
every rank holds the whole tensor). For a rank, :func:`plan_shards` gives each
tensor's rank-local shape and the byte ranges of the source tensor to read, in
destination order, so the loader reads exactly the rank's bytes straight into
place:

- split along dim 0 (column / vocab parallel): one contiguous range, the
  rank's block of rows; the loader reads it like a whole tensor, straight
  into place;
- split along dim ``d > 0`` (row parallel, dim 1 of ``[out, in]``): one range
  per index of the leading dims (one per row of a matrix), evenly spaced, so
  a shard is described by (start, length, count, stride), not a list: a
  Llama-70B rank has over a million such rows.

Pure: no I/O, no torch. Engines compute the same :class:`ShardSpec`, so a
daemon serving another rank's (or plan's) shard is refused by the fingerprint.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from weightcache.protocol import ShardSpec

# Llama (and Mistral, Qwen2: same names). Column parallel: q/k/v, gate/up and
# their biases; vocab parallel: embed_tokens, lm_head; row parallel: o_proj,
# down_proj. A row-parallel layer's bias is added once after the all-reduce,
# so it stays whole, like norms and everything else.
_LLAMA_RULES: tuple[tuple[re.Pattern[str], int], ...] = (
    (re.compile(r"(^|\.)(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$"), 0),
    (re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$"), 0),
    (re.compile(r"(^|\.)(o_proj|down_proj)\.weight$"), 1),
)

PLANS: dict[str, tuple[tuple[re.Pattern[str], int], ...]] = {"llama": _LLAMA_RULES}
PLAN_NAMES: tuple[str, ...] = tuple(sorted(PLANS))


class ShardError(ValueError):
    """A shard spec or a tensor cannot be split as asked; the message names which."""


class _Tensor(Protocol):
    """What a plan needs of a checkpoint tensor (``checkpoint.TensorRecord`` fits)."""

    name: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class TensorShard:
    """One tensor as a rank holds it: ``count`` source byte ranges of ``length`` bytes, the
    first at ``start``, each ``stride`` after the previous, filling the destination in order.
    """

    name: str
    dim: int | None  # the split dimension; None: the whole tensor
    shape: tuple[int, ...]  # rank-local shape
    start: int
    length: int
    count: int = 1
    stride: int = 0

    @property
    def nbytes(self) -> int:
        return self.length * self.count

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """[start, end) of every range (a list as long as ``count``: for tests and tools)."""
        first = (self.start + i * self.stride for i in range(self.count))
        return [(a, a + self.length) for a in first]


def check_spec(spec: ShardSpec) -> None:
    """Reject a spec no plan can serve: rank out of range, unknown plan, TP without a plan."""
    if not 0 <= spec.tp_rank < spec.tp_size:
        raise ShardError(
            f"tp_rank must be in [0, tp_size); got rank {spec.tp_rank} of {spec.tp_size}"
        )
    if spec.plan is None:
        if spec.tp_size > 1:
            raise ShardError(
                f"tp_size {spec.tp_size} needs a shard plan (one of {list(PLAN_NAMES)})"
            )
        return
    if spec.plan not in PLANS:
        raise ShardError(f"unknown shard plan {spec.plan!r}; expected one of {list(PLAN_NAMES)}")


def split_dim(plan: str | None, name: str) -> int | None:
    """The dimension ``plan`` splits tensor ``name`` along; None: replicated."""
    if plan is None:
        return None
    for pattern, dim in PLANS[plan]:
        if pattern.search(name):
            return dim
    return None


def shard_tensor(
    name: str, shape: tuple[int, ...], nbytes: int, dim: int | None, tp_size: int, tp_rank: int
) -> TensorShard:
    """Rank ``tp_rank``'s slice of a row-major tensor split in ``tp_size`` along ``dim``."""
    if dim is None or tp_size == 1:
        return TensorShard(name, None, shape, 0, nbytes)
    if dim >= len(shape):
        raise ShardError(
            f"tensor {name!r} of shape {list(shape)} has no dim {dim} to split for tensor "
            "parallelism"
        )
    if shape[dim] % tp_size:
        raise ShardError(
            f"tensor {name!r}: dim {dim} of shape {list(shape)} ({shape[dim]}) is not divisible "
            f"by tp_size {tp_size}"
        )
    local = shape[dim] // tp_size
    numel = math.prod(shape)
    itemsize = nbytes // numel if numel else 0
    # Bytes of one index along `dim`; of one index of the dims before it; of the rank's block.
    inner = math.prod(shape[dim + 1 :]) * itemsize
    outer = shape[dim] * inner
    block = local * inner
    leading = math.prod(shape[:dim])
    local_shape = (*shape[:dim], local, *shape[dim + 1 :])
    if block == 0 or leading == 0:
        return TensorShard(name, dim, local_shape, 0, 0)
    # Consecutive indices of the leading dims are `outer` apart: one range per row of them.
    return TensorShard(name, dim, local_shape, tp_rank * block, block, leading, outer)


def plan_shards(tensors: Iterable[_Tensor], spec: ShardSpec) -> dict[str, TensorShard]:
    """Every tensor's shard for ``spec``'s rank, in the order given."""
    check_spec(spec)
    return {
        t.name: shard_tensor(
            t.name, t.shape, t.nbytes, split_dim(spec.plan, t.name), spec.tp_size, spec.tp_rank
        )
        for t in tensors
    }
