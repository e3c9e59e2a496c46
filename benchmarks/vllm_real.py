"""Real vLLM on a GPU through weightcache, against vLLM's own cold start (issues 35, 41).

Run on the GPU machine with its plain ``python3`` (no project install, no
network), after ``tools/offline_env.py`` installed the wheels of
``benchmarks/vllm_env.txt`` into ``--site`` (benchmarks/README.md,
"Running on an offline GPU machine"):

    python3 benchmarks/vllm_real.py --site /tmp/site            # every phase not done
    python3 benchmarks/vllm_real.py --site /tmp/site --phase cold

State lives under ``--work`` (default /tmp/wc-vllm: the checkpoint, the
daemon's socket and pid, logs, each start's outputs, ``result.json``), so
phases spread over several calls while the machine stays warm. Each call
stops starting engines when the next one would not finish by
``--deadline-s`` (default 540 s, for 600 s calls) and exits 3: call again,
it goes on where it stopped (``--phase all`` skips finished phases). It
exits 0 once the requested phases are done, 1 on a failure (recorded in the
result with the log's tail). After every call the result (and a digest of
the logs) is written to ``--out`` (default ``$OUT/vllm-real.json``
where the device tool sets ``OUT``); it belongs in
``benchmarks/results/<gpu>-vllm-real.json`` (``h100``, ``h200``: its
``machine.gpu`` names it).

Phases, in order, with their time on an H100 (2026-12-06):

- ``env`` (~30 s): GPU, driver, CUDA, the torch on each side, vLLM; vLLM's run
  path imported in the engine's environment; the weightcache plugin found
  through vLLM's own entry points; Python's asserts on (vLLM's memory
  profiler checks with one: a run with them off proves nothing); the site
  byte-compiled once (``install`` writes no bytecode and the GPU machine sets
  PYTHONDONTWRITEBYTECODE: every start compiled vLLM's sources again, 10-20 s).
- ``checkpoint`` (~1 min): a random Llama-3-8B-shaped bf16 checkpoint
  (the published names and shapes, ``config.json``, N(0, 0.02) weights and
  unit norms, 4 safetensors shards, 16.06 GB) under ``WORK/model``.
- ``cold`` (~5.5 min with ``--restarts 2``): vLLM's default loader, no daemon
  on the GPU: a first start (empty torch.compile cache; not counted),
  ``--restarts`` starts with CUDA graphs (the default), two eager and
  deterministic (``VLLM_BATCH_INVARIANT=1``: the second shows the mode is
  deterministic on this GPU), then one of each at ``--tight-utilization``
  (0.95).
- ``warm`` (~4 min): the daemon over ``vmm_fd``, ``--load-format
  weightcache``: a first start (the daemon builds vLLM's layout; not
  counted), ``--restarts`` with graphs, one eager and deterministic, one of
  each at the tight utilization.
- ``kill9`` (~1.5 min): a weightcache engine generating in a loop
  (deterministic: every batch must equal the first); ``kill -9`` of the
  daemon; the engine keeps serving; a new daemon re-adopts the engine's
  weights; a fresh engine attaches to it.
- ``report`` (seconds): outputs compared (deterministic starts bit for bit;
  graphs within the cold-vs-cold floor), vLLM's KV blocks warm vs cold per
  mode explained term by term, the device's use against a cold start plus
  the daemon's own context, restart figures. Computed after every call.

Every start is a fresh ``vllm.LLM`` in a process of its own (TP 1: one GPU),
at the same ``--gpu-memory-utilization`` both ways, and records: process
start to ready and to the first token; vLLM's own ``num_gpu_blocks`` and the
worker's memory figures (``collective_rpc``); the device bytes its load took
(free memory around ``load_model`` and around the budget call, where
weightcache attaches) and, with weightcache, the
adapter's own storage report (parameters mapped vs in engine memory); greedy
outputs (token ids and top-``--logprobs`` logprobs, the prompt's and the
generated ones) of a fixed set of token-id prompts; nvidia-smi's per-process
memory. The two arms differ only
in the load format. Both run with ``enable_prefix_caching=False`` (a
repeated prompt would otherwise be served from cached KV blocks by other
kernels, and the kill -9 loop repeats its prompts) and
``VLLM_USE_FLASHINFER_SAMPLER=0`` (FlashInfer is not carried; greedy
decoding samples nothing; see benchmarks/vllm_env.txt).

No tokenizer: the engines run with ``skip_tokenizer_init`` and token-id
prompts. A random-weight model's text means nothing; token ids and
logprobs are what two loads are compared by; and a tokenizer of
Llama-3's 128,256 tokens would have to be made up here, adding a part
that is the same in both arms and no part of loading.

``--tp 2`` (issue 45; benchmarks/README.md, "Real vLLM at TP=2"): the same phases at
``tensor_parallel_size=2`` with one daemon per GPU (rank r's shards on ``cuda:r``, its
socket named by the GPU's UUID under ``socket_dir``/``cache``, where the adapter's rank r
looks), every rank's figures recorded, an uneven start per arm (the last rank holds an
extra buffer: correct-then-MIN against MIN-then-correct), kill -9 of the last rank's
daemon; state under /tmp/wc-vllm-tp2, the result ``<gpu>x2-vllm-tp2-real.json``. The pure
parts are in ``benchmarks/vllm_tp2_real.py``.

The engine processes run on the offline-installed torch 2.14 and vLLM
(``--site`` first on PYTHONPATH, its NCCL on LD_LIBRARY_PATH); the daemon
and the checkpoint writer run on the image's own torch (2.11 on the H200
machine), as a sidecar image and an engine image would, with only msgspec
taken from ``--site``. vLLM finds weightcache through the same
``vllm.general_plugins`` entry point pip would register (a stub
dist-info under ``WORK/plugin``), beside a second plugin (this file,
imported as ``wcbench_probe``) that records the load and adds the
``wcbench_figures`` worker method.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a file on the GPU machine (no install of this project)
    sys.path.insert(0, str(REPO))

from benchmarks import engine_real, vllm_tp2_real  # noqa: E402
from benchmarks.engine_real import (  # noqa: E402, F401 - the harness's names, tests use them
    KV_PAIRS,
    LLAMA3_8B,
    PHASES,
    PROBE_MODULE,
    SHARD_BYTES,
    Incomplete,
    StartPlan,
    compare_outputs,
    llama_tensors,
    nvidia_smi_apps,
    outputs_digest,
    parse_compute_apps,
    prompt_set,
    read_events,
    resolve_phases,
    schedule,
    serve,
    shard_tensors,
    write_json,
)

SCHEMA = "weightcache-vllm-real/1"
RESULT_NAME = "vllm-real.json"
LOG_DIGEST_NAME = "vllm-real-logs.txt"
MiB = 1 << 20
CLI = engine_real.Cli(
    prog="vllm_real", description=__doc__.split("\n\n")[0], result_name=RESULT_NAME,
    work=Path("/tmp/wc-vllm"), utilization_flag="--gpu-memory-utilization",
    utilization=0.9, tight_utilization=0.95, tp_sizes=(1, 2),
)  # fmt: skip
# The uneven TP case's extra buffer, handed from the driver to its worker processes
# (they inherit its environment): JSON {"rank", "bytes", "arm"}.
UNEVEN_ENV = "WCBENCH_UNEVEN"
DETERMINISTIC_METHOD = "VLLM_BATCH_INVARIANT=1, eager: bit-equal required"
GRAPHS_METHOD = "vLLM's defaults (not deterministic): within the cold-vs-cold floor"


# =========================================================================== pure parts


def parse_args(argv: Sequence[str] | None, environ: Mapping[str, str]):  # noqa: ANN201
    """The harness's arguments (engine_real.parse_args with vLLM's names and defaults)."""
    return engine_real.parse_args(CLI, argv, environ)


def default_out(environ: Mapping[str, str]) -> Path:
    """``$OUT/vllm-real.json`` where the device tool sets OUT, else the repository's."""
    return engine_real.default_out(environ, RESULT_NAME)


