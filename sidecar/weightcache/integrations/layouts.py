"""The adapters' zero-copy path: the engine's own layout, traced, built by the daemon, mapped.

Engine adapters call, in engine order:

1. :func:`engine_layout` — once per process: trace the engine's own weight
   loading and post-processing on a throwaway model built on ``meta``
   (:mod:`.trace`), then ask the rank's daemon for that layout by its plan's
   hash (:func:`weightcache.client.attach_layout`: the daemon builds it from
   the bytes it verified). The decision is cached, so the KV-budget hook and
   the load agree. None of this touches the engine's real model.
2. :func:`map_engine_layout` — on the engine's real model (built on meta):
   every planned parameter becomes a view of the daemon's memory (its class and
   attributes kept: the engine's code dispatches on them); parameters the
   tracer could not plan are filled by the engine's own loader from the
   checkpoint on disk, reported; parameters post-processing writes are copied
   into engine memory first (so nothing ever writes the daemon's read-only
   memory), reported.
3. the engine's own post-processing, then :func:`storage_report` — mapped and
   copied bytes read from the model's own parameter storages, and every
   parameter that post-processing moved off the daemon's memory, by name.

Where a layout cannot be had (no plan, post-processing that cannot be
traced on meta, an older daemon) the adapter falls back to the checkpoint
layout (:mod:`.loading`), and the reason is logged. Where neither layout can
give the engine's model (parameters no checkpoint tensor fills, wholly or in
part: :func:`unwritten_by_checkpoint`; a quantized model: :func:`from_disk`),
or a load left a parameter without its value (:func:`unfilled`), the engine's
own default loader loads from disk, with one WARNING saying why (or, with
``fallback`` off, the load fails saying why).
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from weightcache.client import (
    AttachedWeights,
    ConfigMismatch,
    DaemonError,
    DaemonNotReady,
    attach_layout,
    daemon_status,
)
from weightcache.integrations.settings import AdapterSettings
from weightcache.integrations.trace import TraceReport
from weightcache.protocol import CacheConfig, fingerprint

log = logging.getLogger(__name__)


@dataclass
class LayoutDecision:
    """The engine's own layout from the daemon, or why not (``attached`` None)."""

    socket: str
    attached: AttachedWeights | None
    report: TraceReport | None = None
    reason: str | None = None
    # The daemon's bytes (every layout it holds) just before and after the attach: a build
    # and a dropped checkpoint layout change them while the engine loads.
    daemon_bytes_before: int = 0
    daemon_bytes_after: int = 0
    # Why only the engine's own default loader, from disk, can load this model (neither
    # layout can); None where a layout may.
    disk: str | None = None

    @property
    def layout_bytes(self) -> int:
        """The bytes of the layout this engine maps (0 without one)."""
        return 0 if self.attached is None else self.attached.preloaded_weights_bytes

    @property
    def daemon_bytes_change(self) -> int:
        return self.daemon_bytes_after - self.daemon_bytes_before


_decisions: dict[tuple, LayoutDecision] = {}


class NotServable(RuntimeError):
    """weightcache cannot give the engine this model and the disk fallback is off."""


def forget_layouts() -> None:
    """Drop the cached decisions (and close their mappings): a later call decides anew."""
    for decided in _decisions.values():
        if decided.attached is not None:
            decided.attached.close()
    _decisions.clear()


def from_disk(settings: AdapterSettings, socket: str, reason: str) -> LayoutDecision:
    """The decision that the engine's own default loader loads this model from disk, and
    why (``reason``: what weightcache cannot serve); one WARNING per process. With
    ``fallback`` off it raises :class:`NotServable` instead."""
    key = (settings, socket, "disk", reason)
    if key not in _decisions:
        _decisions[key] = _disk(settings, socket, None, reason)
    return _decisions[key]


def _disk(settings, socket, report, reason) -> LayoutDecision:
    if not settings.fallback:
        raise NotServable(f"weightcache cannot serve this model: {reason} (fallback is off)")
    log.warning("weightcache: the engine's default loader loads the model from disk: %s",
                reason)  # fmt: skip
    return LayoutDecision(socket, None, report, reason, disk=reason)


