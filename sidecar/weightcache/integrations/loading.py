"""The adapters' shared path: what the engine expects, one attach decision, a zero-copy load.

Engine adapters call, in engine order:

1. :func:`expected_configs` — the ``CacheConfig`` (or two equivalent ones)
   the engine is about to load on this rank, computed from the model
   directory exactly as the daemon computes it;
2. :func:`attachment` — attach to the rank's daemon once per process and
   remember the outcome, so the KV-budget hook (vLLM's
   ``get_external_weight_memory``) and the later load agree: the budget
   counts the daemon's bytes exactly when the load maps them, 0 when it falls
   back to disk;
3. :func:`load_from_daemon` — build-on-meta module in, every parameter the
   daemon holds under the same name, shape and dtype mapped zero-copy; what
   the engine lays out differently (fused ``qkv_proj`` / ``gate_up_proj``,
   renamed tensors) is materialised and filled by the engine's own weight
   loader from the daemon's memory (a device-to-device copy, no disk read).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch
from torch import nn

from weightcache.checkpoint import cache_config, read_checkpoint
from weightcache.client import (
    AttachedWeights,
    ConfigMismatch,
    DaemonError,
    DaemonNotReady,
    attach,
    load_into,
)
from weightcache.integrations.settings import AdapterSettings
from weightcache.protocol import CacheConfig, ShardSpec, fingerprint

log = logging.getLogger(__name__)

EngineLoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], object]


class DaemonUnavailable(RuntimeError):
    """No usable daemon answered in time and the disk fallback is not allowed."""


class IncompleteLoad(RuntimeError):
    """A load from the daemon left parameters or buffers without their values."""

    def __init__(self, unfilled: dict[str, str]) -> None:
        self.unfilled = unfilled  # name -> why
        shown = [f"{name} ({why})" for name, why in sorted(unfilled.items())[:10]]
        more = f" and {len(unfilled) - 10} more" if len(unfilled) > 10 else ""
        super().__init__(
            f"{len(unfilled)} tensor(s) without their values after loading from the daemon: "
            + ", ".join(shown) + more
        )


@dataclass(frozen=True)
class EngineTarget:
    """What the engine is about to load on this rank."""

    model_dir: Path
    dtype: torch.dtype
    device: torch.device
    shard: ShardSpec = field(default_factory=ShardSpec)
    revision: str | None = None


def local_model_dir(model: str | os.PathLike[str]) -> Path:
    """The engine's model argument as a directory; the daemon identifies weights by path."""
    path = Path(model)
    if not path.is_dir():
        raise ValueError(
            f"weightcache needs the model as a local directory (the same path the daemon "
            f"loads, e.g. the WeightCache's volume); got {str(model)!r}, which is not a directory"
        )
    return path


def expected_configs(target: EngineTarget, *, own_layout: bool = False) -> list[CacheConfig]:
    """The configs a daemon serving exactly what the engine loads may hold, preferred first.

    A daemon started without ``--dtype`` records ``dtype: null`` and holds
    every tensor in its own dtype (a mixed checkpoint's too). For the
    checkpoint's layout, whose tensors the engine maps as they are, that daemon
    is as good as one started with the engine's ``--dtype`` only when every
    floating tensor already has the engine's dtype; otherwise only the cast
    config is. For the engine's ``own_layout`` both are: its plan names every
    parameter's dtype and each cast, which the daemon applies to the bytes it
    holds, so a daemon of the checkpoint's own dtypes builds exactly what the
    engine loads (the cast config first when the dtypes differ: a daemon
    started with the engine's ``--dtype`` holds those bytes already). A daemon
    cast to another dtype is never accepted: casts stay explicit.
    """
    checkpoint = read_checkpoint(target.model_dir)

    def config(dtype: torch.dtype | None) -> CacheConfig:
        return cache_config(checkpoint, target.device, dtype, target.shard, target.revision)

    cast = config(target.dtype)
    floating = [t.dtype for t in checkpoint.tensors if t.dtype.is_floating_point]
    if all(d == target.dtype for d in floating):
        return [config(None), cast]
    return [cast, config(None)] if own_layout else [cast]


@dataclass
class Attachment:
    """The one decision per process and socket: attached weights, or a disk fallback and why."""

    socket: str
    attached: AttachedWeights | None
    fallback_reason: str | None = None

    @property
    def preloaded_weights_bytes(self) -> int:
        """Bytes the daemon holds for this rank; 0 when the engine loads from disk."""
        return 0 if self.attached is None else self.attached.preloaded_weights_bytes


_attachments: dict[tuple[AdapterSettings, str, tuple[str, ...]], Attachment] = {}
_attachments_lock = threading.Lock()


