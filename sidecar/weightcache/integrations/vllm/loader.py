"""The ``weightcache`` vLLM model loader (imported by :func:`..register`, never before).

vLLM's worker asks the loader for ``get_external_weight_memory`` before its
memory snapshot and takes those bytes off its budget (``request_memory``).
That first call traces vLLM's own ``load_weights`` and
``process_weights_after_loading`` on a throwaway model built on meta (with
a copy of the config, so vLLM's layer registry sees the real model once),
and has the rank's daemon build that layout (:mod:`..layouts`): the budget
is then the layout's bytes, the engine's weights as on a cold start, and the
daemon's memory has settled (a dropped checkpoint layout included) before
vLLM measures. ``load_model`` maps every parameter of the real model from
that layout, runs vLLM's post-processing and reports mapped and copied
bytes from the parameters' own storages.

Where no layout can be had, the daemon's checkpoint layout is mapped as
before (:mod:`..loading`): tensors vLLM fuses are copied into engine memory
by its own weight loaders. What neither layout can give (a quantized model:
its post-processing re-lays the weights; parameters no checkpoint tensor
fills, wholly or in part), and a load that left a parameter without its value, vLLM's own
``DefaultModelLoader`` loads from disk instead, with one WARNING saying why.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os

import torch
from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.distributed import parallel_state
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.utils import (
    initialize_model,
    process_weights_after_loading,
)
from vllm.utils.torch_utils import set_default_torch_dtype

from weightcache.checkpoint import checkpoint_files, checkpoint_sources, read_checkpoint
from weightcache.client import meta_parameters
from weightcache.devices import gpu_uuid
from weightcache.integrations.layouts import (
    LayoutDecision,
    LayoutLoad,
    NotServable,
    describe_copied,
    describe_unfilled,
    engine_layout,
    from_disk,
    map_engine_layout,
    storage_report,
    unfilled,
)
from weightcache.integrations.loading import (
    Attachment,
    EngineTarget,
    IncompleteLoad,
    LoadReport,
    attachment,
    expected_configs,
    load_from_daemon,
    local_model_dir,
    still_mapped,
)
from weightcache.integrations.settings import AdapterSettings
from weightcache.integrations.trace import TraceReport, isolated, trace_load
from weightcache.protocol import ShardSpec

log = logging.getLogger(__name__)

# vLLM writes weights in place through its model runner's reload_weights (from disk, from
# tensors, layerwise: it first re-lays the model's parameters on meta, so the refusal must
# come before it) and, for weight-transfer updates, the model's load_weights. A model loaded
# from the daemon refuses both with this text, untouched, and vLLM serves on.
WEIGHT_UPDATES_REFUSED = (
    "weightcache: this engine's weights are mapped read-only from the weightcache daemon, "
    "which shares them with every engine attached to it; updating them in place is refused. "
    "Serve the new weights from a WeightCache of their own (or restart without "
    "--load-format weightcache)"
)
# A speculative draft is not the cache's model: without a WeightCache of its own
# (draft_cache / draft_socket) it loads from disk, whatever `fallback` says.
DRAFT_FROM_DISK = (
    "weightcache: the draft model %s loads from disk (a draft is not the cache's model; "
    "draft_cache or draft_socket maps it from a WeightCache of its own)"
)


class WeightcacheModelLoader(BaseModelLoader):
    """``--load-format weightcache``: weights mapped from this rank's weightcache daemon."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        self.settings = AdapterSettings.from_sources(
            load_config.model_loader_extra_config, os.environ
        )
        # What the last load_model did: where each daemon tensor went, and which mapped
        # tensors vLLM's post-processing then replaced with its own copies.
        self.report: LoadReport | None = None
        self.replaced: list[str] = []
        # With the engine's own layout: where every parameter lives after post-processing.
        self.layout_load: LayoutLoad | None = None

    # ------------------------------------------------------------------ vLLM's hooks

    def get_external_weight_memory(self, vllm_config: VllmConfig) -> int:
        """The bytes this rank's weights will hold: the target's own layout from its daemon
        (the engine's weights, as a cold start counts them), else the daemon's checkpoint
        bytes, 0 for a disk load; plus a draft's from its own cache."""
        layout = self.layout(vllm_config)
        if layout.disk is not None:
            total = 0  # vLLM's own loader: its weights are its own allocations
        elif layout.attached is not None:
            total = layout.layout_bytes
        else:
            total = self.attachment(vllm_config, vllm_config.model_config).preloaded_weights_bytes
        speculative = getattr(vllm_config, "speculative_config", None)
        draft = getattr(speculative, "draft_model_config", None)
        if draft is not None and self.settings.for_draft() is not None:
            total += self.attachment(vllm_config, draft).preloaded_weights_bytes
        return total

    def download_model(self, model_config: ModelConfig) -> None:
        local_model_dir(model_config.model)  # nothing to download: the daemon's directory

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """In-place reloads would write into the daemon's read-only memory: refused."""
        raise RuntimeError(
            "the weightcache load format maps the daemon's weights read-only; reloading "
            "weights in place is not supported (restart the engine, or use another load format)"
        )

    def load_model(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = ""
    ) -> nn.Module:
        if model_config is vllm_config.model_config:
            layout = self.layout(vllm_config)
            if layout.disk is not None:
                return self._disk_loader().load_model(vllm_config, model_config, prefix)
            if layout.attached is not None:
                return self._load_layout(vllm_config, model_config, prefix, layout)
        decided = self.attachment(vllm_config, model_config)
        if decided.attached is None:
            return self._disk_loader().load_model(vllm_config, model_config, prefix)
        device = _load_device(vllm_config, self.load_config)
        registered = RegisteredLayers.of(vllm_config)
        with set_default_torch_dtype(model_config.dtype), device, meta_parameters():
            model = initialize_model(
                vllm_config=vllm_config, model_config=model_config, prefix=prefix
            )
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        if tp_size > 1:
            # The daemon holds this rank's shards; vLLM's weight loaders then skip
            # their own narrowing (the flag pre-sharded checkpoints use).
            for param in model.parameters():
                param.is_sharded_weight = True
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        name_map = mapper.map_name if mapper is not None else None
        tensors = decided.attached.tensors
        try:
            with device:
                report = load_from_daemon(
                    model, tensors, device, name_map=name_map,
                    engine_load_weights=model.load_weights,
                )  # fmt: skip
        except IncompleteLoad as exc:
            return self._instead_from_disk(
                vllm_config, model_config, prefix, str(exc), registered
            )
        process_weights_after_loading(model, model_config, device)
        replaced = still_mapped(model, report, tensors, name_map)
        self.report, self.replaced = report, replaced
        if replaced:
            log.warning(
                "weightcache: vLLM's post-processing replaced %d daemon-mapped tensor(s) with "
                "its own copies (%s); they occupy engine memory twice",
                len(replaced),
                ", ".join(replaced[:5]),
            )
        model.load_weights = _refuse_weight_updates  # instance attribute: this model only
        model.weightcache_read_only = True
        _guard_runner_reloads()
        log.info(
            "weightcache: %d tensor(s) (%d bytes) mapped zero-copy over %s from daemon pid %d; "
            "%d tensor(s) (%d bytes) copied into vLLM's own layout (fused parameters)",
            len(report.mapped),
            report.mapped_bytes,
            decided.attached.transport,
            decided.attached.daemon_pid,
            len(report.copied),
            report.copied_bytes,
        )
        return model.eval()

    # ------------------------------------------------------------------ ours

    def _load_layout(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str,
        layout: LayoutDecision,
    ) -> nn.Module:  # fmt: skip
        device = _load_device(vllm_config, self.load_config)
        registered = RegisteredLayers.of(vllm_config)
        with set_default_torch_dtype(model_config.dtype), device, meta_parameters():
            model = initialize_model(
                vllm_config=vllm_config, model_config=model_config, prefix=prefix
            )
        model_dir = local_model_dir(model_config.model)
        with device:
            own = map_engine_layout(
                model, layout, device, engine_load_weights=model.load_weights,
                checkpoint_files=checkpoint_files(model_dir),
            )  # fmt: skip
        process_weights_after_loading(model, model_config, device)
        missing = unfilled(model, layout.report)
        if missing:  # never served: vLLM's own loader does it from disk
            return self._instead_from_disk(vllm_config, model_config, prefix,
                                           describe_unfilled(missing), registered)  # fmt: skip
        self.layout_load = load = storage_report(model, layout.attached, own)
        model.load_weights = _refuse_weight_updates  # instance attribute: this model only
        model.weightcache_read_only = True
        _guard_runner_reloads()
        log.info(
            "weightcache: vLLM's own layout (plan %s) over %s from daemon pid %d: %d "
            "parameter(s) (%d bytes) mapped zero-copy, %d (%d bytes) in engine memory%s",
            layout.attached.config.plan[:12], layout.attached.transport,
            layout.attached.daemon_pid, len(load.mapped), load.mapped_bytes, len(load.copied),
            load.copied_bytes, f": {describe_copied(load.copied)}" if load.copied else "",
        )  # fmt: skip
        return model.eval()

    def _instead_from_disk(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str, why: str,
        registered: RegisteredLayers,
    ) -> nn.Module:  # fmt: skip
        """A load from the daemon that left ``why``: the model built for it is discarded
        (its layers leave vLLM's registries, ``registered`` as before it was built) and
        vLLM's default loader loads the model from disk (the bytes the worker took off its
        budget for the daemon then only make the KV cache smaller). With ``fallback`` off,
        the load fails saying why."""
        if not self.settings.fallback:
            raise NotServable(f"weightcache: the model loaded from the daemon is incomplete: "
                              f"{why} (fallback is off)")  # fmt: skip
        log.warning(
            "weightcache: the model loaded from the daemon is incomplete, so vLLM's default "
            "loader loads it from disk instead: %s", why,
        )  # fmt: skip
        registered.restore(vllm_config)
        return self._disk_loader().load_model(vllm_config, model_config, prefix)

    def layout(self, vllm_config: VllmConfig) -> LayoutDecision:
        """The target model's own layout from this rank's daemon, or why not (decided once
        per process); a model neither layout can give is loaded from disk (``disk``)."""
        model_config = vllm_config.model_config
        _check_supported(vllm_config, model_config)
        disk = _from_disk_only(model_config)
        if disk is not None:
            return from_disk(self.settings, "", disk)
        device = _load_device(vllm_config, self.load_config)
        socket, candidates = self._target(
            vllm_config, model_config, device, self.settings, own_layout=True
        )
        return engine_layout(
            self.settings, socket, candidates,
            lambda: self._trace(vllm_config, model_config, device),
        )  # fmt: skip

    def _trace(
        self, vllm_config: VllmConfig, model_config: ModelConfig, device: torch.device
    ) -> TraceReport:
        """vLLM's loading and post-processing of a throwaway meta model, as a plan."""
        from vllm.config import set_current_vllm_config

        twin_config = copy.deepcopy(vllm_config)  # vLLM registers layers in its config
        # The real model is built after this one, from vLLM's rotary cache among others:
        # it must find them as a cold start would (trace.isolated).
        with isolated(caches=_process_caches()), set_current_vllm_config(twin_config):
            with set_default_torch_dtype(model_config.dtype), device, meta_parameters():
                twin = initialize_model(
                    vllm_config=twin_config, model_config=twin_config.model_config
                )
            sources = checkpoint_sources(read_checkpoint(local_model_dir(model_config.model)))
            return trace_load(
                twin, sources, twin.load_weights,
                post_process=lambda: process_weights_after_loading(
                    twin, twin_config.model_config, device
                ),
            )  # fmt: skip

    def attachment(self, vllm_config: VllmConfig, model_config: ModelConfig) -> Attachment:
        """This rank's checkpoint-layout attach decision for the target (the path when
        its own layout cannot be had) or a speculative draft (``model_config`` other than
        the target's); made once per process, then cached."""
        settings = self.settings
        if model_config is not vllm_config.model_config:
            settings = self.settings.for_draft()
            if settings is None:
                log.info(DRAFT_FROM_DISK, model_config.model)
                return Attachment("", None, "a draft model without a cache of its own")
        _check_supported(vllm_config, model_config)
        disk = _from_disk_only(model_config)
        if disk is not None:
            return Attachment("", None, from_disk(settings, "", disk).disk)
        device = _load_device(vllm_config, self.load_config)
        socket, candidates = self._target(vllm_config, model_config, device, settings)
        return attachment(settings, socket, candidates)

    def _target(
        self, vllm_config: VllmConfig, model_config: ModelConfig, device: torch.device,
        settings: AdapterSettings, *, own_layout: bool = False,
    ) -> tuple[str, list]:  # fmt: skip
        """This rank's daemon socket and the configs it may hold (for vLLM's ``own_layout``:
        :func:`expected_configs`)."""
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        target = EngineTarget(
            model_dir=local_model_dir(model_config.model),
            dtype=model_config.dtype,
            device=device,
            shard=ShardSpec(
                tp_size=tp_size,
                tp_rank=_tp_rank(tp_size),
                plan=settings.shard_plan or ("llama" if tp_size > 1 else None),
            ),
            revision=model_config.revision,
        )
        uuid = gpu_uuid(device.index or 0) if device.type == "cuda" else None
        return settings.socket_for(uuid, tp_size), expected_configs(target, own_layout=own_layout)

    def _disk_loader(self) -> DefaultModelLoader:
        return DefaultModelLoader(
            dataclasses.replace(self.load_config, load_format="auto", model_loader_extra_config={})
        )