def new_result() -> dict:
    return engine_real.new_result(SCHEMA)


def check_result(doc: Mapping) -> list[str]:
    """What is wrong with a result document's shape (empty: nothing)."""
    return engine_real.check_result(doc, SCHEMA)


def external_weight_bytes(figures: Mapping) -> int:
    """What vLLM took off the worker's budget for weights held outside it
    (``get_external_weight_memory``): the utilization's bytes less the requested ones."""
    total = figures["init_snapshot"]["total_memory"]
    # vLLM's request_memory: math.ceil(total * utilization), less the external bytes.
    return math.ceil(total * figures["gpu_memory_utilization"]) - figures["requested_memory"]


def explain_kv(cold: Mapping, warm: Mapping) -> dict:
    """vLLM's KV cache warm (weightcache) against cold (its default loader), term by term.

    vLLM 0.33's worker sizes the cache as ``requested - (total_consumed +
    transient peak) - CUDA-graph estimate`` (``determine_available_memory``),
    where ``requested`` is ``ceil(total * utilization)`` less the external
    weight bytes and ``total_consumed`` is the device's free memory consumed
    from its snapshot to the end of profiling (the load included). The
    difference warm - cold therefore splits into: the external bytes taken off
    the budget, the bytes the cold load took, the bytes the warm load (the
    attach) took, everything else consumed, the transient peak and the graph
    estimate; ``residual`` is what those leave unexplained (0 when the
    figures obey that formula)."""

    def side(f: Mapping) -> dict:
        cg_applied = f["cudagraph_memory_estimate"] if f["cudagraph_estimate_applied"] else 0
        load = f["load"]["device_bytes"]
        return {
            "external": external_weight_bytes(f),
            "load": load,
            "other": f["total_consumed"] - load,
            "transient": f["peak_activation_memory"] - cg_applied,
            "cudagraph": cg_applied,
            "available": f["available_kv_cache_memory_bytes"],
            "blocks": f["num_gpu_blocks"],
        }

    c, w = side(cold), side(warm)
    per_block = warm["bytes_per_block"]
    if per_block != cold["bytes_per_block"]:
        raise ValueError(f"blocks differ in size: {cold['bytes_per_block']} cold, {per_block} warm")
    terms = {
        "external_weights_off_the_budget": -(w["external"] - c["external"]),
        "weights_the_cold_load_allocated": c["load"],
        "device_bytes_of_the_warm_load": -w["load"],
        "other_consumption": -(w["other"] - c["other"]),
        "transient_peak": -(w["transient"] - c["transient"]),
        "cudagraph_estimate": -(w["cudagraph"] - c["cudagraph"]),
    }
    difference = w["available"] - c["available"]
    residual = difference - sum(terms.values())
    return {
        "num_gpu_blocks": {"cold": c["blocks"], "warm": w["blocks"],
                           "difference": w["blocks"] - c["blocks"]},
        "bytes_per_block": per_block,
        "available_kv_bytes": {"cold": c["available"], "warm": w["available"],
                               "difference": difference},
        "terms_bytes": terms,
        "terms_mib": {k: round(v / MiB, 3) for k, v in terms.items()},
        "residual_bytes": residual,
        "residual_mib": round(residual / MiB, 3),
        "difference_mib": round(difference / MiB, 3),
        "difference_in_blocks": round(difference / per_block, 3),
        "external_minus_cold_load_bytes": w["external"] - c["load"],
    }  # fmt: skip


