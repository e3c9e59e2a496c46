"""Real SGLang on a GPU through weightcache, against SGLang's own cold start (issue 41, item 4).

The same run as ``vllm_real.py`` (benchmarks/README.md, "Real SGLang 0.5.23
through weightcache: how to run it"), for SGLang 0.5.23, after
``tools/offline_env.py`` installed the wheels of ``benchmarks/sglang_env.txt``
into ``--site``:

    python3 benchmarks/sglang_real.py --site /tmp/site-sglang     # every phase not done
    python3 benchmarks/sglang_real.py --site /tmp/site-sglang --phase cold

State lives under ``--work`` (default /tmp/wc-sglang); calls, deadlines, exit
codes (0 done, 1 failed, 3 call again) and the phases are vllm_real's
(engine_real.py holds them). The result goes to ``$OUT/sglang-real.json``
and belongs in ``benchmarks/results/<gpu>-sglang-real.json``.

Every start is SGLang's offline engine (``sglang.srt.entrypoints.engine.Engine``:
its scheduler in a process of its own, TP 1) in a fresh process, at the same
``--mem-fraction-static`` both ways (0.85, and ``--tight-utilization`` 0.9 for
one start of each mode). Cold is SGLang's own ``DefaultModelLoader`` with no
daemon on the GPU; warm selects weightcache through the adapter's
``sglang.srt.plugins`` entry point and ``model_loader_extra_config``
(``{"weightcache": {"socket": ..., "transports": ["vmm_fd"], "fallback":
false}}``), the route of an unmodified ``sglang serve``. Both run with:

- ``skip_tokenizer_init`` and token-id prompts (a random-weight model's text
  means nothing), ``disable_radix_cache`` (a repeated prompt would be served
  from cached KV by other kernels; the kill -9 loop repeats its prompts),
  ``random_seed`` 0;
- ``attention_backend="fa3"``: what SGLang 0.5.23 picks for an MHA model on
  Hopper anyway (``get_default_attn_backend``), named so the run does not
  depend on the detection; FlashAttention 3 from the ``sgl-kernel`` wheel
  (``SGLANG_USE_SGL_FA3_KERNEL=1``: SGLang would otherwise first try to
  download it from the Hugging Face kernels hub, which the machine cannot
  reach);
- ``sampling_backend="pytorch"`` (FlashInfer is not carried; greedy decoding
  samples nothing; the deterministic mode forces it anyway) and
  ``grammar_backend="none"`` (no structured output: xgrammar not carried);
- eager starts in SGLang's deterministic mode
  (``enable_deterministic_inference``, batch-invariant kernels; on Hopper
  with FA3): cold must equal cold, warm must equal cold bit for bit; starts
  with CUDA graphs (the default) are not deterministic, and warm must lie
  within the cold-vs-cold logprob floor.

SGLang 0.5.23 JIT-compiles some of a Llama's CUDA kernels at their first use
(``sglang.kernels.jit``: SiLU-and-mul, the fused RoPE, the KV-cache store,
the position clamp) with ``nvcc`` and the host ``c++``, into
``SGLANG_CACHE_DIR`` (under ``--work``, so each start after the first finds
them built). The ``env`` phase finds nvcc (``CUDA_HOME``, ``PATH``,
``/usr/local/cuda*``), records its version and refuses without it.

What each start records, beside what vllm_real records: SGLang's own KV size
(``max_total_num_tokens``, from its server info) and the figures it is sized
from, read in the scheduler process by a probe plugin (this file, as
``wcbench_probe``, SGLang hooks): its free-memory sample before the load
(``measure_pre_model_load_memory``), the bytes the loader reported preloaded (its
``preloaded_weights_bytes``, which SGLang adds back), the device bytes the load
took, the free memory when the KV pool is sized, the rest it sizes from
(``_profile_available_bytes``), the bytes per token and the pool's tokens
(``calculate_pool_sizes``); the adapter's own storage report (parameters
mapped zero-copy, in engine memory, with why). ``report.kv`` splits the
difference warm minus cold into SGLang's own terms (:func:`explain_tokens`).
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a file on the GPU machine (no install of this project)
    sys.path.insert(0, str(REPO))

from benchmarks import engine_real  # noqa: E402
from benchmarks.engine_real import (  # noqa: E402
    run_text,
    write_json,
)

SCHEMA = "weightcache-sglang-real/1"
RESULT_NAME = "sglang-real.json"
LOG_DIGEST_NAME = "sglang-real-logs.txt"
MiB = 1 << 20
GiB = 1 << 30
CLI = engine_real.Cli(
    prog="sglang_real", description=__doc__.split("\n\n")[0], result_name=RESULT_NAME,
    work=Path("/tmp/wc-sglang"), utilization_flag="--mem-fraction-static",
    utilization=0.85, tight_utilization=0.9,
)  # fmt: skip
DETERMINISTIC_METHOD = "enable_deterministic_inference, eager (FA3, pytorch sampling): " \
    "bit-equal required"
GRAPHS_METHOD = "SGLang's defaults with CUDA graphs (not deterministic): within the " \
    "cold-vs-cold floor"
# What every start passes to SGLang's Engine (the arms differ only in the load format).
ENGINE_ARGS = {
    "dtype": "bfloat16", "tp_size": 1, "skip_tokenizer_init": True,
    "disable_radix_cache": True, "random_seed": 0, "attention_backend": "fa3",
    "sampling_backend": "pytorch", "grammar_backend": "none", "log_level": "info",
}  # fmt: skip
ENGINE_ENV = {
    # FA3 from sgl-kernel, not from the Hugging Face kernels hub (no network there).
    "SGLANG_USE_SGL_FA3_KERNEL": "1",
    # DeepGEMM serves FP8 GEMMs; a bf16 Llama has none (and the wheel is not carried).
    "SGLANG_ENABLE_JIT_DEEPGEMM": "0",
    "SGLANG_IS_FLASHINFER_AVAILABLE": "false",
}  # fmt: skip
# SGLang's run path on SM90, imported by the env phase in the engine's environment.
RUN_PATH = (
    "sglang.srt.entrypoints.engine", "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tp_worker", "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.detokenizer_manager", "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.llama", "sglang.srt.layers.attention.flashattention_backend",
    "sglang.srt.layers.sampler", "sglang.srt.layers.logits_processor",
    "sglang.srt.mem_cache.memory_pool", "sglang.srt.mem_cache.kv_cache_configurator",
    "sglang.srt.batch_invariant_ops", "sglang.kernels.ops.attention.flash_attention_v3",
    "sgl_kernel", "sgl_kernel.flash_attn", "sglang.kernels.ops.activation.activation",
    "sglang.kernels.ops.attention.rope", "sglang.kernels.ops.kvcache.kvcache",
    "sglang.kernels.ops.attention.clamp_position", "weightcache.integrations.sglang.loader",
)  # fmt: skip


# =========================================================================== pure parts


def parse_args(argv: Sequence[str] | None, environ: Mapping[str, str]):  # noqa: ANN201
    """The harness's arguments (engine_real.parse_args with SGLang's names and defaults)."""
    return engine_real.parse_args(CLI, argv, environ)


def new_result() -> dict:
    return engine_real.new_result(SCHEMA)


def check_result(doc: Mapping) -> list[str]:
    """What is wrong with a result document's shape (empty: nothing)."""
    return engine_real.check_result(doc, SCHEMA)