@dataclasses.dataclass(frozen=True)
class RegisteredLayers:
    """The layers a vLLM config has registered by name at one moment. Attention, MoE and
    state-space layers register themselves in their config while a model is built, and
    refuse a name already there (``Duplicate layer name``): a discarded model's layers
    must leave before the model that replaces it is built under the same config."""

    forward_context: frozenset[str]
    moe_layers: int

    @classmethod
    def of(cls, vllm_config: VllmConfig) -> RegisteredLayers:
        compilation = vllm_config.compilation_config
        return cls(frozenset(compilation.static_forward_context),
                   len(compilation.static_all_moe_layers))  # fmt: skip

    def restore(self, vllm_config: VllmConfig) -> None:
        """Forget every layer registered since this moment."""
        compilation = vllm_config.compilation_config
        for name in set(compilation.static_forward_context) - self.forward_context:
            del compilation.static_forward_context[name]
        del compilation.static_all_moe_layers[self.moe_layers :]


def _process_caches() -> list[dict]:
    """The process-wide registries that building a vLLM model fills: vLLM's rotary
    embeddings (``get_rope`` hands one module per configuration to every model), and, with
    torch.compile on (vLLM's default), torch's Dynamo bytecode hooks, where each model's
    compile wrapper registers a bound method of itself: the trace's throwaway model would
    stay alive through it for the process's life, and its buffers with it, pinning the
    allocator segments they sit in (1,004 MiB at vLLM's snapshot on an H100, issue 41)."""
    from torch._dynamo import convert_frame
    from vllm.model_executor.layers import rotary_embedding

    return [rotary_embedding._ROPE_DICT, convert_frame._bytecode_hooks]