def attachment(settings: AdapterSettings, socket: str, candidates: list[CacheConfig]) -> Attachment:
    """Attach to ``socket`` for the first acceptable config, once per process (then cached)."""
    key = (settings, socket, tuple(fingerprint(c) for c in candidates))
    with _attachments_lock:
        if key not in _attachments:
            _attachments[key] = _decide(settings, socket, candidates)
        return _attachments[key]


def forget_attachments() -> None:
    """Drop the cached decisions (and close their mappings): a later call decides anew."""
    with _attachments_lock:
        for decided in _attachments.values():
            if decided.attached is not None:
                decided.attached.close()
        _attachments.clear()


def _decide(settings: AdapterSettings, socket: str, candidates: list[CacheConfig]) -> Attachment:
    try:
        return Attachment(socket, _attach_first_match(settings, socket, candidates))
    except ConfigMismatch as exc:
        if not settings.fallback:
            raise
        return _fallback(socket, str(exc))
    except (DaemonError, OSError) as exc:
        reason = f"no usable weightcache daemon at {socket}: {exc}"
        if not settings.fallback:
            raise DaemonUnavailable(reason + " (fallback is off)") from exc
        return _fallback(socket, reason)


def _fallback(socket: str, reason: str) -> Attachment:
    log.warning("weightcache: loading from disk instead of the daemon: %s", reason)
    return Attachment(socket, None, reason)


def _attach_first_match(
    settings: AdapterSettings, socket: str, candidates: list[CacheConfig]
) -> AttachedWeights:
    transports = list(settings.transports) if settings.transports else None
    for i, config in enumerate(candidates):
        try:
            return _attach_waiting(settings, socket, config, transports)
        except ConfigMismatch as exc:
            if "dtype" in exc.fields and i + 1 < len(candidates):
                continue  # the daemon is up: it answered; try the cast config
            raise ConfigMismatch(exc.fields, _mismatch_message(exc, config)) from None
    raise AssertionError("expected_configs() returned no config")


def _attach_waiting(
    settings: AdapterSettings, socket: str, config: CacheConfig, transports: list[str] | None
) -> AttachedWeights:
    """Attach, waiting ``absent_wait_s`` for a socket nobody answers on and ``wait_ready_s``
    for a daemon that answers but is still loading."""
    started = time.monotonic()
    absent_wait = min(settings.absent_wait_s, settings.wait_ready_s)
    while True:
        try:
            return attach(socket, config, transports)
        except DaemonNotReady as exc:
            waited, limit = time.monotonic() - started, settings.wait_ready_s
            if waited >= limit:
                raise DaemonNotReady(f"{exc} (still not ready after {limit:g} s)") from None
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            waited, limit = time.monotonic() - started, absent_wait
            if waited >= limit:
                raise type(exc)(exc.errno, f"{exc.strerror} (waited {limit:g} s)",
                                exc.filename) from None  # fmt: skip
        time.sleep(0.2)


def _mismatch_message(exc: ConfigMismatch, expected: CacheConfig) -> str:
    wanted = msgspec.to_builtins(expected)
    details = ", ".join(f"{f} (engine expects {_value_at(wanted, f)!r})" for f in exc.fields)
    return f"{exc}; {details or 'no field named'}"


def _value_at(tree: object, dotted: str) -> object:
    """The value at ``model.files[0].size`` in builtins; '?' where the path does not lead."""
    node = tree
    for part in dotted.split(" ")[0].replace("]", "").replace("[", ".").split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return "?"
    return node


# --------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class LoadReport:
    """Where each daemon tensor went: mapped zero-copy, copied by the engine, or unused."""

    mapped: list[str]
    mapped_bytes: int
    copied: list[str]
    copied_bytes: int
    unused: list[str]