_LOG_PATTERNS: dict[str, tuple[str, Callable[[re.Match], object]]] = {
    "model_loading": (r"Model loading took ([\d.]+) GiB memory and ([\d.]+) seconds",
                      lambda m: {"gib": float(m[1]), "seconds": float(m[2])}),
    "loading_weights_s": (r"Loading weights took ([\d.]+) seconds", lambda m: float(m[1])),
    "torch_compile_s": (r"torch\.compile took ([\d.]+) s in total", lambda m: float(m[1])),
    "graph_capture": (r"Graph capturing finished in (\d+) secs, took ([\d.]+) GiB",
                      lambda m: {"seconds": int(m[1]), "gib": float(m[2])}),
    "init_engine_s": (r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
                      lambda m: float(m[1])),
    "available_kv_gib": (r"Available KV cache memory: ([\d.]+) GiB", lambda m: float(m[1])),
    "kv_cache_tokens": (r"GPU KV cache size: ([\d,]+) tokens",
                        lambda m: int(m[1].replace(",", ""))),
    "weightcache_layout": (
        r"weightcache: vLLM's own layout \(plan (\w+)\) over (\w+) from daemon pid (\d+): "
        r"(\d+) parameter\(s\) \((\d+) bytes\) mapped zero-copy, (\d+) \((\d+) bytes\) in "
        r"engine memory",
        lambda m: {"plan": m[1], "transport": m[2], "daemon_pid": int(m[3]),
                   "mapped": int(m[4]), "mapped_bytes": int(m[5]),
                   "copied": int(m[6]), "copied_bytes": int(m[7])}),
    "compiled_graphs": (r"Compiling a graph for compile range", lambda m: True),
    "compile_cache_hit": (r"Directly load the compiled graph", lambda m: True),
    "model_runner_v1_fallback": (r"Model Runner V2 does not yet support (.*?); using the V1",
                                 lambda m: m[1]),
    **engine_real.ADAPTER_LOG_PATTERNS,
}  # fmt: skip