def find_cuda_home(environ: Mapping[str, str], which: Callable[[str], str | None],
                   candidates: Sequence[Path]) -> str | None:  # fmt: skip
    """Where SGLang's JIT finds nvcc, as it looks (``CUDA_HOME``/``CUDA_PATH``, then nvcc on
    ``PATH``), else the first of ``candidates`` (``/usr/local/cuda*``) holding bin/nvcc:
    the image's toolkit may sit where SGLang's own default does not look."""
    for key in ("CUDA_HOME", "CUDA_PATH"):
        if environ.get(key):
            return environ[key]
    nvcc = which("nvcc")
    if nvcc is not None:
        return str(Path(nvcc).resolve().parent.parent)
    for home in candidates:
        if (home / "bin" / "nvcc").is_file():
            return str(home)
    return None


def explain_tokens(cold: Mapping, warm: Mapping) -> dict:
    """SGLang's KV size warm (weightcache) against cold (its default loader), term by term.

    SGLang 0.5.23 sizes its pool (``KVCacheConfigurator._profile_available_bytes``)
    from ``rest = available - pre_model_load_memory * (1 - f)``: ``available`` the
    free memory once the model is loaded, ``pre_model_load_memory`` the free
    memory it sampled before the load plus the bytes the loader says were
    resident already (``account_preloaded_weights``: weightcache's layout), ``f``
    ``--mem-fraction-static``; then ``max_total_num_tokens = (rest - fixed
    overhead) // bytes per token``, page-aligned (``calculate_pool_sizes``).
    With ``available = sample - load - other`` (``other``: what else the
    process consumed between the sample and the sizing), ``rest = f * sample
    - (1 - f) * preloaded - load - other``, so warm - cold splits into: the
    daemon's bytes already gone from the sample (times f), the preloaded bytes
    added back (times 1 - f, which keeps the activation slack a cold start
    has), the bytes the cold load allocated, the bytes the warm load (the
    attach) took, and everything else; ``residual`` is what those leave
    unexplained (SGLang's own free-memory reading against the probe's, taken
    just before it)."""

    def side(f: Mapping) -> dict:
        profile, account = f["profile"], f["account"]
        frac = profile["mem_fraction_static"]
        sample = account["sample_gib"] * GiB
        preloaded = profile["pre_model_load_gib"] * GiB - sample
        available = profile["available_measured_bytes"]
        load = f["load"]["device_bytes"]
        return {"f": frac, "sample": sample, "preloaded": preloaded, "load": load,
                "other": sample - available - load, "rest": profile["rest_bytes"],
                "tokens": f["max_total_num_tokens"], "per_token": f["pool"]["cell_size"]}

    c, w = side(cold), side(warm)
    if c["f"] != w["f"]:
        raise ValueError(f"mem_fraction_static differs: {c['f']} cold, {w['f']} warm")
    if c["per_token"] != w["per_token"]:
        raise ValueError(f"tokens differ in size: {c['per_token']} cold, {w['per_token']} warm")
    frac = c["f"]
    terms = {
        "daemon_bytes_gone_from_the_pre_load_sample": frac * (w["sample"] - c["sample"]),
        "preloaded_bytes_added_back": -(1 - frac) * (w["preloaded"] - c["preloaded"]),
        "weights_the_cold_load_allocated": c["load"],
        "device_bytes_of_the_warm_load": -w["load"],
        "other_consumption": -(w["other"] - c["other"]),
    }
    terms = {k: round(v) for k, v in terms.items()}
    difference = w["rest"] - c["rest"]
    residual = difference - sum(terms.values())
    return {
        "max_total_num_tokens": {"cold": c["tokens"], "warm": w["tokens"],
                                 "difference": w["tokens"] - c["tokens"]},
        "bytes_per_token": c["per_token"],
        "mem_fraction_static": frac,
        "rest_bytes": {"cold": c["rest"], "warm": w["rest"], "difference": difference},
        "preloaded_bytes": {"cold": round(c["preloaded"]), "warm": round(w["preloaded"])},
        "terms_bytes": terms,
        "terms_mib": {k: round(v / MiB, 3) for k, v in terms.items()},
        "residual_bytes": residual,
        "residual_mib": round(residual / MiB, 3),
        "difference_mib": round(difference / MiB, 3),
        "difference_in_tokens": round(difference / c["per_token"], 3),
    }  # fmt: skip