def engine_layout(
    settings: AdapterSettings,
    socket: str,
    candidates: list[CacheConfig],
    trace: Callable[[], TraceReport],
) -> LayoutDecision:
    """This process's decision for ``socket`` (made once, then cached): ``trace`` the
    engine's loading on a throwaway model, and map the daemon's build of that plan."""
    key = (settings, socket, tuple(fingerprint(c) for c in candidates))
    if key not in _decisions:
        _decisions[key] = _decide(settings, socket, candidates, trace)
        release_traced_model_memory()
    return _decisions[key]


def release_traced_model_memory() -> None:
    """Give the device back what the trace's throwaway model took, before the engine samples
    its free memory (vLLM's snapshot comes right after this decision).

    Engines build models with the device as the default, so each parameter of the
    throwaway model was allocated on the device before ``meta_parameters`` moved it to
    meta: a Llama-3-8B leaves 2 GiB in torch's caching allocator. Left there, the engine's
    snapshot counts it as used and the load that follows releases it: vLLM's profiler
    then finds more free memory than at its snapshot (its assertion fails) and, asserts
    off, its KV cache grows by those bytes (issue 41). The model's modules hold each
    other (parents, the engine's layer registry in the config copy), so it goes with a
    collection, not when the trace returns."""
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _decide(settings, socket, candidates, trace) -> LayoutDecision:
    if not os.path.exists(socket):
        # No daemon (yet): the checkpoint path waits for one and falls back as configured,
        # saying why; waiting here too would double the wait.
        return LayoutDecision(socket, None, None, f"no daemon socket at {socket}")
    try:
        report = trace()
    except Exception as exc:  # the engine's code on meta: whatever it does, fall back
        return _without(socket, None, f"tracing the engine's loading failed: {exc!r}")
    missing = unwritten_by_checkpoint(report)
    if missing is not None:
        # The checkpoint lacks what the engine loads into them: the checkpoint layout cannot
        # fill them either, and the daemon's layout would hold zeros there. The engine's own
        # loader decides, as on a cold start (vLLM's refuses a parameter nothing fills,
        # naming it; one filled in part it loads as it is).
        return _disk(settings, socket, report, missing)
    if report.unread:
        # Skipped by the engine's own loading as on a cold start (rotary inv_freq, a tied
        # lm_head): never mapped. Named, so a checkpoint carrying more is visible.
        log.info("weightcache: %d checkpoint tensor(s) the engine's loading does not read: %s",
                 len(report.unread), _names(report.unread))  # fmt: skip
    if report.plan is None:
        return _without(socket, report, "the engine's loading gave nothing to plan")
    if report.post_error is not None:
        # Unknown: it might write the daemon's read-only memory. The checkpoint path copies.
        return _without(socket, report, f"post-processing cannot be checked on meta "
                                        f"({report.post_error})")  # fmt: skip
    transports = list(settings.transports) if settings.transports else None
    started = time.monotonic()
    last: Exception | None = None
    for config in candidates:
        try:
            before = _daemon_bytes(settings, socket, started)
            attached = _attach_waiting(settings, socket, config, report, transports, started)
        except ConfigMismatch as exc:
            last = exc
            if "dtype" in exc.fields:
                continue  # the cast config, next
            break
        except (DaemonError, OSError) as exc:
            last = exc
            break
        after = _daemon_bytes(settings, socket, started)
        return LayoutDecision(socket, attached, report, None, before, after)
    return _without(socket, report, f"the daemon at {socket} did not serve it: {last}")