def parse_engine_log(text: str) -> dict:
    """What vLLM and the adapter logged about a start: the first match of each pattern
    (absent keys: not logged)."""
    return engine_real.parse_log(text, _LOG_PATTERNS)


def build_report(doc: Mapping) -> dict:
    """Outputs, KV and restart figures from the starts recorded so far."""
    report = engine_real.engine_report(doc, (DETERMINISTIC_METHOD, GRAPHS_METHOD), explain_kv,
                                       device_use)  # fmt: skip
    ok = [s for s in doc["starts"] if s.get("status") == "ok"]
    report["num_gpu_blocks"] = {s["run"]: s["figures"]["num_gpu_blocks"] for s in ok}
    report["weights"] = {
        s["run"]: {"load_device_bytes": s["figures"]["load"]["device_bytes"],
                   "budget_call_device_bytes": s["figures"].get("budget", {}).get("device_bytes"),
                   "mapped": s["figures"]["load"].get("mapped"),
                   "mapped_bytes": s["figures"]["load"].get("mapped_bytes"),
                   "copied": s["figures"]["load"].get("copied"),
                   "copied_bytes": s["figures"]["load"].get("copied_bytes")}
        for s in ok
    }  # fmt: skip
    tp = (doc.get("settings") or {}).get("tensor_parallel_size", 1)
    if tp > 1:
        report["tp"] = vllm_tp2_real.tp_report(doc, tp, explain_kv, device_use)
    return report


def device_use(cold: Mapping, warm: Mapping, daemon_mib: int | None) -> dict:
    """The device as a whole, warm (the engine and its daemon) against cold (the engine
    alone), once each engine is ready: warm may exceed cold by the daemon's own context
    (its CUDA context and allocator, what it holds beyond the weights' allocation: its
    process's memory less the bytes the engine's budget took for the weights), never
    more; and the warm engine's KV blocks are never more than cold's."""
    used = warm["device_used_bytes"] - cold["device_used_bytes"]
    out = {"device_used_warm_minus_cold_mib": round(used / MiB, 3),
           "warm_blocks_at_most_cold": warm["num_gpu_blocks"] <= cold["num_gpu_blocks"]}
    if daemon_mib is not None:
        context = daemon_mib - external_weight_bytes(warm) / MiB
        out["daemon_context_mib"] = round(context, 3)
        out["warm_device_use_at_most_cold_plus_daemon_context"] = used / MiB <= context
    return out


# =========================================================================== the probe plugin
# Imported in every vLLM process as ``wcbench_probe`` (a stub dist-info's
# vllm.general_plugins entry point): it records what load_model did to the
# device and gives the worker a ``wcbench_figures`` method for collective_rpc.

_PROBE: dict = {}
_DEPTH = [0]
# The uneven case's buffer, held for the process's life (never freed: vLLM measures after).
_HELD: list = []


