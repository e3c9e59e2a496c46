"""Trace an engine's own weight loading into a load plan (the engine side of zero copies).

The engine's model is built on ``meta``; its own loading code (``load_weights``,
each parameter's ``weight_loader``) then runs against stand-ins of the
checkpoint tensors, themselves ``meta`` tensors of the checkpoint's dtypes and
shapes. Nothing is read or allocated: a torch dispatch mode watches every
operation and keeps, for each storage it has seen filled from the checkpoint,
which region of which checkpoint tensor each part of it holds (through
views, dtype casts, clones, concatenations). A copy into a view of a
parameter becomes a :class:`~weightcache.plan.Copy`, a constant fill a
:class:`~weightcache.plan.Fill`.

Whatever the tracer cannot follow is reported per parameter, never
silently: a parameter written by arithmetic, from a tensor not read from the
checkpoint, twice at the same elements, or replaced during loading, stays
out of the plan and is named in :attr:`TraceReport.copied` with the reason.
Post-processing (vLLM's ``process_weights_after_loading`` and the like) runs
under the same watch: a planned parameter it writes or replaces stays planned
(its loading is exact) and is named in :attr:`TraceReport.post_processed`,
since the engine then holds it in its own memory.

A trace touches nothing outside the throwaway model: every module of it gets
back its own parameters, buffers, submodules and attributes afterwards (an
engine may hand the same module to the real model: vLLM caches its rotary
embeddings process-wide), and :func:`isolated` restores what building the
throwaway model may change in the process (torch's default dtype, grad mode,
the random generators, the engine's module caches).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from weightcache.checkpoint import dtype_from_name, dtype_name
from weightcache.plan import (
    Copy,
    Fill,
    LoadPlan,
    ParamEntry,
    PlanError,
    Region,
    SourceTensor,
    check_plan,
    extent,
    locate,
    narrow,
    numel,
    select,
    through,
)

aten = torch.ops.aten
# Work spent splitting one read across concatenated pieces (rows x pieces).
SPLIT_BUDGET = 1 << 20

EngineLoad = Callable[[Iterator[tuple[str, torch.Tensor]]], object]


def stand_ins(sources: Mapping[str, SourceTensor]) -> dict[str, torch.Tensor]:
    """One ``meta`` tensor per checkpoint tensor, each on a storage of its own."""
    return {
        name: torch.empty(numel(s.shape), dtype=dtype_from_name(s.dtype), device="meta").view(
            s.shape
        )
        for name, s in sources.items()
    }


@dataclass
class TraceReport:
    """What the engine's loading does to each of its parameters."""

    plan: LoadPlan | None  # every parameter whose bytes a plan gives exactly; None: none
    param_bytes: dict[str, int]  # every parameter (first name) and its bytes
    copied: dict[str, str] = field(default_factory=dict)  # name -> why it is not planned
    # Planned parameters that post-processing writes ("writes") or replaces or removes
    # ("replaces"): the engine holds them in its own memory after all. name -> (how, why).
    post_processed: dict[str, tuple[str, str]] = field(default_factory=dict)
    unwritten: list[str] = field(default_factory=list)  # nothing in loading wrote them
    # Planned parameters some elements of which no copy or fill writes (a fused gate_up_proj
    # whose up_proj the checkpoint lacks): name -> those elements' bytes. Zeros in the daemon.
    incomplete: dict[str, int] = field(default_factory=dict)
    unread: list[str] = field(default_factory=list)  # checkpoint tensors no planned copy reads
    created: list[str] = field(default_factory=list)  # tensors post-processing added
    post_error: str | None = None  # post-processing could not run on meta

    @property
    def planned(self) -> list[str]:
        return [] if self.plan is None else [p.name for p in self.plan.params]

    @property
    def planned_bytes(self) -> int:
        return sum(self.param_bytes[n] for n in self.planned)

    @property
    def copied_bytes(self) -> int:
        """What the engine ends up holding itself: unplanned and post-processed parameters."""
        return sum(self.param_bytes[n] for n in {*self.copied, *self.post_processed})


# --------------------------------------------------------------------------- bookkeeping


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _region(t: torch.Tensor) -> Region:
    return Region(t.storage_offset(), list(t.shape), list(t.stride()))


@dataclass(frozen=True)
class _Piece:
    """Part ``region`` of a storage: a checkpoint tensor's region (``source``/``src``, reached
    through ``casts``), a constant (``value``), or something untraceable (``unknown``)."""

    region: Region
    source: str | None = None
    src: Region | None = None
    casts: tuple[str, ...] = ()
    value: float | None = None
    unknown: str | None = None