def unwritten_by_checkpoint(report: TraceReport) -> str | None:
    """What of the engine's parameters no checkpoint tensor writes, for the WARNING (and
    :class:`NotServable`): parameters nothing in loading wrote (``unwritten``), and planned
    ones with bytes no copy or fill writes (``incomplete``), each with those bytes. None
    when every byte is written; padding a fill writes is written."""
    parts = []
    if report.unwritten:
        parts.append(f"{len(report.unwritten)} parameter(s) no checkpoint tensor fills: "
                     f"{_names(report.unwritten)}")  # fmt: skip
    if report.incomplete:
        partly = [
            f"{name}: {missing:,} of {report.param_bytes[name]:,} bytes written by no "
            "checkpoint tensor"
            for name, missing in sorted(report.incomplete.items())
        ]
        parts.append(f"{len(partly)} parameter(s) filled in part: {_names(partly, sep='; ')}")
    return "; ".join(parts) or None


def _without(socket: str, report: TraceReport | None, reason: str) -> LayoutDecision:
    log.warning("weightcache: no zero-copy layout of the engine's own: %s", reason)
    return LayoutDecision(socket, None, report, reason)


def _names(names: list[str], shown: int = 10, sep: str = ", ") -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return sep.join(names[:shown]) + more


def _daemon_bytes(settings: AdapterSettings, socket: str, started: float) -> int:
    """The daemon's bytes now (waiting for it like an attach would)."""
    while True:
        try:
            return daemon_status(socket).preloaded_weights_bytes
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() - started >= min(settings.absent_wait_s, settings.wait_ready_s):
                raise
        time.sleep(0.2)


def _attach_waiting(settings, socket, config, report, transports, started) -> AttachedWeights:
    """attach_layout, waiting ``wait_ready_s`` for a daemon that loads or builds."""
    while True:
        try:
            return attach_layout(socket, config, report.plan, transports)
        except DaemonNotReady as exc:
            if time.monotonic() - started >= settings.wait_ready_s:
                raise DaemonNotReady(
                    f"{exc} (not ready after {settings.wait_ready_s:g} s)"
                ) from None
        time.sleep(0.2)


# --------------------------------------------------------------------------- mapping


@dataclass
class LayoutLoad:
    """Where every parameter of the engine's model lives, read from its own storages."""

    mapped: list[str] = field(default_factory=list)
    mapped_bytes: int = 0
    copied: dict[str, str] = field(default_factory=dict)  # name -> why
    copied_bytes: int = 0


def map_engine_layout(
    model: nn.Module,
    decision: LayoutDecision,
    device: torch.device,
    *,
    engine_load_weights: Callable[[Iterator[tuple[str, torch.Tensor]]], object],
    checkpoint_files: Iterable[Path],
) -> dict[str, str]:
    """Point ``model``'s parameters (on meta) at the daemon's layout; returns the ones the
    engine holds itself, with why. Call the engine's post-processing next, then
    :func:`storage_report`."""
    assert decision.attached is not None and decision.report is not None
    report, tensors = decision.report, decision.attached.tensors
    planned = {n for p in report.plan.params for n in (p.name, *p.aliases)}  # type: ignore[union-attr]
    own: dict[str, str] = {}
    if report.copied:
        # Filled by the engine's own loader from disk; writes into the planned parameters,
        # still on meta, do nothing.
        _materialize(model, device, keep=planned)
        log.warning(
            "weightcache: %d parameter(s) the engine computes while loading are read from "
            "disk into engine memory: %s", len(report.copied), ", ".join(sorted(report.copied)[:5]),
        )  # fmt: skip
        with torch.no_grad():
            engine_load_weights(_checkpoint_tensors(checkpoint_files))
        own.update(report.copied)
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, param in list(module._parameters.items()):
            full = f"{prefix}.{name}" if prefix else name
            if param is None or full not in planned:
                continue
            view = tensors[full]
            _check_view(full, view, param)
            module._parameters[name] = _same_kind(param, view)
        for name, buf in list(module._buffers.items()):
            full = f"{prefix}.{name}" if prefix else name
            if buf is not None and full in planned:  # loaded from the checkpoint too
                _check_view(full, tensors[full], buf)
                module._buffers[name] = tensors[full]
    # Tied names map to one tensor; make them one Parameter again.
    _retie(model, tensors)
    for name, (how, why) in report.post_processed.items():
        if how == "writes":
            # Copy-on-write before the engine's post-processing writes it in place.
            param = model.get_parameter(name)
            param.data = param.data.clone()
        own[name] = why
    return own