# The worker's start, in vLLM 0.33's order (EngineCore.__init__ and its KV set-up): each
# stamped by the probe (engine_real.timeline names the gaps between them).
WORKER_PHASES = ("init_device", "load_model", "determine_available_memory",
                 "initialize_from_config", "compile_or_warm_up_model")  # fmt: skip


def probe_plugin() -> None:
    """vLLM's plugin hook (every vLLM process runs it once its imports are done): stamp the
    process's start and the worker's phases, wrap the loaders' load_model, add the figures
    method."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.v1.worker.gpu_worker import Worker
    from vllm.v1.worker.worker_base import WorkerBase

    stamps = _PROBE.setdefault("stamps", {})
    now = time.time()
    stamps.setdefault("process_started", [_process_started(), now])
    stamps.setdefault("plugin_loaded", [now, now])
    for name in WORKER_PHASES:
        original = Worker.__dict__.get(name)
        if original is not None and not getattr(original, "wcbench", False):
            setattr(Worker, name, _stamped(name, original))

    classes: list[type] = [BaseModelLoader]
    try:
        from weightcache.integrations.vllm.loader import WeightcacheModelLoader
    except ImportError as exc:  # recorded: the cold arm runs without it
        _PROBE["weightcache_import_error"] = repr(exc)
    else:
        classes.append(WeightcacheModelLoader)
    for cls in classes:
        for name, wrap in (("load_model", _recording), ("get_external_weight_memory", _budget)):
            original = cls.__dict__.get(name)
            if original is not None and not getattr(original, "wcbench", False):
                setattr(cls, name, wrap(original))
    WorkerBase.wcbench_figures = _worker_figures


def _stamped(name: str, original: Callable) -> Callable:
    """``original`` recording the wall-clock start and end of its first call."""

    def stamped(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - vLLM's
        started = time.time()
        try:
            return original(self, *args, **kwargs)
        finally:
            _PROBE["stamps"].setdefault(name, [started, time.time()])

    stamped.wcbench = True
    return stamped


def _process_started() -> float:
    """This process's creation, wall clock (its start time in /proc/self/stat, in clock
    ticks since boot)."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime "))  # fmt: skip
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _budget(original: Callable) -> Callable:
    """Record what the worker's budget call did to the device: with weightcache it attaches
    (maps the layout: its page tables) and, on a daemon's first engine, has it build the
    layout; the device's free memory shows the daemon's allocations too."""

    def get_external_weight_memory(self, vllm_config):  # noqa: ANN001, ANN202 - vLLM's
        import torch

        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        started = time.perf_counter()
        external = original(self, vllm_config)
        torch.cuda.synchronize()
        _PROBE.setdefault("budget", {
            "seconds": time.perf_counter() - started,
            "device_bytes": free_before - torch.cuda.mem_get_info()[0],
            "external_bytes": external,
        })  # fmt: skip
        # The uneven case, warm: this rank holds the extra buffer before vLLM's snapshot, as
        # a daemon holding more would, and counts it with the weights' external bytes.
        return external + _uneven("warm")

    get_external_weight_memory.wcbench = True
    return get_external_weight_memory