def _refuse_weight_updates(weights: object = None, *args: object, **kwargs: object) -> None:
    raise RuntimeError(WEIGHT_UPDATES_REFUSED)


def _guard_runner_reloads() -> None:
    """Make vLLM's model runner refuse ``reload_weights`` for a daemon-loaded model; once."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # the CPU runner's base too

    original = GPUModelRunner.reload_weights
    if getattr(original, "weightcache_guard", False):
        return

    def reload_weights(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003 - vLLM's
        if getattr(self.get_model(), "weightcache_read_only", False):
            raise RuntimeError(WEIGHT_UPDATES_REFUSED)
        return original(self, *args, **kwargs)

    reload_weights.weightcache_guard = True
    GPUModelRunner.reload_weights = reload_weights


def _from_disk_only(model_config: ModelConfig) -> str | None:
    """Why weightcache cannot give vLLM this model's weights in their final form (vLLM's
    default loader then loads it from disk), or None."""
    if model_config.quantization is not None:
        return (
            f"quantization {model_config.quantization!r}: its post-processing re-lays "
            "the weights into vLLM's own memory"
        )
    return None


def _check_supported(vllm_config: VllmConfig, model_config: ModelConfig) -> None:
    """Configurations that would write the weights in place, or that the daemon does not
    shard for: refused, since they ask for what weightcache cannot give."""
    problems = []
    if model_config.enable_sleep_mode:
        problems.append(
            "sleep mode (level 2 discards the weights and wakes up by reloading them in place; "
            "the mapped ones are the daemon's, the copied ones cannot be reloaded)"
        )
    if getattr(vllm_config, "weight_transfer_config", None) is not None:
        problems.append("weight transfer (it writes every weight in place)")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        problems.append("pipeline parallelism (the daemon shards by tensor-parallel rank only)")
    if problems:
        raise ValueError("the weightcache load format does not support " + "; ".join(problems))


def _load_device(vllm_config: VllmConfig, load_config: LoadConfig) -> torch.device:
    device = torch.device(load_config.device or vllm_config.device_config.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _tp_rank(tp_size: int) -> int:
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank()
    if tp_size > 1:
        raise RuntimeError("tensor-parallel rank asked before vLLM initialised its groups")
    return 0