@dataclass
class _Frame:
    """What the tracer knows of one storage that holds checkpoint data."""

    dtype: torch.dtype
    pieces: list[_Piece] = field(default_factory=list)
    tainted: str | None = None


@dataclass(frozen=True)
class _Part:
    """A read resolved: elements ``[start, stop)`` of the read's dim ``dim`` (all when dim is
    None) come from ``piece`` at ``src`` (its source region, or its constant)."""

    dim: int | None
    start: int
    stop: int
    piece: _Piece
    src: Region | None


@dataclass
class _Param:
    names: list[str]
    param: torch.Tensor
    copies: list[Copy] = field(default_factory=list)
    fills: list[Fill] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)  # loading: not plannable
    post: list[tuple[str, str]] = field(default_factory=list)  # post-processing: (how, why)
    # A buffer: the model's own (rotary tables, scales) unless loading writes it.
    buffer: bool = False

    @property
    def name(self) -> str:
        return self.names[0]


_VIEWLESS_COPIES = {aten._to_copy.default, aten.clone.default}


class _Recorder(TorchDispatchMode):
    def __init__(self, params: dict[int, _Param], sources: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.params = params
        self.frames: dict[int, _Frame] = {}
        self.keep: list[torch.Tensor] = []  # storages stay alive, so keys stay unique
        self.source_keys: dict[int, str] = {}
        self.read: set[str] = set()
        self.phase = "load"
        for name, t in sources.items():
            whole = _region(t)
            self._frame(t).pieces.append(_Piece(whole, name, whole))
            self.source_keys[_key(t)] = name

    def _frame(self, t: torch.Tensor) -> _Frame:
        key = _key(t)
        if key not in self.frames:
            self.frames[key] = _Frame(t.dtype)
            self.keep.append(t)
        return self.frames[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except NotImplementedError:
            # An engine kernel with no meta implementation (vLLM's CPU build repacks MoE
            # experts with one). During post-processing, one that returns nothing and
            # declares what it writes is followed as writing those, whatever it computes.
            if self.phase != "post" or not _writes_only(func):
                raise
            out = None
        self._observe(func, args, kwargs, out)
        return out

    # ------------------------------------------------------------------ per operation

    def _observe(self, func, args, kwargs, out) -> None:
        if func is aten.copy_.default and _same_view(args[0], args[1]):
            return  # torch returns at once: no byte is written (vLLM's MoE "padding" does it)
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        input_keys = {_key(a) for a in inputs}
        for t in self._mutated(func, args, kwargs):
            if _key(t) in self.params:
                self._param_write(self.params[_key(t)], func, args, t)
            elif _key(t) in self.frames:
                self._frame_write(self._frame(t), func, args, t)
            elif func is aten.copy_.default and t is args[0]:
                self._frame_write(self._frame(t), func, args, t)  # a fresh temporary
        if func._schema.is_mutable:
            return
        outputs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        fresh = [o for o in outputs if _key(o) not in input_keys]
        if not fresh:
            return  # a view: reads resolve through the storage it shares
        tracked = [a for a in inputs if _key(a) in self.frames]
        if func in _VIEWLESS_COPIES and len(fresh) == 1 and tracked:
            self._derive(fresh[0], [(args[0], _region(fresh[0]))])
        elif func is aten.cat.default:
            self._concatenate(fresh[0], args[0], args[1] if len(args) > 1 else 0, stack=False)
        elif func is aten.stack.default:
            self._concatenate(fresh[0], args[0], args[1] if len(args) > 1 else 0, stack=True)
        elif tracked:
            for o in fresh:
                self._frame(o).tainted = f"computed from checkpoint data by {func}"

    @staticmethod
    def _mutated(func, args, kwargs) -> list[torch.Tensor]:
        out = []
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if isinstance(value, torch.Tensor):
                out.append(value)
        return out

    def _param_write(self, param: _Param, func, args, dst: torch.Tensor) -> None:
        if self.phase == "post":
            param.post.append(("writes", f"post-processing writes it ({func})"))
            return
        value = self._constant(func, args)
        if value is not None:
            param.fills.append(Fill(param.name, _region(dst), value))
            return
        if func is not aten.copy_.default:
            param.reasons.append(f"written by {func}")
            return
        parts = self._resolve(args[1].expand(dst.shape) if args[1].shape != dst.shape
                              else args[1])  # fmt: skip
        if isinstance(parts, str):
            param.reasons.append(parts)
            return
        whole = _region(dst)
        for part in parts:
            target = whole if part.dim is None else narrow(
                whole, part.dim, part.start, part.stop - part.start)  # fmt: skip
            if part.piece.value is not None:
                param.fills.append(Fill(param.name, target, part.piece.value))
                continue
            assert part.piece.source is not None and part.src is not None
            casts = [*part.piece.casts]  # they end with the dtype the read has
            while casts and casts[-1] == dtype_name(dst.dtype):
                casts.pop()
            self.read.add(part.piece.source)
            param.copies.append(Copy(part.piece.source, part.src, param.name, target, casts))

    @staticmethod
    def _constant(func, args) -> float | None:
        if func is aten.zero_.default:
            return 0.0
        if func is aten.fill_.Scalar:
            return float(args[1])
        if func is aten.fill_.Tensor and args[1].device.type != "meta":
            return float(args[1])
        return None

    def _frame_write(self, frame: _Frame, func, args, dst: torch.Tensor) -> None:
        """A temporary (or a stand-in) written in place: follow copies and fills into it."""
        if frame.tainted:
            return
        if _key(dst) in self.source_keys:
            frame.tainted = f"the checkpoint tensor was modified in place ({func})"
            return
        region = _region(dst)
        value = self._constant(func, args)
        if value is not None:
            new = [_Piece(region, value=value)]
        elif func is aten.copy_.default:
            src = args[1].expand(dst.shape) if args[1].shape != dst.shape else args[1]
            parts = self._resolve(src)
            if isinstance(parts, str):
                new = [_Piece(region, unknown=parts)]
            else:
                new = [self._moved(p, region, dst.dtype, src.dtype) for p in parts]
        else:
            frame.tainted = f"modified in place by {func}"
            return
        if frame.dtype != dst.dtype:
            frame.tainted = f"reinterpreted as {dst.dtype}"
            return
        span = extent(region)
        if span is not None and any(
            (other := extent(p.region)) is not None and other[0] <= span[1] and span[0] <= other[1]
            for p in frame.pieces
        ):
            frame.tainted = "overwritten in place"
            return
        frame.pieces += new

    def _moved(self, part: _Part, region: Region, to: torch.dtype, was: torch.dtype) -> _Piece:
        """``part`` of a read, placed at its share of ``region`` (and cast to ``to``)."""
        target = region if part.dim is None else narrow(
            region, part.dim, part.start, part.stop - part.start)  # fmt: skip
        p = part.piece
        casts = p.casts + ((dtype_name(to),) if to != was else ())
        return _Piece(target, p.source, part.src, casts, p.value, p.unknown)

    def _derive(self, out: torch.Tensor, reads: list[tuple[torch.Tensor, Region]]) -> None:
        frame = self._frame(out)
        for t, region in reads:
            parts = self._resolve(t)
            if isinstance(parts, str):
                frame.pieces.append(_Piece(region, unknown=parts))
            else:
                frame.pieces += [self._moved(p, region, out.dtype, t.dtype) for p in parts]

    def _concatenate(self, out, tensors, dim: int, stack: bool) -> None:
        whole = _region(out)
        dim = dim % out.dim()
        reads = []
        offset = 0
        for t in tensors:
            if stack:
                reads.append((t, select(whole, dim, offset)))
                offset += 1
            elif t.dim() == 1 and t.numel() == 0 and out.dim() > 1:
                continue  # cat skips legacy empty tensors
            else:
                reads.append((t, narrow(whole, dim, offset, t.shape[dim])))
                offset += t.shape[dim]
        if any(_key(t) in self.frames for t, _ in reads):
            self._derive(out, reads)

    # ------------------------------------------------------------------ reads

    def _resolve(self, t: torch.Tensor) -> list[_Part] | str:
        """Where ``t``'s elements come from, or why that cannot be said."""
        frame = self.frames.get(_key(t))
        if frame is None:
            return "written from a tensor not read from the checkpoint"
        if frame.tainted:
            return frame.tainted
        if frame.dtype != t.dtype:
            return f"reads checkpoint bytes reinterpreted as {t.dtype}"
        g = _region(t)
        if numel(g.shape) == 0:
            return []
        for piece in frame.pieces:
            part = self._part(g, piece, None, 0, 0)
            if part is not None:
                return self._checked([part])
        # Several pieces (a concatenation): split the read along one of its dims.
        for m in sorted(range(len(g.shape)), key=lambda k: -g.stride[k]):
            n = g.shape[m]
            if n < 2 or n * len(frame.pieces) > SPLIT_BUDGET:
                continue
            parts = self._split(g, m, frame.pieces)
            if parts is not None:
                return self._checked(parts)
        return "reads across concatenated pieces in a way the tracer does not follow"

    @staticmethod
    def _part(g: Region, piece: _Piece, dim: int | None, start: int, stop: int) -> _Part | None:
        if piece.src is None:
            return _Part(dim, start, stop, piece, None) if _inside(g, piece.region) else None
        src = through(g, piece.region, piece.src)
        return None if src is None else _Part(dim, start, stop, piece, src)

    def _split(self, g: Region, m: int, pieces: list[_Piece]) -> list[_Part] | None:
        owners = []
        for j in range(g.shape[m]):
            row = narrow(g, m, j, 1)
            owner = next((p for p in pieces if _inside(row, p.region)), None)
            if owner is None:
                return None
            owners.append(owner)
        parts = []
        start = 0
        for j in range(1, len(owners) + 1):
            if j == len(owners) or owners[j] is not owners[start]:
                part = self._part(narrow(g, m, start, j - start), owners[start], m, start, j)
                if part is None:
                    return None
                parts.append(part)
                start = j
        return parts

    @staticmethod
    def _checked(parts: list[_Part]) -> list[_Part] | str:
        for part in parts:
            if part.piece.unknown is not None:
                return part.piece.unknown
        return parts


def _writes_only(func) -> bool:
    """An operator that returns nothing and writes some of its arguments."""
    schema = func._schema
    return not schema.returns and any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
    )


def _same_view(a: torch.Tensor, b: object) -> bool:
    return (
        isinstance(b, torch.Tensor)
        and _key(a) == _key(b)
        and a.dtype == b.dtype
        and _region(a) == _region(b)
    )


def _inside(g: Region, frame: Region) -> bool:
    return locate(g, frame) is not None


# --------------------------------------------------------------------------- the trace


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers: engines load checkpoint tensors into both (BERT's
    ``position_ids``), so both are the model's tensors a plan may fill."""
    return {**dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False))}  # fmt: skip