def _recording(original: Callable) -> Callable:
    def load_model(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - vLLM's
        import torch

        _DEPTH[0] += 1
        outer = _DEPTH[0] == 1
        try:
            if outer:
                torch.cuda.synchronize()
                free_before = torch.cuda.mem_get_info()[0]
                allocated_before = torch.cuda.memory_allocated()
                started = time.perf_counter()
            model = original(self, *args, **kwargs)
            if outer:
                # The uneven case, cold: the extra buffer is this rank's own allocation during
                # its load (after vLLM's snapshot), as more weights loaded by itself would be.
                _uneven("cold")
                torch.cuda.synchronize()
                seconds = time.perf_counter() - started
                free_after = torch.cuda.mem_get_info()[0]
                _PROBE["load"] = {
                    "loader": type(self).__name__,
                    "seconds": seconds,
                    "device_bytes": free_before - free_after,
                    "torch_allocated_bytes": torch.cuda.memory_allocated() - allocated_before,
                    **_adapter_report(self, args, kwargs),
                }
            return model
        finally:
            _DEPTH[0] -= 1

    load_model.wcbench = True
    return load_model


def _uneven(arm: str) -> int:
    """The uneven case's extra buffer (``WCBENCH_UNEVEN``): allocated once, on the rank it
    names, in the arm it names (warm: at the budget call, before vLLM's snapshot; cold: in
    the load); its bytes on that rank, else 0."""
    spec = json.loads(os.environ.get(UNEVEN_ENV) or "null")
    if not spec or spec["arm"] != arm or _tp_rank() != spec["rank"]:
        return 0
    if "uneven" not in _PROBE:
        import torch

        _HELD.append(torch.zeros(spec["bytes"], dtype=torch.uint8,
                                 device=torch.cuda.current_device()))  # fmt: skip
        torch.cuda.synchronize()
        _PROBE["uneven"] = {**spec, "allocated_at": "budget" if arm == "warm" else "load"}
    return spec["bytes"]


def _tp_rank() -> int:
    """This worker's tensor-parallel rank (0 before vLLM's groups exist: TP 1)."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank()
    return 0


def _adapter_report(loader: object, args: tuple, kwargs: dict) -> dict:
    """The weightcache loader's own storage report of this load (nothing for vLLM's)."""
    layout_load = getattr(loader, "layout_load", None)
    if layout_load is not None:
        report = {"path": "engine layout", "mapped": len(layout_load.mapped),
                  "mapped_bytes": layout_load.mapped_bytes, "copied": len(layout_load.copied),
                  "copied_bytes": layout_load.copied_bytes,
                  "copied_why": dict(list(layout_load.copied.items())[:10])}  # fmt: skip
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        try:
            decision = loader.layout(vllm_config)
        except Exception as exc:  # noqa: BLE001 - recorded, the load itself succeeded
            report["decision_error"] = repr(exc)
        else:
            attached = decision.attached
            report.update({
                "layout_bytes": decision.layout_bytes,
                "daemon_bytes_change": decision.daemon_bytes_change,
                "transport": getattr(attached, "transport", None),
                "daemon_pid": getattr(attached, "daemon_pid", None),
                "reason": decision.reason,
            })  # fmt: skip
        return report
    checkpoint = getattr(loader, "report", None)
    if checkpoint is not None:
        return {"path": "checkpoint layout", "mapped": len(checkpoint.mapped),
                "mapped_bytes": checkpoint.mapped_bytes, "copied": len(checkpoint.copied),
                "copied_bytes": checkpoint.copied_bytes}  # fmt: skip
    return {}


def _worker_figures(worker: object) -> dict:
    """The worker's memory figures after initialisation (runs in the worker process)."""
    import torch
    import vllm.envs as envs

    runner = worker.model_runner
    snapshot = worker.init_snapshot
    kv_config = runner.kv_cache_config
    per_block = sum(group.kv_cache_spec.page_size_bytes * len(group.layer_names)
                    for group in kv_config.kv_cache_groups)  # fmt: skip
    free, total = torch.cuda.mem_get_info()
    tp_fields = {}
    if worker.parallel_config.tensor_parallel_size > 1:
        device = torch.cuda.current_device()
        tp_fields = {"tp_rank": _tp_rank(), "device_index": device,
                     "gpu_uuid": str(torch.cuda.get_device_properties(device).uuid),
                     "uneven": _PROBE.get("uneven")}  # fmt: skip
    return {
        **tp_fields,
        "runner": f"{type(runner).__module__}.{type(runner).__qualname__}",
        "gpu_memory_utilization": worker.cache_config.gpu_memory_utilization,
        "init_snapshot": {k: getattr(snapshot, k) for k in (
            "free_memory", "total_memory", "cuda_memory", "torch_memory", "non_torch_memory")},
        "requested_memory": worker.requested_memory,
        "model_memory_usage": runner.model_memory_usage,
        "total_consumed": worker.total_consumed,
        "peak_activation_memory": worker.peak_activation_memory,
        "cudagraph_memory_estimate": worker.cudagraph_memory_estimate,
        "cudagraph_estimate_applied": bool(envs.VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS),
        "available_kv_cache_memory_bytes": worker.available_kv_cache_memory_bytes,
        "num_gpu_blocks": kv_config.num_blocks,
        "bytes_per_block": per_block,
        "device_free_bytes": free,
        "device_used_bytes": total - free,
        "torch_reserved_bytes": torch.cuda.memory_reserved(),
        "torch_allocated_bytes": torch.cuda.memory_allocated(),
        "load": dict(_PROBE.get("load", {})),
        "budget": dict(_PROBE.get("budget", {})),
        "stamps": dict(_PROBE.get("stamps", {})),
        "probe": {k: v for k, v in _PROBE.items() if k not in ("load", "budget", "stamps")},
    }  # fmt: skip