def load_from_daemon(
    module: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    device: torch.device,
    *,
    name_map: Callable[[str], str | None] | None = None,
    engine_load_weights: EngineLoadWeights | None = None,
) -> LoadReport:
    """Fill ``module`` (parameters on meta) from the daemon's tensors.

    ``name_map`` maps a checkpoint name to the module's name for it (None:
    the engine ignores that tensor). A tensor whose mapped name is a
    parameter or persistent buffer of the same shape and dtype is mapped
    zero-copy. The rest go to ``engine_load_weights`` (the engine's own
    ``model.load_weights``) under their checkpoint names, after the
    parameters it will fill are materialised on ``device``. Without it, a
    tensor whose name the module lacks is unused (as in
    :func:`~weightcache.client.load_into`) and one of another shape or dtype
    is an error. Raises :class:`IncompleteLoad` if anything is left on meta, or
    if the engine's loader says which parameters it loaded (vLLM's returns
    their names) and a parameter it was to fill is not among them.
    """
    targets = dict(_named_targets(module))
    direct: dict[str, torch.Tensor] = {}
    rest: dict[str, torch.Tensor] = {}
    unused: list[str] = []
    for name, tensor in tensors.items():
        target_name = name if name_map is None else name_map(name)
        if target_name is None:
            unused.append(name)
            continue
        target = targets.get(target_name)
        if target is not None and target.shape == tensor.shape and target.dtype == tensor.dtype:
            direct[target_name] = tensor
        elif engine_load_weights is not None:
            rest[name] = tensor  # the engine's loader knows its own layout and what to skip
        elif target is None:
            unused.append(name)
        else:
            raise ValueError(
                f"{target_name}: the daemon holds {tensor.dtype} {tuple(tensor.shape)}, the "
                f"module expects {target.dtype} {tuple(target.shape)}"
            )
    to_fill: list[str] = []
    if rest:
        to_fill = [n for n, p in module.named_parameters() if p.is_meta and n not in direct]
        _materialize_meta(module, device, keep=set(direct))
    load_into(module, direct)
    loaded = engine_load_weights(iter(rest.items())) if rest else None
    targets = _named_targets(module, persistent_only=False)
    unfilled = {name: "left on meta" for name, t in targets if t.is_meta}
    if isinstance(loaded, set):
        unfilled.update({n: "the engine's loader filled nothing into it"
                         for n in to_fill if n not in loaded})  # fmt: skip
    if unfilled:
        raise IncompleteLoad(unfilled)
    return LoadReport(
        mapped=sorted(direct),
        mapped_bytes=_unique_bytes(direct.values()),
        copied=sorted(rest),
        copied_bytes=_unique_bytes(rest.values()),
        unused=sorted(unused),
    )


def still_mapped(module: nn.Module, report: LoadReport, tensors: Mapping[str, torch.Tensor],
                 name_map: Callable[[str], str | None] | None = None) -> list[str]:  # fmt: skip
    """Names of ``report.mapped`` that no longer point at the daemon's memory.

    Engine post-processing (``process_weights_after_loading``) may replace a
    parameter by one of its own; that costs engine memory the KV budget did
    not plan for the daemon's copy, so the adapters report it.
    """
    by_target = {(name if name_map is None else name_map(name)): t for name, t in tensors.items()}
    current = dict(_named_targets(module, persistent_only=False))
    return [
        name
        for name in report.mapped
        if name not in current or current[name].data_ptr() != by_target[name].data_ptr()
    ]


def _named_targets(
    module: nn.Module, persistent_only: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    for prefix, mod in module.named_modules(remove_duplicate=False):
        for name, param in mod._parameters.items():
            if param is not None:
                yield (f"{prefix}.{name}" if prefix else name), param
        for name, buf in mod._buffers.items():
            if buf is not None and (
                not persistent_only or name not in mod._non_persistent_buffers_set
            ):
                yield (f"{prefix}.{name}" if prefix else name), buf


def _materialize_meta(module: nn.Module, device: torch.device, keep: set[str]) -> None:
    """Allocate the meta parameters and buffers that the engine's loader will fill.

    The engine's class and attributes (vLLM's ``weight_loader``, ``output_dim``
    ...) are kept: its loader dispatches on them. Tied parameters stay one object.
    """
    modules = list(module.named_modules(remove_duplicate=False))
    # By identity: a tied parameter mapped under one of its names is mapped everywhere.
    kept = {
        id(param)
        for prefix, mod in modules
        for name, param in mod._parameters.items()
        if (f"{prefix}.{name}" if prefix else name) in keep
    }
    done: dict[int, torch.Tensor] = {}
    for prefix, mod in modules:
        for name, param in list(mod._parameters.items()):
            if param is None or not param.is_meta or id(param) in kept:
                continue
            if id(param) not in done:
                done[id(param)] = _like(param, device)
            mod._parameters[name] = done[id(param)]
        for name, buf in list(mod._buffers.items()):
            full = f"{prefix}.{name}" if prefix else name
            if buf is not None and buf.is_meta and full not in keep:
                mod._buffers[name] = torch.empty_like(buf, device=device)


def _like(param: torch.Tensor, device: torch.device) -> torch.Tensor:
    fresh = torch.Tensor._make_subclass(
        type(param), torch.empty_like(param, device=device), param.requires_grad
    )
    fresh.__dict__.update(param.__dict__)
    return fresh


def _unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[tuple[int, int], int] = {}
    for t in tensors:
        seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
    return sum(seen.values())
