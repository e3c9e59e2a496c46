"""Synthetic GPU memory figures for the engines' own KV sizing code, which runs here on CPU.

There is no GPU in these tests. :class:`SyntheticGpu` is a model of one
device's memory (its total, this process's CUDA context, other processes'
allocations such as the daemon's, torch's allocations and their peak),
patched in where the engines read device memory: torch's own queries
(``torch.cuda.mem_get_info`` and friends, ``torch.accelerator.get_memory_info``
/ ``memory_stats`` / ``memory_reserved``). The engines' sizing functions above
those queries (vLLM's ``MemorySnapshot``, ``request_memory``,
``memory_profiling``, the worker's ``determine_available_memory``, its KV
cache planning; SGLang's pre-load sample, ``account_preloaded_weights`` and
pool sizing) are the engines' real code, fed those figures.

How the weights count on a GPU, the only modelling here (the rest is the
engines' own arithmetic):

- a cold start's weights are the engine's own allocations: each parameter
  one allocation of the CUDA caching allocator, rounded up to its 512-byte
  block (:data:`CUDA_BLOCK`); the allocator's segment slack (small blocks
  share 2 MiB segments) is not modelled: it would make the cold start hold
  more, not less;
- with weightcache the daemon (another process) holds the engine's layout in
  one allocation: each parameter at a 256-byte step, the whole rounded up to
  the transport's alignment (256 bytes for memfd and torch_ipc; vmm_fd: the
  VMM granularity, 2 MiB on current GPUs), ``weightcache.layout``'s rule; the
  engine allocates nothing for them.

So a warm start's KV budget is a cold start's plus :func:`rounding_difference`
(the 512-byte blocks a cold start rounds to, less the daemon's 256-byte steps
and allocation rounding): 0 to +256 bytes per parameter on memfd, and at most
the granularity less on vmm_fd.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from unittest import mock

import torch

from weightcache.layout import align_up

CUDA_BLOCK = 512  # the CUDA caching allocator's block: every allocation rounds up to it
LAYOUT_STEP = 256  # weightcache.layout.ALIGNMENT: a parameter's step in the daemon's layout
GiB = 1 << 30


def distinct_parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    """Each parameter once (tied ones are one tensor)."""
    return list(dict(model.named_parameters(remove_duplicate=True)).values())


def cold_weight_bytes(params: Iterable[torch.Tensor]) -> int:
    """What ``params`` take on a GPU when the engine allocates them itself, one caching-
    allocator block each."""
    return sum(align_up(p.numel() * p.element_size(), CUDA_BLOCK) for p in params)


def layout_bytes(params: Iterable[torch.Tensor], alignment: int = LAYOUT_STEP) -> int:
    """What the daemon allocates for a layout of ``params``: 256-byte steps in one
    allocation rounded up to ``alignment`` (weightcache.layout.plan_param_layout)."""
    steps = sum(align_up(p.numel() * p.element_size(), LAYOUT_STEP) for p in params)
    return align_up(steps, alignment)


def rounding_difference(params: list[torch.Tensor], alignment: int = LAYOUT_STEP) -> int:
    """A warm start's KV budget less a cold start's, for an engine whose weights are
    ``params``: the cold start's allocator rounding less the daemon's."""
    return cold_weight_bytes(params) - layout_bytes(params, alignment)


@dataclass
class SyntheticGpu:
    """One GPU's memory as the driver and torch's allocator would report it (bytes)."""

    total: int = 80 * GiB
    context: int = GiB  # this process's CUDA context, NCCL buffers, cuBLAS workspaces
    others: int = 0  # other processes: the daemon's allocations
    allocated: int = 0  # torch's allocations in this process (reserved = allocated)
    peak: int = 0

    @property
    def free(self) -> int:
        return self.total - self.context - self.others - self.allocated

    def allocate(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    def release(self, nbytes: int) -> None:
        self.allocated -= nbytes

    def mem_get_info(self, *args: object) -> tuple[int, int]:
        return self.free, self.total

    def memory_stats(self, *args: object) -> dict[str, int]:
        return {
            "allocated_bytes.all.current": self.allocated,
            "allocated_bytes.all.peak": self.peak,
        }

    def reset_peak(self, *args: object) -> None:
        self.peak = self.allocated

    @contextlib.contextmanager
    def installed(self) -> Iterator[SyntheticGpu]:
        """torch's device-memory queries answer from this model (CUDA device 0)."""
        properties = SimpleNamespace(is_integrated=False, total_memory=self.total, name="synthetic")
        patches = [
            (torch.cuda, "mem_get_info", self.mem_get_info),
            (torch.cuda, "device_count", lambda: 1),
            (torch.cuda, "current_device", lambda: 0),
            (torch.cuda, "get_device_properties", lambda *a: properties),
            (torch.cuda, "empty_cache", lambda: None),
            (torch.cuda, "synchronize", lambda *a: None),
            (torch.cuda, "memory_allocated", lambda *a: self.allocated),
            (torch.cuda, "memory_reserved", lambda *a: self.allocated),
            (torch.accelerator, "get_memory_info", self.mem_get_info),
            (torch.accelerator, "memory_stats", self.memory_stats),
            (torch.accelerator, "memory_reserved", lambda *a: self.allocated),
            (torch.accelerator, "memory_allocated", lambda *a: self.allocated),
            (torch.accelerator, "empty_cache", lambda: None),
            (torch.accelerator, "reset_peak_memory_stats", self.reset_peak),
            # The engines collect Python garbage before reading device memory, to free
            # tensors' blocks; these figures do not depend on it, and each full collection
            # of an engine's heap takes about a second here.
            (gc, "collect", lambda *a: 0),
        ]
        with contextlib.ExitStack() as stack:
            for owner, name, value in patches:
                stack.enter_context(mock.patch.object(owner, name, value, create=True))
            yield self


@dataclass(frozen=True)
class Activations:
    """What the engine's profiling forward allocates (the same with and without
    weightcache): a transient peak freed afterwards, and a persistent remainder."""

    transient: int = 3 * GiB
    persistent: int = 64 << 20

    def run_on(self, gpu: SyntheticGpu) -> None:
        gpu.allocate(self.transient + self.persistent)
        gpu.release(self.transient)