def device_use(cold: Mapping, warm: Mapping, daemon_mib: int | None) -> dict:
    """The device as a whole once each engine is ready, warm (the engine and its daemon)
    against cold (the engine alone): warm may exceed cold by the daemon's own context
    (its process's memory less the weights SGLang counted as preloaded), never more; and
    the warm engine's KV tokens are never more than cold's."""
    used = warm["device_used_bytes"] - cold["device_used_bytes"]
    out = {"device_used_warm_minus_cold_mib": round(used / MiB, 3),
           "warm_tokens_at_most_cold":
               warm["max_total_num_tokens"] <= cold["max_total_num_tokens"]}  # fmt: skip
    if daemon_mib is not None:
        preloaded = warm["account"]["preloaded_bytes"]
        context = daemon_mib - preloaded / MiB
        out["daemon_context_mib"] = round(context, 3)
        out["warm_device_use_at_most_cold_plus_daemon_context"] = used / MiB <= context
    return out


_LOG_PATTERNS: dict[str, tuple[str, Callable[[re.Match], object]]] = {
    "load_weight_end": (
        r"Load weight end\. elapsed=([\d.]+) s, type=\w+, .*?avail mem=([\d.]+) GB, "
        r"mem usage=(-?[\d.]+) GB",
        lambda m: {"seconds": float(m[1]), "avail_gb": float(m[2]), "usage_gb": float(m[3])}),
    "kv_cache_allocated": (
        r"KV Cache is allocated\. dtype: \S+, #tokens: (\d+), K size: ([\d.]+) GB, "
        r"V size: ([\d.]+) GB",
        lambda m: {"tokens": int(m[1]), "k_gb": float(m[2]), "v_gb": float(m[3])}),
    "memory_pool_end_avail_gb": (r"Memory pool end\. avail mem=([\d.]+) GB",
                                 lambda m: float(m[1])),
    "max_total_num_tokens": (r"max_total_num_tokens=(\d+)", lambda m: int(m[1])),
    "attention_backend": (r"Attention backend not specified\. Use (\w+) backend",
                          lambda m: m[1]),
    "weightcache_layout": (
        r"weightcache: SGLang's own layout \(plan (\w+)\) over (\w+) from daemon pid (\d+): "
        r"(\d+) parameter\(s\) \((\d+) bytes\) mapped zero-copy, (\d+) \((\d+) bytes\) in "
        r"engine memory",
        lambda m: {"plan": m[1], "transport": m[2], "daemon_pid": int(m[3]),
                   "mapped": int(m[4]), "mapped_bytes": int(m[5]),
                   "copied": int(m[6]), "copied_bytes": int(m[7])}),
    "fa3_from_the_hub": (r"Rollback to implementation from sgl-kernel", lambda m: True),
    **engine_real.ADAPTER_LOG_PATTERNS,
}  # fmt: skip