# =========================================================================== the engine process


def engine_main(spec_path: Path) -> int:
    """One vLLM start (``_engine SPEC``): the timeline, the outputs, the worker's figures;
    with ``serve`` set, generate the prompt set in a loop until ``stop`` exists."""
    spec = json.loads(spec_path.read_text())
    tp = spec.get("tp", 1)
    if spec.get("uneven"):
        os.environ[UNEVEN_ENV] = json.dumps(spec["uneven"])  # the workers inherit it
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    times = {"imported": time.time()}
    kwargs = dict(model=spec["model"], dtype="bfloat16", tensor_parallel_size=tp,
                  gpu_memory_utilization=spec["utilization"],
                  skip_tokenizer_init=True, enable_prefix_caching=False, seed=0,
                  enforce_eager=spec["eager"])  # fmt: skip
    if spec["arm"] == "warm":
        kwargs["load_format"] = "weightcache"
        # TP > 1: each rank finds its own daemon's socket by its GPU's UUID under
        # socket_dir/cache, as an unmodified vLLM on a node does (one socket names one daemon).
        where = {"socket": spec["socket"]} if tp == 1 else {
            "socket_dir": spec["socket_dir"], "cache": spec["cache"]}
        kwargs["model_loader_extra_config"] = {
            **where, "transports": ["vmm_fd"], "fallback": False,
        }  # fmt: skip
    llm = LLM(**kwargs)
    times["ready"] = time.time()
    greedy1 = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=[128000, 1, 2, 3])], greedy1, use_tqdm=False)
    times["first_token"] = time.time()
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True,
                            logprobs=spec["logprobs"], prompt_logprobs=spec["logprobs"],
                            detokenize=False)  # fmt: skip

    def generate() -> list[dict]:
        return [_output(r) for r in llm.generate(prompts, params, use_tqdm=False)]

    outputs = generate()
    ranks = llm.collective_rpc("wcbench_figures")  # one per worker, in rank order
    if tp == 1:
        (figures,) = ranks
    else:
        # Rank 0's figures at the top (what the TP 1 report reads), every rank's beside.
        figures = {**ranks[0], "ranks": ranks,
                   "compute_apps_by_gpu": engine_real.parse_compute_apps_by_gpu(
                       engine_real.nvidia_smi_apps_by_gpu())}  # fmt: skip
    figures["num_gpu_blocks_engine"] = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    engine_real.finish_start(spec, times, outputs, figures, generate)
    return 0


def _output(request: object) -> dict:
    completion = request.outputs[0]
    # The prompt's first token has no logprob (nothing precedes it): None, left out.
    prompt = [p for p in (request.prompt_logprobs or []) if p is not None]
    return {"token_ids": list(completion.token_ids),
            "logprobs": [_top(position) for position in completion.logprobs],
            "prompt_logprobs": [_top(position) for position in prompt]}  # fmt: skip


def _top(position: Mapping) -> list[list]:
    return sorted(([int(t), float(lp.logprob)] for t, lp in position.items()),
                  key=lambda e: (-e[1], e[0]))  # fmt: skip


