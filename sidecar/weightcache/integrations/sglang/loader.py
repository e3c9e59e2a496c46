"""The weightcache SGLang model loader: a class SGLang's ``get_model_loader`` instantiates.

``load_model`` first asks this rank's daemon for SGLang's own layout
(:mod:`..layouts`): SGLang's ``load_weights`` and post-processing traced on
a throwaway model built on meta, the daemon building that plan from the
bytes it verified; every parameter of the real model is then mapped from
it, fused ``qkv_proj``/``gate_up_proj``, stacked experts, padded
vocabularies and TP shards included, and mapped/copied bytes are read from
the parameters' own storages. Where no layout can be had it maps the
daemon's checkpoint layout (:mod:`..loading`; what SGLang fuses is copied by
its own weight loaders) or loads from disk: SGLang's own ``DefaultModelLoader``
loads what neither layout can give (a quantized model, parameters no
checkpoint tensor fills, wholly or in part) and any model a load from the daemon left without a
value, with one WARNING saying why. ``preloaded_weights_bytes`` then
tells SGLang's scheduler how many bytes were resident before its memory
baseline, which it adds back through ``ModelRunner.account_preloaded_weights``
(0 after a disk fallback).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping

import torch
from sglang.srt.configs.device_config import DeviceConfig
from sglang.srt.configs.load_config import LoadConfig, LoadFormat
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed import parallel_state
from sglang.srt.model_loader.loader import (
    BaseModelLoader,
    DefaultModelLoader,
    _initialize_model,
    post_load_weights,
)
from sglang.srt.model_loader.utils import set_default_torch_dtype
from torch import nn

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
    attachment,
    expected_configs,
    load_from_daemon,
    local_model_dir,
    still_mapped,
)
from weightcache.integrations.settings import AdapterSettings
from weightcache.integrations.sglang import CONFIG_KEY
from weightcache.integrations.trace import TraceReport, isolated, trace_load
from weightcache.plan import SourceTensor
from weightcache.protocol import ShardSpec

log = logging.getLogger(__name__)

# SGLang refuses online weight updates (update_weights_from_disk/_tensor/_distributed/_ipc)
# for a model any of whose modules carries this attribute, answering with its text and
# serving on. Set on every rank (disk fallback included), so the refusal is rank-uniform.
WEIGHT_UPDATES_REFUSED = (
    "weightcache: this engine's weights are mapped read-only from the weightcache daemon, "
    "which shares them with every engine attached to it; updating them in place is refused. "
    "Serve the new weights from a WeightCache of their own (or restart without the "
    "weightcache loader)"
)
# A speculative draft is not the cache's model: without a WeightCache of its own
# (draft_cache / draft_socket) it loads from disk, whatever `fallback` says.
DRAFT_FROM_DISK = (
    "weightcache: the draft model %s loads from disk (a draft is not the cache's model; "
    "draft_cache or draft_socket maps it from a WeightCache of its own)"
)


class WeightcacheModelLoader(BaseModelLoader):
    """Weights mapped from this rank's weightcache daemon (SGLang ``load_format`` class)."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        if load_config.weight_cache_mode != "off":
            raise ValueError(
                f"--weight-cache-mode {load_config.weight_cache_mode} selects SGLang's own IPC "
                "loader, which would replace weightcache's; use --weight-cache-mode off"
            )
        extra = load_config.model_loader_extra_config or {}
        self.settings = AdapterSettings.from_sources(extra.get(CONFIG_KEY), os.environ)
        self._decided: Attachment | None = None
        self._layout: LayoutDecision | None = None
        # With SGLang's own layout: where every parameter lives after post-processing.
        self.layout_load: LayoutLoad | None = None
        # Why SGLang's own loader loaded the model from disk after a load from the daemon
        # left something without its value (then no daemon bytes are this engine's).
        self.reloaded: str | None = None

    @property
    def preloaded_weights_bytes(self) -> int:
        """What SGLang's pre-load memory sample missed because of this engine's weights,
        read by SGLang's ``ModelRunner.preloaded_weights_bytes`` once ``load_model`` has run
        and added back to that sample: the daemon's bytes on this rank (its own layout's,
        else the checkpoint layout's; 0 after a disk fallback).

        SGLang samples before ``load_model``, where the layout is decided: on a layout's
        first start the daemon builds it (and drops its checkpoint layout) after the
        sample, so the sample held what the daemon held then. The layout's bytes less
        that change (:attr:`LayoutDecision.daemon_bytes_change`) are the bytes resident at
        the sample: the checkpoint layout's on a first start, the layout's once held."""
        if self.reloaded is not None:
            return 0  # SGLang's own allocations hold the weights, as on a cold start
        layout = self._layout
        if layout is not None and layout.attached is not None:
            return max(0, layout.layout_bytes - layout.daemon_bytes_change)
        return 0 if self._decided is None else self._decided.preloaded_weights_bytes

    def download_model(self, model_config: ModelConfig) -> None:
        local_model_dir(model_config.model_path)  # nothing to download: the daemon's directory

    def load_model(self, *, model_config: ModelConfig, device_config: DeviceConfig) -> nn.Module:
        if not getattr(model_config, "is_draft_model", False):
            layout = self.layout(model_config, device_config)
            if layout.disk is not None:
                return self._from_disk(model_config, device_config)
            if layout.attached is not None:
                return self._load_layout(model_config, device_config, layout)
        decided = self.attachment(model_config, device_config)
        if decided.attached is None:
            return self._from_disk(model_config, device_config)
        device = _device(device_config)
        with set_default_torch_dtype(model_config.dtype), device, meta_parameters():
            model = _initialize_model(model_config, self.load_config, None)
        tensors = decided.attached.tensors
        # With tensor parallelism the daemon holds this rank's shards, which
        # SGLang's weight loaders (written for whole checkpoint tensors) would
        # shard again: only same-shaped parameters can be served then.
        tp_size = _tp_size()
        try:
            with device:
                report = load_from_daemon(
                    model,
                    tensors,
                    device,
                    engine_load_weights=model.load_weights if tp_size == 1 else None,
                )
        except IncompleteLoad as exc:
            return self._instead_from_disk(model_config, device_config, str(exc))
        DefaultModelLoader.postprocess_weights(model, device)
        if not report.copied:
            post_load_weights(model)  # model.load_weights runs it when it was called
        replaced = still_mapped(model, report, tensors)
        if replaced:
            log.warning(
                "weightcache: SGLang's post-processing replaced %d daemon-mapped tensor(s) with "
                "its own copies (%s); they occupy engine memory twice",
                len(replaced),
                ", ".join(replaced[:5]),
            )
        log.info(
            "weightcache: %d tensor(s) (%d bytes) mapped zero-copy over %s from daemon pid %d; "
            "%d tensor(s) (%d bytes) copied into SGLang's own layout (fused parameters)",
            len(report.mapped),
            report.mapped_bytes,
            decided.attached.transport,
            decided.attached.daemon_pid,
            len(report.copied),
            report.copied_bytes,
        )
        model._derived_weight_cache_error = WEIGHT_UPDATES_REFUSED
        return model.eval()

    def _load_layout(
        self, model_config: ModelConfig, device_config: DeviceConfig, layout: LayoutDecision
    ) -> nn.Module:
        device = _device(device_config)
        with set_default_torch_dtype(model_config.dtype), device, meta_parameters():
            model = _initialize_model(model_config, self.load_config, None)
        with device:
            own = map_engine_layout(
                model, layout, device, engine_load_weights=model.load_weights,
                checkpoint_files=checkpoint_files(local_model_dir(model_config.model_path)),
            )  # fmt: skip
        DefaultModelLoader.postprocess_weights(model, device)
        missing = unfilled(model, layout.report)
        if missing:  # never served: SGLang's own loader does it from disk
            return self._instead_from_disk(model_config, device_config,
                                           describe_unfilled(missing))  # fmt: skip
        self.layout_load = load = storage_report(model, layout.attached, own)
        attached = layout.attached
        log.info(
            "weightcache: SGLang's own layout (plan %s) over %s from daemon pid %d: %d "
            "parameter(s) (%d bytes) mapped zero-copy, %d (%d bytes) in engine memory%s",
            attached.config.plan[:12], attached.transport, attached.daemon_pid,
            len(load.mapped), load.mapped_bytes, len(load.copied), load.copied_bytes,
            f": {describe_copied(load.copied)}" if load.copied else "",
        )  # fmt: skip
        model._derived_weight_cache_error = WEIGHT_UPDATES_REFUSED
        return model.eval()

    def _from_disk(self, model_config: ModelConfig, device_config: DeviceConfig) -> nn.Module:
        model = self._disk_loader().load_model(
            model_config=model_config, device_config=device_config
        )
        model._derived_weight_cache_error = WEIGHT_UPDATES_REFUSED
        return model

    def _instead_from_disk(
        self, model_config: ModelConfig, device_config: DeviceConfig, why: str
    ) -> nn.Module:
        """A load from the daemon that left ``why``: SGLang's default loader loads the model
        from disk, and no daemon bytes count as this engine's. With ``fallback`` off, the
        load fails saying why."""
        if not self.settings.fallback:
            raise NotServable(f"weightcache: the model loaded from the daemon is incomplete: "
                              f"{why} (fallback is off)")  # fmt: skip
        log.warning(
            "weightcache: the model loaded from the daemon is incomplete, so SGLang's default "
            "loader loads it from disk instead: %s", why,
        )  # fmt: skip
        self.reloaded = why
        return self._from_disk(model_config, device_config)

    def layout(self, model_config: ModelConfig, device_config: DeviceConfig) -> LayoutDecision:
        """The target model's own layout from this rank's daemon, or why not (decided once
        per process); a model neither layout can give is loaded from disk (``disk``)."""
        disk = _from_disk_only(model_config)
        if disk is not None:
            self._layout = from_disk(self.settings, "", disk)
            return self._layout
        socket, candidates = self._target(
            model_config, device_config, self.settings, own_layout=True
        )
        device = _device(device_config)
        self._layout = engine_layout(
            self.settings, socket, candidates, lambda: self._trace(model_config, device)
        )
        return self._layout

    def _trace(self, model_config: ModelConfig, device: torch.device) -> TraceReport:
        sources = checkpoint_sources(read_checkpoint(local_model_dir(model_config.model_path)))
        return trace_sglang_load(model_config, self.load_config, device, sources)

    def attachment(self, model_config: ModelConfig, device_config: DeviceConfig) -> Attachment:
        """This rank's attach decision for the target or a speculative draft (made once
        per process, then cached); load_model's first step, after which
        ``preloaded_weights_bytes`` holds its bytes."""
        settings = self.settings
        if getattr(model_config, "is_draft_model", False):
            settings = self.settings.for_draft()
            if settings is None:
                log.info(DRAFT_FROM_DISK, model_config.model_path)
                self._decided = Attachment("", None, "a draft model without a cache of its own")
                return self._decided
        disk = _from_disk_only(model_config)
        if disk is not None:
            self._decided = Attachment("", None, from_disk(settings, "", disk).disk)
            return self._decided
        socket, candidates = self._target(model_config, device_config, settings)
        self._decided = attachment(settings, socket, candidates)
        return self._decided

    def _target(
        self, model_config: ModelConfig, device_config: DeviceConfig, settings: AdapterSettings,
        *, own_layout: bool = False,
    ) -> tuple[str, list]:  # fmt: skip
        """This rank's daemon socket and the configs it may hold (for SGLang's
        ``own_layout``: :func:`expected_configs`)."""
        device = _device(device_config)
        tp_size = _tp_size()
        tp_rank = self.load_config.tp_rank or 0
        target = EngineTarget(
            model_dir=local_model_dir(model_config.model_path),
            dtype=model_config.dtype,
            device=device,
            shard=ShardSpec(
                tp_size=tp_size,
                tp_rank=tp_rank,
                plan=settings.shard_plan or ("llama" if tp_size > 1 else None),
            ),
            revision=model_config.revision,
        )
        uuid = gpu_uuid(device.index or 0) if device.type == "cuda" else None
        return settings.socket_for(uuid, tp_size), expected_configs(target, own_layout=own_layout)

    def _disk_loader(self) -> DefaultModelLoader:
        return DefaultModelLoader(default_load_config(self.load_config))