def parse_engine_log(text: str) -> dict:
    """What SGLang and the adapter logged about a start: the first match of each pattern
    (absent keys: not logged)."""
    return engine_real.parse_log(text, _LOG_PATTERNS)


def build_report(doc: Mapping) -> dict:
    """Outputs, KV and restart figures from the starts recorded so far."""
    report = engine_real.engine_report(doc, (DETERMINISTIC_METHOD, GRAPHS_METHOD),
                                       explain_tokens, device_use)  # fmt: skip
    ok = [s for s in doc["starts"] if s.get("status") == "ok"]
    report["max_total_num_tokens"] = {s["run"]: s["figures"].get("max_total_num_tokens")
                                      for s in ok}  # fmt: skip
    report["weights"] = {
        s["run"]: {"load_device_bytes": s["figures"]["load"].get("device_bytes"),
                   "preloaded_bytes": s["figures"].get("account", {}).get("preloaded_bytes"),
                   **{k: s["figures"]["load"].get(k) for k in
                      ("mapped", "mapped_bytes", "copied", "copied_bytes", "copied_why")}}
        for s in ok
    }  # fmt: skip
    return report


def engine_kwargs(spec: Mapping) -> dict:
    """SGLang Engine's arguments for a start (``engine_args`` of the spec last: the CPU dry
    run's device and attention backend)."""
    kwargs = {**ENGINE_ARGS, "model_path": spec["model"],
              "mem_fraction_static": spec["utilization"],
              "disable_cuda_graph": spec["eager"],
              "enable_deterministic_inference": spec["deterministic"]}  # fmt: skip
    if spec["arm"] == "warm":
        kwargs["model_loader_extra_config"] = json.dumps({"weightcache": {
            "socket": spec["socket"], "transports": spec.get("transports", ["vmm_fd"]),
            "fallback": False}})  # fmt: skip
    return {**kwargs, **spec.get("engine_args", {})}