def _buffers_on_meta(model: nn.Module) -> None:
    """Buffers are real in a model built under ``meta_parameters``; during the trace they
    are replaced by meta stand-ins, so copies into them are followed like any other (and
    cost nothing) and the real ones are never written. :class:`_ModuleState` puts the real
    ones back: the module may be the engine's, shared (vLLM's cached rotary embedding)."""
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and not buf.is_meta:
                module._buffers[name] = buf.to("meta")


class _ModuleState:
    """Every module's own state (parameters, buffers, submodules, attributes), as taken."""

    def __init__(self, model: nn.Module) -> None:
        self.saved = [
            (m, dict(m.__dict__), dict(m._parameters), dict(m._buffers), dict(m._modules),
             set(m._non_persistent_buffers_set))
            for m in model.modules()
        ]  # fmt: skip

    def restore(self) -> None:
        # The same dict objects, refilled: a module's code may hold on to them.
        for module, attributes, parameters, buffers, modules, non_persistent in self.saved:
            pairs = ((module._parameters, parameters), (module._buffers, buffers),
                     (module._modules, modules))  # fmt: skip
            for current, saved in pairs:
                current.clear()
                current.update(saved)
            module._non_persistent_buffers_set.clear()
            module._non_persistent_buffers_set.update(non_persistent)
            module.__dict__.clear()
            module.__dict__.update(attributes)  # the dicts above among them