def storage_report(model: nn.Module, attached: AttachedWeights, own: dict[str, str]) -> LayoutLoad:
    """Mapped vs copied, from where each parameter's bytes actually are."""
    spans = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in attached.allocations()]
    load = LayoutLoad()
    seen: set[int] = set()
    for name, param in model.named_parameters(remove_duplicate=True):
        if id(param) in seen:
            continue
        seen.add(id(param))
        nbytes = param.numel() * param.element_size()
        start = param.data_ptr()
        if nbytes and any(lo <= start and start + nbytes <= hi for lo, hi in spans):
            load.mapped.append(name)
            load.mapped_bytes += nbytes
        else:
            load.copied[name] = own.get(name, "not in the daemon's memory after post-processing")
            # Post-processing may leave an empty placeholder and keep its own form of the
            # weight elsewhere (vLLM's CPU GEMM packing): the engine holds at least the
            # layout's bytes of it.
            view = attached.tensors.get(name)
            held = 0 if view is None else view.numel() * view.element_size()
            load.copied_bytes += max(nbytes, held)
    return load


def unfilled(model: nn.Module, report: TraceReport) -> dict[str, str]:
    """What a load from the daemon left without its value, name -> why: a parameter or
    buffer still on meta, or a parameter the engine's loading fills (the traced model's,
    before post-processing) that neither the layout nor the engine's loader filled from
    the checkpoint. Parameters post-processing made are derived from those, so filled.
    By name: a layout with a parameter some bytes of which no checkpoint tensor writes is
    never mapped (:func:`unwritten_by_checkpoint`, decided from the trace's bytes)."""
    missing: dict[str, str] = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_meta:
            missing[name] = "left on meta"
    filled = {*report.planned, *report.copied}
    planned = report.plan.params if report.plan is not None else []
    filled |= {alias for p in planned for alias in p.aliases}
    for name, _ in model.named_parameters():
        if name in report.param_bytes and name not in filled:
            missing.setdefault(name, "no checkpoint tensor filled it")
    return missing


def describe_unfilled(missing: dict[str, str]) -> str:
    """The first few of :func:`unfilled`'s parameters and why, for the adapters' WARNING."""
    return _names([f"{name} ({why})" for name, why in sorted(missing.items())])


def describe_copied(copied: dict[str, str]) -> str:
    """The first few parameters in engine memory and why, for the adapters' log line."""
    shown = [f"{name} ({why})" for name, why in sorted(copied.items())[:5]]
    return ", ".join(shown) + (f" and {len(copied) - 5} more" if len(copied) > 5 else "")


def _check_view(name: str, view: torch.Tensor, param: torch.Tensor) -> None:
    if view.dtype != param.dtype or view.shape != param.shape:
        raise ValueError(
            f"{name}: the daemon's layout holds {view.dtype} {tuple(view.shape)}, the engine's "
            f"model {param.dtype} {tuple(param.shape)}"
        )


def _same_kind(param: torch.Tensor, view: torch.Tensor) -> nn.Parameter:
    """``view`` as a parameter of ``param``'s class with its attributes (engines hang their
    loaders and sharding flags on them)."""
    mapped = torch.Tensor._make_subclass(type(param), view, False)
    mapped.__dict__.update(param.__dict__)
    return mapped


def _retie(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    by_view: dict[int, nn.Parameter] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, param in list(module._parameters.items()):
            full = f"{prefix}.{name}" if prefix else name
            if param is None or full not in tensors:
                continue
            first = by_view.setdefault(id(tensors[full]), param)
            if first is not param:
                module._parameters[name] = first


def _materialize(model: nn.Module, device: torch.device, keep: set[str]) -> None:
    from weightcache.integrations.loading import _materialize_meta

    _materialize_meta(model, device, keep=keep)


def _checkpoint_tensors(files: Iterable[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)