def output_of(result: Mapping) -> dict:
    """One of Engine.generate's results as the comparison takes it: token ids, and per
    position the top-k ``[token, logprob]`` pairs (SGLang gives ``(logprob, token, text)``;
    the prompt's first position has none)."""
    meta = result["meta_info"]
    return {"token_ids": list(result["output_ids"]),
            "logprobs": [_top(p) for p in meta["output_top_logprobs"]],
            "prompt_logprobs": [_top(p) for p in meta.get("input_top_logprobs") or [] if p]}


def _top(position: Sequence) -> list[list]:
    return sorted(([int(entry[1]), float(entry[0])] for entry in position),
                  key=lambda e: (-e[1], e[0]))  # fmt: skip


# =========================================================================== the probe plugin
# Imported in every SGLang process as ``wcbench_probe`` (a stub dist-info's
# sglang.srt.plugins entry point); its hooks run in the scheduler process and
# write the figures to the file ``WCBENCH_FIGURES`` names.

_PROBE: dict = {}
MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"


def probe_plugin() -> None:
    """SGLang's plugin hook: record the load and the KV sizing in the scheduler."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook, kind in (
        (f"{MODEL_RUNNER}.load_model", _load_model, HookType.AROUND),
        ("sglang.srt.distributed.bootstrap.measure_pre_model_load_memory", _measure,
         HookType.AROUND),
        ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
         "._profile_available_bytes", _profile, HookType.AROUND),
        ("sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator"
         ".calculate_pool_sizes", _pool, HookType.AROUND),
        (f"{MODEL_RUNNER}.__init__", _runner_ready, HookType.AFTER),
    ):  # fmt: skip
        HookRegistry.register(target, hook, kind)


def _cuda() -> object | None:
    import torch

    return torch.cuda if torch.cuda.is_available() else None


def _free_bytes(settle: bool = False) -> int | None:
    """The device's free memory (None without CUDA: the CPU dry run); ``settle``: collected
    and the allocator's cache emptied first, as SGLang reads it."""
    cuda = _cuda()
    if cuda is None:
        return None
    if settle:
        gc.collect()
        cuda.empty_cache()
    cuda.synchronize()
    return cuda.mem_get_info()[0]


def _keep(key: str, value: object) -> None:
    _PROBE.setdefault(key, value)
    path = os.environ.get("WCBENCH_FIGURES")
    if path:
        write_json(Path(path), _PROBE)