@contextmanager
def isolated(caches: Iterable[MutableMapping] = ()) -> Iterator[None]:
    """Restore, on the way out, what building and tracing a throwaway model may change in
    the process: torch's default dtype, grad mode, the random generators
    (torch's CPU one and every initialised CUDA device's, Python's, numpy's once imported)
    and ``caches``, the engine's process-wide module caches (vLLM's and SGLang's rotary
    embeddings), to their contents before. The engine's real model is then built as on a
    cold start, sharing nothing with the throwaway one."""
    caches = list(caches)
    contents = [dict(cache) for cache in caches]
    dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    python_rng = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_rng = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        for cache, content in zip(caches, contents, strict=True):
            cache.clear()
            cache.update(content)
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        random.setstate(python_rng)
        if numpy_rng is not None:
            numpy.random.set_state(numpy_rng)


def _parameters(model: nn.Module) -> dict[int, _Param]:
    by_storage: dict[int, _Param] = {}
    buffers = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    for name, param in _tensors(model).items():
        key = _key(param)
        known = by_storage.get(key)
        if known is None:
            by_storage[key] = _Param([name], param, buffer=name in buffers)
            continue
        known.names.append(name)  # tied: one parameter, or one view of it, under two names
        other = known.param
        if (other.dtype, other.shape, other.stride(), other.storage_offset()) != (
            param.dtype,
            param.shape,
            param.stride(),
            param.storage_offset(),
        ):
            known.reasons.append(f"shares its storage with parameter {name!r}")
    for p in by_storage.values():
        t = p.param
        if not t.is_meta:
            raise ValueError(f"parameter {p.name!r} is on {t.device}; trace a model built on meta")
        if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.itemsize:
            p.reasons.append("its storage holds more than this parameter")
    return by_storage