def _from_disk_only(model_config: ModelConfig) -> str | None:
    """Why weightcache cannot give SGLang this model's weights in their final form (its
    default loader then loads it from disk), or None."""
    if model_config.quantization is not None:
        return (
            f"quantization {model_config.quantization!r}: its post-processing re-lays the "
            "weights into SGLang's own memory"
        )
    return None


def default_load_config(load_config: LoadConfig) -> LoadConfig:
    """``load_config`` for SGLang's own ``DefaultModelLoader``: its default format, none of
    our extra config (which it refuses by name)."""
    return dataclasses.replace(
        load_config, load_format=LoadFormat.AUTO, model_loader_extra_config={}
    )


def trace_sglang_load(
    model_config: ModelConfig,
    load_config: LoadConfig,
    device: torch.device,
    sources: Mapping[str, SourceTensor],
) -> TraceReport:
    """SGLang's loading and post-processing of a throwaway model built on meta, run against
    ``sources`` (the checkpoint's tensor table), as a plan: what the loader asks its daemon
    for, and what ``tools/plan_fixtures.py`` records as committed fixtures."""
    from sglang.srt.layers.rotary_embedding import factory

    # The real model is built after this one, from SGLang's rotary cache (``get_rope``
    # hands one module per configuration to every model): it must find it as a cold start
    # would (trace.isolated).
    with isolated(caches=[factory._ROPE_DICT]):
        with set_default_torch_dtype(model_config.dtype), device, meta_parameters():
            twin = _initialize_model(model_config, load_config, None)
        return trace_load(
            twin, sources,
            lambda weights: DefaultModelLoader.load_weights_only(twin, weights, device),
            post_process=lambda: DefaultModelLoader.postprocess_weights(twin, device),
        )  # fmt: skip


def _device(device_config: DeviceConfig) -> torch.device:
    device = torch.device(device_config.device)
    if device.type == "cuda" and device.index is None:
        index = device_config.gpu_id if device_config.gpu_id >= 0 else torch.cuda.current_device()
        device = torch.device("cuda", index)
    return device


def _tp_size() -> int:
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_world_size()
    return 1