def _load_model(original, runner, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
    free_before = _free_bytes()
    started = time.perf_counter()
    result = original(runner, *args, **kwargs)
    free_after = _free_bytes()
    loader = getattr(runner, "loader", None)
    _keep("load", {
        "loader": type(loader).__name__, "seconds": time.perf_counter() - started,
        "device_bytes": None if free_before is None else free_before - free_after,
        **_adapter_report(loader),
    })  # fmt: skip
    return result


def _adapter_report(loader: object) -> dict:
    """The weightcache loader's own storage report of this load (nothing for SGLang's)."""
    report: dict = {}
    layout_load = getattr(loader, "layout_load", None)
    if layout_load is not None:
        report.update({"path": "engine layout", "mapped": len(layout_load.mapped),
                       "mapped_bytes": layout_load.mapped_bytes,
                       "copied": len(layout_load.copied),
                       "copied_bytes": layout_load.copied_bytes,
                       "copied_why": dict(list(layout_load.copied.items())[:10])})  # fmt: skip
    decision = getattr(loader, "_layout", None)
    if decision is not None:
        attached = decision.attached
        report.update({
            "layout_bytes": decision.layout_bytes,
            "daemon_bytes_change": decision.daemon_bytes_change,
            "transport": getattr(attached, "transport", None),
            "daemon_pid": getattr(attached, "daemon_pid", None),
            "reason": decision.reason, "disk": decision.disk,
        })  # fmt: skip
    if hasattr(loader, "preloaded_weights_bytes"):
        report["loader_preloaded_weights_bytes"] = loader.preloaded_weights_bytes
    if getattr(loader, "reloaded", None):
        report["reloaded_from_disk"] = loader.reloaded
    return report


def _measure(original, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
    """SGLang's free-memory sample before the load (GiB, the MIN over ranks), the target's.
    (Not read around ``account_preloaded_weights``: the adapter's hook there replaces
    SGLang's addition without calling it, so a hook inside it would never run.)"""
    sample = original(*args, **kwargs)
    if not kwargs.get("is_draft_worker", False):
        _PROBE.setdefault("sample_gib", sample)
    return sample


def _profile(original, configurator, pre_model_load_memory, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
    from sglang.srt.runtime_context import get_schedule

    available = _free_bytes(settle=True)
    rest = original(configurator, pre_model_load_memory, *args, **kwargs)
    _PROBE["profile_calls"] = _PROBE.get("profile_calls", 0) + 1
    # What SGLang sizes from: its sample, and the loader's preloaded bytes it added back.
    _keep("account", {"sample_gib": _PROBE.get("sample_gib"),
                      "preloaded_bytes": _PROBE.get("load", {}).get(
                          "loader_preloaded_weights_bytes", 0),
                      "baseline_gib": pre_model_load_memory})  # fmt: skip
    _keep("profile", {"pre_model_load_gib": pre_model_load_memory,
                      "mem_fraction_static": get_schedule().mem_fraction_static,
                      "available_measured_bytes": available, "rest_bytes": rest})  # fmt: skip
    return rest


def _pool(original, pool_configurator, available_bytes, page_size, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
    config = original(pool_configurator, available_bytes, page_size, *args, **kwargs)
    _keep("pool", {"available_bytes": available_bytes, "page_size": page_size,
                   "cell_size": getattr(pool_configurator, "_cell_size", None),
                   "fixed_overhead_bytes": getattr(pool_configurator, "_fixed_overhead_bytes",
                                                   None),
                   "max_total_num_tokens": config.max_total_num_tokens})  # fmt: skip
    return config


def _runner_ready(result, runner, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
    cuda = _cuda()
    if cuda is not None:
        cuda.synchronize()
        free, total = cuda.mem_get_info()
        _keep("runner_ready", {"device_free_bytes": free, "device_used_bytes": total - free,
                               "torch_reserved_bytes": cuda.memory_reserved(),
                               "torch_allocated_bytes": cuda.memory_allocated(),
                               "max_total_num_tokens": runner.max_total_num_tokens})  # fmt: skip
    return result


# =========================================================================== the engine process


def engine_main(spec_path: Path) -> int:
    """One SGLang start (``_engine SPEC``): the timeline, the outputs, the scheduler's
    figures; with ``serve`` set, generate the prompt set in a loop until ``stop`` exists."""
    spec = json.loads(spec_path.read_text())
    # The scheduler process inherits the variable: the probe writes its figures there.
    os.environ["WCBENCH_FIGURES"] = spec["figures"]
    from sglang.srt.entrypoints.engine import Engine

    times = {"imported": time.time()}
    engine = Engine(**engine_kwargs(spec))
    times["ready"] = time.time()
    engine.generate(input_ids=[spec["prompts"][0][:4]],
                    sampling_params={"temperature": 0.0, "max_new_tokens": 1})  # fmt: skip
    times["first_token"] = time.time()
    params = {"temperature": 0.0, "max_new_tokens": spec["max_tokens"], "ignore_eos": True}

    def generate() -> list[dict]:
        results = engine.generate(input_ids=spec["prompts"], sampling_params=params,
                                  return_logprob=True, logprob_start_len=0,
                                  top_logprobs_num=spec["logprobs"])  # fmt: skip
        return [output_of(r) for r in results]

    outputs = generate()
    info = engine.get_server_info()
    written = Path(spec["figures"])
    # Without them (the probe did not load: its error is in the log) the outputs still count.
    figures = json.loads(written.read_text()) if written.exists() else {"probe_missing": True}
    ready = figures.get("runner_ready", {})
    figures.update({
        "max_total_num_tokens": info.get("max_total_num_tokens"),
        "max_running_requests": info.get("max_running_requests"),
        "attention_backend": info.get("attention_backend"),
        "sampling_backend": info.get("sampling_backend"),
        "device_used_bytes": ready.get("device_used_bytes"),
    })  # fmt: skip
    engine_real.finish_start(spec, times, outputs, figures, generate)
    engine.shutdown()
    return 0


def envcheck_main() -> int:
    """Versions, the JIT toolchain and SGLang's run path in the engine's environment
    (``_envcheck``), as JSON."""
    import importlib.metadata as md

    report = engine_real.envcheck("sglang", "sglang.srt.plugins", RUN_PATH)
    cuda_home = os.environ.get("CUDA_HOME")
    nvcc = str(Path(cuda_home) / "bin" / "nvcc") if cuda_home else None
    print(json.dumps({
        **report, "sglang": md.version("sglang"), "sglang_kernel": md.version("sglang-kernel"),
        "cuda_home": cuda_home,
        "nvcc": run_text([nvcc, "--version"]).splitlines()[-1:] if nvcc else None,
        "libcudart_for_linking": bool(cuda_home)
        and (Path(cuda_home) / "lib64" / "libcudart.so").exists(),
        "host_cxx": run_text([os.environ.get("CXX", "c++"), "--version"]).splitlines()[:1],
    }), flush=True)  # fmt: skip
    return 0


# =========================================================================== the orchestrator


class Bench(engine_real.Bench):
    """SGLang's run under ``--work``: its environment, plugins and figures."""

    script = Path(__file__)
    schema = SCHEMA
    log_digest_name = LOG_DIGEST_NAME
    engine = "sglang"
    plugin_group = "sglang.srt.plugins"
    log_patterns = _LOG_PATTERNS
    utilization_key = "mem_fraction_static"

    def engine_env(self) -> dict[str, str]:
        env = super().engine_env()
        env.update(ENGINE_ENV)
        cache = self.work / "cache"
        # SGLang's JIT kernels, built at the first start, found again by the next ones.
        env["SGLANG_CACHE_DIR"] = str(cache / "sglang")
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
        home = find_cuda_home(os.environ, shutil.which, sorted(Path("/usr/local").glob("cuda*")))
        if home is not None:
            env["CUDA_HOME"] = home
        return env

    def start_spec(self, plan: engine_real.StartPlan) -> dict:
        return {"transports": ["vmm_fd"]}

    def check_engine(self, engine: Mapping) -> None:
        super().check_engine(engine)
        if not engine.get("nvcc") or not engine.get("host_cxx"):
            raise RuntimeError(
                "SGLang 0.5.23 JIT-compiles a Llama's SiLU, RoPE and KV-store kernels with "
                f"nvcc and c++ at the first forward: nvcc {engine.get('nvcc')}, c++ "
                f"{engine.get('host_cxx')} (CUDA_HOME {engine.get('cuda_home')})")
        if not engine.get("libcudart_for_linking"):
            raise RuntimeError(f"{engine.get('cuda_home')}/lib64/libcudart.so is missing: "
                               "SGLang's JIT links its kernels with -lcudart there")

    def settings(self) -> dict:
        return {
            "mem_fraction_static": self.args.utilization,
            "tight_mem_fraction_static": self.args.tight_utilization,
            "restarts": self.args.restarts, "prompts": self.args.prompts,
            "max_tokens": self.args.max_tokens, "logprobs": self.args.logprobs,
            "engine_args": ENGINE_ARGS, "transport": "vmm_fd",
            "engine_env": {k: v for k, v in self.engine_env().items()
                           if k.startswith(("SGLANG_", "CUDA_HOME", "PYTHONPATH",
                                            "LD_LIBRARY_PATH"))},
        }  # fmt: skip

    def capacity(self, start: Mapping) -> str:
        return f"max_total_num_tokens {start['figures'].get('max_total_num_tokens')}"

    def report(self) -> dict:
        return build_report(self.doc)


def main(argv: Sequence[str] | None = None) -> int:
    return engine_real.main(argv, parse_args, Bench, engine_main, envcheck_main)


if __name__ == "__main__":
    sys.exit(main())