def trace_load(
    model: nn.Module,
    sources: Mapping[str, SourceTensor],
    load: EngineLoad,
    *,
    post_process: Callable[[], object] | None = None,
    order: Iterable[str] | None = None,
) -> TraceReport:
    """Run the engine's ``load`` (its own loading code, given ``(name, tensor)`` pairs) on
    ``model`` (parameters on meta; its buffers are replaced by meta stand-ins while it runs)
    against stand-ins of ``sources``, then ``post_process``;
    return the plan and what could not be planned. ``order``: the checkpoint names in the
    order the engine would read them (default: ``sources``' order). Every module of
    ``model`` is left as it was before (its parameters, buffers, submodules, attributes)."""
    state = _ModuleState(model)
    try:
        return _trace(model, sources, load, post_process, order)
    finally:
        state.restore()


def _trace(model, sources, load, post_process, order) -> TraceReport:
    _buffers_on_meta(model)
    params = _parameters(model)
    before = {name: (key, p.param) for key, p in params.items() for name in p.names}
    inputs = stand_ins(sources)
    recorder = _Recorder(params, inputs)
    names = list(order) if order is not None else list(inputs)
    with torch.no_grad(), recorder:
        load((name, inputs[name]) for name in names)
    _replaced(model, before, params, post=False)
    post_error = None
    if post_process is not None:
        recorder.phase = "post"
        try:
            with torch.no_grad(), recorder:
                post_process()
        except Exception as exc:  # ops that cannot run on meta, device checks, ...
            post_error = f"{type(exc).__name__}: {exc}"
        created = _replaced(model, before, params, post=True)
    else:
        created = []
    return _report(params, sources, recorder.read, created, post_error)


def _replaced(model: nn.Module, before, params: dict[int, _Param], post: bool) -> list[str]:
    """Mark parameters that are gone or on another storage; return tensors that are new."""
    now = _tensors(model)
    when = "post-processing" if post else "loading"
    for name, (key, _) in before.items():
        current = now.get(name)
        why = None
        if current is None:
            why = f"removed by {when}"
        elif _key(current) != key:
            why = f"replaced by {when}"
        if why is not None and post:
            params[key].post.append(("replaces", why))
        elif why is not None:
            params[key].reasons.append(why)
    return sorted(n for n, t in now.items() if n not in before and not t.is_meta)


def _report(params: dict[int, _Param], sources, read: set[str], created, post_error) -> TraceReport:
    # Buffers nothing loads into are the model's business, neither planned nor copied.
    params = {k: p for k, p in params.items() if not p.buffer or p.copies or p.fills}
    report = TraceReport(
        plan=None,
        param_bytes={p.name: p.param.numel() * p.param.itemsize for p in params.values()},
        unread=sorted(set(sources) - read),
        created=created,
        post_error=post_error,
    )
    planned: list[_Param] = []
    for p in params.values():
        if p.reasons:
            report.copied[p.name] = "; ".join(dict.fromkeys(p.reasons))
        elif not p.copies and not p.fills:
            report.unwritten.append(p.name)
        else:
            planned.append(p)
    entries = {p.name: _entry(p) for p in planned}
    ok = []
    for p in planned:
        alone = LoadPlan(v=1, params=[entries[p.name]], copies=p.copies, fills=p.fills)
        try:
            summary = check_plan(alone, sources, max_elements=p.param.numel())
        except PlanError as exc:
            report.copied[p.name] = f"its writes do not form a plan: {exc}"
            continue
        coverage = summary.params[p.name]
        if not coverage.complete:
            report.incomplete[p.name] = coverage.unwritten_bytes
        if p.post:
            how = "writes" if any(h == "writes" for h, _ in p.post) else "replaces"
            report.post_processed[p.name] = (how, "; ".join(dict.fromkeys(w for _, w in p.post)))
        ok.append(p)
    if ok:
        report.plan = LoadPlan(
            v=1,
            params=[entries[p.name] for p in ok],
            copies=[c for p in ok for c in p.copies],
            fills=[f for p in ok for f in p.fills],
        )
    return report


def _entry(p: _Param) -> ParamEntry:
    t = p.param
    return ParamEntry(p.name, dtype_name(t.dtype), list(t.shape), list(t.stride()), p.names[1:])
