"""vLLM's own KV sizing on its own layout from a real daemon, against a cold start (issue 24).

A GPU engine's KV cache is what its worker's memory accounting leaves once
the weights are counted. Here vLLM's real sizing code runs on CPU, fed the
memory figures a GPU would report (:mod:`tests.engines.kv_kit`: synthetic
figures patched in at torch's memory queries; there is no GPU): the
worker's ``init_device`` order (``get_external_weight_memory`` from the
loader, ``MemorySnapshot``, ``request_memory``), the weights' load, the
worker's ``determine_available_memory`` (``memory_profiling`` around a
profiling pass whose allocations are synthetic and the same both ways) and
the engine core's KV planning (``get_kv_cache_configs`` from the model's own
attention layers' specs).

Cold: vLLM's ``DefaultModelLoader`` (0 external bytes) and the model's
parameters allocated by the engine. Warm: our loader against a real daemon
(memfd) holding vLLM's own layout of the model, which the engine maps
without allocating. The models are tiny configurations of vLLM's own
``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MixtralForCausalLM`` and
``Qwen2MoeForCausalLM`` (tests/engines/tiny_models.py), loaded for real. Runs
in the ``vllm`` venv (0.33); 0.32's CPU build repacks its weights for its
CPU kernels and is no GPU engine's layout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from tests.engines.enginekit import require_engine

require_engine("vllm")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.model_executor.model_loader import get_model_loader  # noqa: E402
from vllm.utils.mem_utils import MemorySnapshot  # noqa: E402
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout  # noqa: E402
from vllm.v1.core.kv_cache_planning import (  # noqa: E402
    get_global_kv_cache_groups,
    get_kv_cache_configs,
)
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs  # noqa: E402
from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402
from vllm.v1.worker.gpu_worker import Worker  # noqa: E402
from vllm.v1.worker.utils import request_memory  # noqa: E402
from vllm.v1.worker.worker_base import WorkerBase  # noqa: E402

from tests.engines.enginekit import in_daemon_memory  # noqa: E402
from tests.engines.kv_kit import (  # noqa: E402
    Activations,
    SyntheticGpu,
    cold_weight_bytes,
    distinct_parameters,
    layout_bytes,
    rounding_difference,
)
from tests.engines.tiny_models import CONFIGS  # noqa: E402
from tests.engines.vllm_layout_kit import (  # noqa: E402
    engine_config,
    load_ours_and_cold,
    post_processes,
    post_processing,
)

ACTIVATIONS = Activations()


@dataclass(frozen=True)
class KvSize:
    available_bytes: int  # determine_available_memory
    num_blocks: int  # the engine core's KV cache config
    bytes_per_block: int


class ProfilingRunner:
    """The worker's model runner, as far as determine_available_memory uses it: the weights'
    bytes it measured while loading, and a profiling pass (synthetic allocations)."""

    def __init__(self, gpu: SyntheticGpu, weights: int) -> None:
        self.gpu, self.model_memory_usage = gpu, weights

    def profile_run(self, **kwargs: object) -> None:
        ACTIVATIONS.run_on(self.gpu)


def kv_size(config, external: int, gpu: SyntheticGpu, engine_weights: int) -> KvSize:
    """vLLM's worker and engine core sizing the KV cache on ``gpu``: ``external`` the bytes the
    loader reports as held elsewhere, ``engine_weights`` what loading allocates."""
    with gpu.installed(), set_current_vllm_config(config):
        # Worker.init_device, after the groups: the loader's external bytes, the snapshot.
        snapshot = MemorySnapshot(device=torch.device("cuda", 0))
        requested = request_memory(snapshot, config.cache_config, external)
        gpu.allocate(engine_weights)  # Worker.load_model
        worker = object.__new__(Worker)  # its GPU constructor cannot run here
        worker.vllm_config, worker.cache_config = config, config.cache_config
        worker.model_config, worker.parallel_config = config.model_config, config.parallel_config
        worker.init_snapshot, worker.requested_memory = snapshot, requested
        worker.model_runner = ProfilingRunner(gpu, engine_weights)
        available = Worker.determine_available_memory(worker)
    # EngineCore._initialize_kv_caches, with one worker.
    register_all_kvcache_specs(config)
    runner = object.__new__(GPUModelRunner)
    runner.vllm_config, runner.shared_kv_cache_layers = config, {}
    specs = [GPUModelRunner.get_kv_cache_spec(runner)]  # the model's attention layers
    assert specs[0], "the model registered no attention layers"
    supported = [WorkerBase.get_supported_kv_cache_layouts(worker)]
    resolve_kv_cache_layout(config, supported, list(specs[0].values()))
    groups = get_global_kv_cache_groups(config, specs)
    (kv_config,) = get_kv_cache_configs(config, specs, [available], groups)
    per_block = sum(t.size for t in kv_config.kv_cache_tensors) // kv_config.num_blocks
    return KvSize(available, kv_config.num_blocks, per_block)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_kv_cache_on_vllms_own_layout_equals_a_cold_starts(
    kind, tiny_dirs, session_daemons, vllm_groups
) -> None:
    """vLLM's KV cache with weightcache equals a cold start's but for allocation rounding
    (kv_kit: a cold start's 512-byte blocks per parameter against the daemon's 256-byte
    steps), and the worker subtracts exactly what the daemon holds: its allocation of the
    cold model's own parameters. vLLM asks for the external bytes before its snapshot, so
    the snapshot sees the layout built and the checkpoint layout dropped on a first start
    as on a restart. The MoE models compare after vLLM's load_weights on both sides (its
    CPU platform cannot post-process them, even cold: test_vllm_layouts.py)."""
    daemon = session_daemons(tiny_dirs[kind], "--transport", "memfd")
    try:
        with post_processing(post_processes(kind)):
            ours_config, loader, external, model, cold, cold_config = load_ours_and_cold(
                tiny_dirs[kind], {"socket": daemon.socket}, post_process=post_processes(kind)
            )
    finally:
        daemon.terminate()
    layout = loader.layout(ours_config)
    assert layout.attached is not None, layout.reason
    cold_params = distinct_parameters(cold)
    # The layout is the engine's weights: the same parameters as a cold load's.
    planned = {p.name: (p.dtype, list(p.shape)) for p in layout.report.plan.params}
    assert planned == {
        n: (str(p.dtype).removeprefix("torch."), list(p.shape))
        for n, p in cold.named_parameters(remove_duplicate=True)
    }
    # What the worker takes off its budget is what the daemon holds after the attach (its
    # checkpoint layout dropped): the daemon's allocation of exactly those parameters.
    assert external == layout.daemon_bytes_after == layout_bytes(cold_params)
    in_daemon = in_daemon_memory(layout.attached)
    engine_own = cold_weight_bytes(p for p in distinct_parameters(model) if not in_daemon(p))
    assert engine_own == 0

    cold_kv = kv_size(cold_config, get_model_loader(cold_config.load_config)
                      .get_external_weight_memory(cold_config),
                      SyntheticGpu(), cold_weight_bytes(cold_params))  # fmt: skip
    warm_kv = kv_size(ours_config, loader.get_external_weight_memory(ours_config),
                      SyntheticGpu(others=layout.daemon_bytes_after), engine_own)  # fmt: skip
    difference = rounding_difference(cold_params)
    assert warm_kv.available_bytes - cold_kv.available_bytes == difference
    assert 0 <= difference <= 256 * len(cold_params)
    assert warm_kv.bytes_per_block == cold_kv.bytes_per_block
    assert warm_kv.num_blocks - cold_kv.num_blocks in (
        difference // cold_kv.bytes_per_block,
        -(-difference // cold_kv.bytes_per_block),
    )
    print(f"{kind}: cold {cold_kv}, warm {warm_kv}, difference {difference} B, "
          f"external {external} B, checkpoint layout {layout.daemon_bytes_before} B")  # fmt: skip

    # Had the adapter reported the daemon's checkpoint layout (fused, stacked and padded
    # tensors differ) or nothing, vLLM would size another KV cache.
    assert layout.daemon_bytes_before != external
    for wrong in (layout.daemon_bytes_before, 0):
        misreported = kv_size(
            ours_config, wrong, SyntheticGpu(others=layout.daemon_bytes_after), engine_own
        )
        assert misreported.available_bytes - cold_kv.available_bytes != difference


def test_nothing_the_trace_built_outlives_the_kv_budget_call(
    tiny_dirs, session_daemons, vllm_groups, monkeypatch
) -> None:
    """vLLM snapshots the device right after ``get_external_weight_memory`` (issue 41). The
    trace's throwaway model, built like the real one with the device as the default (each
    parameter allocated there before it moves to meta), must be gone by then, every module
    of it: what it held then returns to the device before the snapshot, not during the
    load, and nothing of it pins the allocator's segments for the process's life. Its
    modules hold each other (vLLM's layer registry in the copied config), and with
    torch.compile on, vLLM's compile wrapper registers a bound method of the inner model
    in torch's Dynamo bytecode hooks, a process-wide registry (on an H100 that kept
    1,004 MiB pinned at the snapshot). Automatic collection is off: only the call's own
    collection can free it (on a GPU the allocator's cache then goes back to the driver:
    tests/gpu/test_engine_adapters_gpu.py)."""
    import gc
    import weakref

    from vllm.config import CompilationMode

    from weightcache.integrations.vllm import loader as ours

    built: list[weakref.ref] = []
    original = ours.initialize_model

    def recording(**kwargs):  # noqa: ANN003, ANN202 - vLLM's
        model = original(**kwargs)
        built.extend(weakref.ref(module) for module in model.modules())
        return model

    monkeypatch.setattr(ours, "initialize_model", recording)
    daemon = session_daemons(tiny_dirs["llama"], "--transport", "memfd")
    config = engine_config(tiny_dirs["llama"], 1, load_format="weightcache",
                           model_loader_extra_config={"socket": daemon.socket})  # fmt: skip
    gc.collect()
    # Modules alive before may be the traced model's too: vLLM hands every model the rotary
    # embedding it cached for that configuration, a cold start's as well.
    existing = {id(o) for o in gc.get_objects() if isinstance(o, torch.nn.Module)}
    gc.disable()
    try:
        with set_current_vllm_config(config):
            external = get_model_loader(config.load_config).get_external_weight_memory(config)
        assert external > 0 and built  # the layout's bytes; the trace's model, built
        assert config.compilation_config.mode != CompilationMode.NONE  # torch.compile on
        alive = [m() for m in built if m() is not None]
        assert [type(m).__name__ for m in alive if id(m) not in existing] == []
    finally:
        gc.enable()
        daemon.terminate()
