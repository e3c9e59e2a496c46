"""weightcache.integrations.layouts: when a model goes to the engine's own loader instead.

The zero-copy path itself (trace, daemon build, mapping) runs against the real
engines in tests/engines/; here the decisions that send a model to the engine's
default loader, on the toy engine of tests/unit/toyengine.py.
"""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch

from tests.unit.toyengine import ToyEngine, checkpoint, meta_model, real_load, sources
from weightcache.integrations import layouts
from weightcache.integrations.layouts import (
    NotServable,
    engine_layout,
    from_disk,
    unfilled,
    unwritten_by_checkpoint,
)
from weightcache.integrations.settings import AdapterSettings
from weightcache.integrations.trace import trace_load


@pytest.fixture(autouse=True)
def fresh_decisions():
    layouts.forget_layouts()
    yield
    layouts.forget_layouts()


def settings(**extra) -> AdapterSettings:
    return AdapterSettings.from_sources({"socket": "/nonexistent/cpu.sock", **extra}, {})


def traced_without(missing: str):
    """The toy engine's loading traced against a checkpoint lacking ``missing``."""
    tensors = checkpoint(layers=1)
    del tensors[missing]
    model = meta_model(layers=1)
    return trace_load(model, sources(tensors), model.load_weights), tensors


def test_from_disk_warns_once_per_process_and_refuses_without_fallback(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="weightcache"):
        first = from_disk(settings(), "", "quantization 'fp8': its post-processing re-lays it")
        again = from_disk(settings(), "", "quantization 'fp8': its post-processing re-lays it")
    assert again is first and first.attached is None
    assert first.disk == first.reason == "quantization 'fp8': its post-processing re-lays it"
    assert [r.getMessage() for r in caplog.records] == [
        "weightcache: the engine's default loader loads the model from disk: "
        "quantization 'fp8': its post-processing re-lays it"
    ]
    with pytest.raises(NotServable, match=r"cannot serve this model: why \(fallback is off\)"):
        from_disk(settings(fallback=False), "", "why")


def test_a_parameter_no_checkpoint_tensor_fills_sends_the_model_to_the_engines_loader(
    tmp_path, caplog
) -> None:
    """Decided from the trace, before any attach: the checkpoint layout could not fill it
    either, and the engine's own loader knows what to do (vLLM's refuses, naming it)."""
    report, _ = traced_without("model.layers.0.input_layernorm.weight")
    assert report.unwritten == ["layers.0.norm"]
    socket = tmp_path / "cpu.sock"
    socket.touch()  # a daemon's socket is there; the decision never reaches it
    with caplog.at_level(logging.WARNING, logger="weightcache"):
        decided = engine_layout(settings(), str(socket), [], lambda: report)
    assert decided.attached is None
    assert decided.disk == "1 parameter(s) no checkpoint tensor fills: layers.0.norm"
    assert decided.disk in caplog.text
    layouts.forget_layouts()
    with pytest.raises(NotServable, match="layers.0.norm"):
        engine_layout(settings(fallback=False), str(socket), [], lambda: report)


def test_a_fused_parameter_the_checkpoint_fills_in_part_goes_to_the_engines_loader(
    tmp_path, caplog
) -> None:
    """A checkpoint without one expert's w3: the layout would hold zeros for its half of
    w13, so the model is the engine's own loader's, from disk, decided from the trace
    before any attach, with one WARNING naming the parameter and the bytes nothing writes
    (``fallback`` off: NotServable saying the same)."""
    report, _ = traced_without("model.layers.0.mlp.experts.1.w3.weight")
    assert report.unwritten == [] and "layers.0.w13" in report.planned
    socket = tmp_path / "cpu.sock"
    socket.touch()  # a daemon's socket is there; the decision never reaches it
    # w13: 4 experts x (24 + 24) x 16 bf16; expert 1's w3: 24 x 16.
    why = (
        "1 parameter(s) filled in part: layers.0.w13: 768 of 6,144 bytes written by no "
        "checkpoint tensor"
    )
    with caplog.at_level(logging.WARNING, logger="weightcache"):
        decided = engine_layout(settings(), str(socket), [], lambda: report)
        again = engine_layout(settings(), str(socket), [], lambda: report)
    assert again is decided and decided.attached is None and decided.disk == why
    assert [r.getMessage() for r in caplog.records] == [
        f"weightcache: the engine's default loader loads the model from disk: {why}"
    ]
    layouts.forget_layouts()
    with pytest.raises(NotServable) as refused:
        engine_layout(settings(fallback=False), str(socket), [], lambda: report)
    assert str(refused.value) == f"weightcache cannot serve this model: {why} (fallback is off)"


def test_what_no_checkpoint_tensor_writes_is_named_with_its_bytes_and_padding_is_not() -> None:
    both, _ = traced_without("model.layers.0.self_attn.k_proj.weight")
    both.unwritten.append("layers.0.norm")
    assert unwritten_by_checkpoint(both) == (
        "1 parameter(s) no checkpoint tensor fills: layers.0.norm; 1 parameter(s) filled in "
        "part: layers.0.qkv_weight: 256 of 1,024 bytes written by no checkpoint tensor"
    )
    tensors = checkpoint(layers=1)
    for kw in ({}, {"tp_rank": 1, "tp_size": 2}):  # rank 1's padding rows: a fill
        model = meta_model(layers=1, **kw)
        report = trace_load(model, sources(tensors), model.load_weights)
        assert report.plan is not None and unwritten_by_checkpoint(report) is None


def test_unfilled_names_what_a_load_left_without_its_value() -> None:
    report, tensors = traced_without("model.norm.weight")
    model = ToyEngine(layers=1)
    real_load(model, {**tensors, "model.norm.weight": torch.zeros(16)})
    assert unfilled(model, report) == {"norm": "no checkpoint tensor filled it"}
    model.layers[0].register_buffer("cos_sin_cache", torch.empty(4, device="meta"))
    layer = model.layers[0]
    layer.o_proj = torch.nn.Parameter(layer.o_proj.to("meta"), requires_grad=False)
    assert unfilled(model, report) == {
        "norm": "no checkpoint tensor filled it",
        "layers.0.o_proj": "left on meta",
        "layers.0.cos_sin_cache": "left on meta",
    }
    complete, tensors = traced_without("model.layers.0.self_attn.rotary_emb.inv_freq")
    model = ToyEngine(layers=1)
    real_load(model, tensors)
    assert unfilled(model, complete) == {}  # tied lm_head included (an alias of embed)


def test_the_traced_model_is_freed_before_the_engine_samples_its_device(tmp_path) -> None:
    """Engines sample the device right after the decision (vLLM's snapshot): by then the
    throwaway model is gone, cycles and all, so the memory it took is back with the
    allocator (and, on CUDA, with the driver: tests/gpu/test_engine_adapters_gpu.py). Its
    modules hold each other, as an engine's do, so only a collection frees it; automatic
    collection is off here, so nothing but the decision's own collection can."""
    report, _ = traced_without("model.layers.0.input_layernorm.weight")
    socket = tmp_path / "cpu.sock"
    socket.touch()
    traced: list[weakref.ref] = []

    def trace():
        model = meta_model(layers=1)
        model.layers[0].owner = model  # a module holding its parent, as engines' layers do
        traced.append(weakref.ref(model))
        return report

    gc.collect()
    gc.disable()
    try:
        engine_layout(settings(), str(socket), [], trace)
        assert traced and traced[0]() is None
    finally:
        gc.enable()
