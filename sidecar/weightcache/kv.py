"""KV-cache baseline correction for engines whose weights are preloaded by a daemon.

Engines (SGLang, vLLM-style) size the KV pool as::

    budget = post_load_free - pre_load_free * (1 - mem_fraction_static)

where ``pre_load_free`` is free device memory sampled before the model loads and
``pre_load_free * (1 - f)`` is the headroom kept back for activations and CUDA
graphs. With a weightcache daemon the weights are already resident when the
engine samples ``pre_load_free``, so the sample is ``W`` bytes too low, the
headroom shrinks by ``W * (1 - f)``, and the engine over-allocates KV and dies
in CUDA-graph capture. Adding the daemon's ``preloaded_weights_bytes`` back to
the rank-local sample restores the budget of a cold start.

Order matters in tensor-parallel engines: ranks hold different amounts, so each
rank corrects its own sample *before* the MIN across ranks. Correcting after
the MIN adds one rank's bytes to another rank's sample.

The arithmetic (:func:`total_preloaded_bytes`, :func:`kv_budget_bytes`,
:func:`kv_tokens`) is pure; sampling and the all-reduce are the only I/O and
are kept in :meth:`KVBaseline.sample`, :func:`cuda_free_bytes` and
:func:`min_across_ranks`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction

import torch
import torch.distributed as dist

__all__ = [
    "KVBaseline",
    "cuda_free_bytes",
    "headroom_bytes",
    "kv_budget_bytes",
    "kv_tokens",
    "min_across_ranks",
    "total_preloaded_bytes",
]

FreeBytesSampler = Callable[[torch.device], int]


def _check_bytes(name: str, value: object) -> int:
    # bool is an int subclass; True bytes is always a caller bug, never 1 byte.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{name} must be an int number of bytes, got {type(value).__name__} {value!r}"
        )
    if value < 0:
        raise ValueError(f"{name} must be >= 0 bytes, got {value}")
    return value


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _fraction_of(mem_fraction_static: object) -> Fraction:
    """Exact rational value of f as the user wrote it.

    Going through ``repr`` makes 0.85 mean 17/20 rather than the nearest binary
    double, so a correction of W bytes moves the budget by exactly W * (1 - f)
    whenever that product is a whole number of bytes.
    """
    if isinstance(mem_fraction_static, bool) or not isinstance(mem_fraction_static, (int, float)):
        raise TypeError(
            "mem_fraction_static must be a float in (0, 1], got "
            f"{type(mem_fraction_static).__name__} {mem_fraction_static!r}"
        )
    if not (0 < mem_fraction_static <= 1):  # also rejects NaN
        raise ValueError(f"mem_fraction_static must be in (0, 1], got {mem_fraction_static!r}")
    if isinstance(mem_fraction_static, int):
        return Fraction(mem_fraction_static)
    return Fraction(repr(mem_fraction_static))


def total_preloaded_bytes(*runner_bytes: int) -> int:
    """Sum the preloaded bytes of every runner on this rank (target, draft, extra).

    Speculative decoding and multi-model engines attach several caches on one
    device; the baseline must be corrected once with their sum, because a second
    correction is refused (it would otherwise be indistinguishable from double
    counting).
    """
    return sum(_check_bytes(f"runner_bytes[{i}]", b) for i, b in enumerate(runner_bytes))


def headroom_bytes(pre_load_free: int, mem_fraction_static: float) -> int:
    """Bytes the engine keeps free for activations and CUDA graphs: ceil(pre * (1 - f)).

    Rounded up so the reserve is never smaller than the engine's formula asks.
    """
    pre = _check_bytes("pre_load_free", pre_load_free)
    return _headroom(pre, _fraction_of(mem_fraction_static))


def _headroom(pre: int, f: Fraction) -> int:
    return math.ceil(pre * (1 - f))


def kv_budget_bytes(post_load_free: int, corrected_pre: int, mem_fraction_static: float) -> int:
    """KV pool size: ``post_load_free - corrected_pre * (1 - f)`` bytes.

    ``corrected_pre`` is the pre-load free memory after the preloaded weights were
    added back and the MIN across ranks was taken. A negative result means the
    weights left less than the reserved headroom; that is an engine configuration
    error, reported instead of returning a pool size no allocator can honour.
    """
    post = _check_bytes("post_load_free", post_load_free)
    pre = _check_bytes("corrected_pre", corrected_pre)
    reserve = _headroom(pre, _fraction_of(mem_fraction_static))
    budget = post - reserve
    if budget < 0:
        raise ValueError(
            f"no memory left for the KV cache: post_load_free={post} is below the headroom "
            f"{reserve} = corrected_pre={corrected_pre} * (1 - mem_fraction_static="
            f"{mem_fraction_static!r}); raise mem_fraction_static"
        )
    return budget


def kv_tokens(budget_bytes: int, bytes_per_token: int, page_size: int = 1) -> int:
    """Tokens the KV pool holds: floor(budget / bytes_per_token), rounded down to whole pages.

    Paged engines can only hand out whole pages, so the tail of a partial page is
    unusable and is not counted.
    """
    budget = _check_bytes("budget_bytes", budget_bytes)
    per_token = _check_positive_int("bytes_per_token", bytes_per_token)
    page = _check_positive_int("page_size", page_size)
    return budget // per_token // page * page


def cuda_free_bytes(device: torch.device) -> int:
    """Free device memory as the driver reports it, with PyTorch's cache returned first.

    Blocks cached by this process's allocator are free for the engine's own use,
    so they are released before reading; the reading then includes memory other
    processes (the daemon) hold, which is exactly what the correction undoes.
    """
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def _default_sampler(device: torch.device) -> FreeBytesSampler:
    if device.type == "cuda":
        return cuda_free_bytes
    raise ValueError(
        f"no free-memory sampler for device {device}; pass sampler=callable(device) -> int"
    )


def _reduction_device(backend: str) -> torch.device:
    """Where the all-reduce tensor must live for a process-group backend.

    NCCL only reduces device tensors; gloo and MPI reduce host tensors (also in a
    mixed "cpu:gloo,cuda:nccl" group). Anything else must name the device, rather
    than guess and hang or fail inside the collective.
    """
    name = backend.lower()
    if "gloo" in name or "mpi" in name:
        return torch.device("cpu")
    if name == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    raise ValueError(f"cannot tell where backend {backend!r} reduces tensors; pass device=")


def min_across_ranks(
    value: int,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> int:
    """MIN of ``value`` over the ranks of ``group``; ``value`` itself without a process group.

    Every rank must size its pool from the same baseline, and the scarcest GPU
    decides it. Single-process engines call this too, so both paths share code.
    """
    value = _check_bytes("value", value)
    if not (dist.is_available() and dist.is_initialized()):
        return value
    where = (
        torch.device(device)
        if device is not None
        else _reduction_device(str(dist.get_backend(group)))
    )
    tensor = torch.tensor([value], dtype=torch.int64, device=where)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return int(tensor.item())


class KVBaseline:
    """Rank-local free device memory sampled before model load, plus its one correction.

    Life cycle, in engine order:

    1. ``KVBaseline.sample(device)`` before any weights are attached or loaded;
    2. ``account_preloaded_weights(attached.preloaded_weights_bytes)`` (a no-op for 0);
    3. ``min_across_ranks(group)``, which freezes the baseline; the initial KV
       sizing and any later resizing read the same value from ``sizing_bytes``.
    """

    def __init__(self, pre_load_free_bytes: int) -> None:
        self._raw = _check_bytes("pre_load_free_bytes", pre_load_free_bytes)
        self._preloaded = 0
        self._reduced: int | None = None

    @classmethod
    def sample(
        cls, device: torch.device | str, sampler: FreeBytesSampler | None = None
    ) -> KVBaseline:
        """Sample free memory on ``device`` now; ``sampler`` replaces the CUDA reading."""
        device = torch.device(device)
        read = sampler if sampler is not None else _default_sampler(device)
        return cls(_check_bytes("sampled free bytes", read(device)))

    @property
    def raw_bytes(self) -> int:
        """The sample as taken, with the daemon's weights already resident."""
        return self._raw

    @property
    def preloaded_bytes(self) -> int:
        """Bytes added back by :meth:`account_preloaded_weights` (0 until then)."""
        return self._preloaded

    @property
    def corrected_bytes(self) -> int:
        """Rank-local baseline as a cold start would have sampled it."""
        return self._raw + self._preloaded

    @property
    def sizing_bytes(self) -> int:
        """The baseline every KV sizing uses: corrected, then MIN across ranks."""
        if self._reduced is None:
            raise RuntimeError(
                "KVBaseline.sizing_bytes read before min_across_ranks(); call it (it is a "
                "no-op without a process group) so every rank sizes from the same baseline"
            )
        return self._reduced

    def account_preloaded_weights(self, preloaded_weights_bytes: int) -> int:
        """Add the daemon's resident weight bytes back to the rank-local sample.

        Returns the corrected baseline. 0 changes nothing, so engines call this
        unconditionally. A second non-zero correction raises: several runners must
        be summed with :func:`total_preloaded_bytes` first, and applying one twice
        would silently shrink the headroom the other way. Any call after the MIN
        raises, because correcting then would mix ranks' bytes.
        """
        nbytes = _check_bytes("preloaded_weights_bytes", preloaded_weights_bytes)
        if self._reduced is not None:
            raise RuntimeError(
                "account_preloaded_weights() called after min_across_ranks(); correct each "
                "rank's baseline before the MIN, since ranks hold different amounts"
            )
        if nbytes == 0:
            return self.corrected_bytes
        if self._preloaded:
            raise RuntimeError(
                f"preloaded weights already accounted ({self._preloaded} bytes); refusing to "
                f"add {nbytes} more. Sum all runners with total_preloaded_bytes() and "
                "correct once"
            )
        self._preloaded = nbytes
        return self.corrected_bytes

    def min_across_ranks(
        self,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
    ) -> int:
        """Take the MIN of the corrected baselines over ``group`` once, and keep it.

        Later calls return the kept value without another collective, so a rank
        that resizes its pool on its own cannot block waiting for peers.
        """
        if self._reduced is None:
            self._reduced = min_across_ranks(self.corrected_bytes, group=group, device=device)
        return self._reduced

    def __repr__(self) -> str:
        return (
            f"KVBaseline(raw_bytes={self._raw}, preloaded_bytes={self._preloaded}, "
            f"sizing_bytes={self._reduced})"
        )