def envcheck_main() -> int:
    """Versions and vLLM's run path in the engine's environment (``_envcheck``), as JSON."""
    import vllm

    report = engine_real.envcheck("vllm", "vllm.general_plugins", (
        "vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.worker.gpu_worker",
        "vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu_model_runner",
        "vllm.model_executor.models.llama", "vllm.v1.attention.backends.flash_attn",
        "weightcache.integrations.vllm.loader"))  # fmt: skip
    print(json.dumps({**report, "vllm": vllm.__version__}), flush=True)
    return 0


# =========================================================================== the orchestrator


class Bench(engine_real.Bench):
    """vLLM's run under ``--work``: its environment, plugins and figures."""

    script = Path(__file__)
    schema = SCHEMA
    log_digest_name = LOG_DIGEST_NAME
    engine = "vllm"
    plugin_group = "vllm.general_plugins"
    log_patterns = _LOG_PATTERNS
    utilization_key = "gpu_memory_utilization"
    phase_order = WORKER_PHASES

    def __init__(self, args) -> None:  # noqa: ANN001 - engine_real.Bench's
        super().__init__(args)
        if self.tp > 1:
            self.log_digest_name = engine_real.tp_result_name(LOG_DIGEST_NAME, self.tp)
            if not self.doc["phases_done"]:
                self.doc["issue"] = 45

    def schedule(self, arm: str) -> list[StartPlan]:
        return vllm_tp2_real.tp_schedule(arm, self.args.restarts, self.tp)

    def save(self) -> None:
        """As ever; at TP > 1 the default file is named for the GPU once env has read it
        (``h100x2-vllm-tp2-real.json``)."""
        slug = engine_real.gpu_slug((self.doc.get("machine") or {}).get("gpu", ""))
        if getattr(self.args, "out_auto", False) and slug:
            self.args.out = self.args.out.with_name(
                engine_real.tp_result_name(RESULT_NAME, self.tp, slug))
        super().save()

    def phase_env(self) -> None:
        super().phase_env()
        if self.tp > 1:
            gpus = engine_real.run_text(["nvidia-smi", "--query-gpu=index,uuid,name",
                                         "--format=csv,noheader"]).splitlines()  # fmt: skip
            self.doc["machine"]["gpus"] = gpus
            if len(gpus) < self.tp:
                raise RuntimeError(f"--tp {self.tp} needs {self.tp} GPUs; this machine shows "
                                   f"{len(gpus)}: {gpus}")  # fmt: skip

    def engine_env(self) -> dict[str, str]:
        env = super().engine_env()
        env.update({
            "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1",
            "VLLM_CACHE_ROOT": str(self.work / "cache" / "vllm"),
        })  # fmt: skip
        return env

    def deterministic_env(self) -> dict[str, str]:
        return {"VLLM_BATCH_INVARIANT": "1"}

    def settings(self) -> dict:
        return {
            "gpu_memory_utilization": self.args.utilization,
            "tight_utilization": self.args.tight_utilization,
            "restarts": self.args.restarts, "prompts": self.args.prompts,
            "max_tokens": self.args.max_tokens, "logprobs": self.args.logprobs,
            "tensor_parallel_size": self.tp, "enable_prefix_caching": False,
            "skip_tokenizer_init": True, "transport": "vmm_fd",
            "engine_env": {k: v for k, v in self.engine_env().items()
                           if k.startswith(("VLLM_", "PYTHONPATH", "LD_LIBRARY_PATH"))},
            **({} if self.tp == 1 else {
                "daemons": f"one per GPU: --tp-size {self.tp} --tp-rank r --shard-plan llama, "
                           f"cuda:r, --socket-dir + --cache {self.cache}",
                "uneven_extra_bytes": self.args.uneven_mib * MiB,
                "uneven_rank": self.tp - 1, "kill9_rank": self.kill_rank}),
        }  # fmt: skip

    def capacity(self, start: Mapping) -> str:
        return f"{start['figures']['num_gpu_blocks']} KV blocks"

    def report(self) -> dict:
        return build_report(self.doc)


def main(argv: Sequence[str] | None = None) -> int:
    return engine_real.main(argv, parse_args, Bench, engine_main, envcheck_main)


if __name__ == "__main__":
    sys.exit(main())
