"""benchmarks/sglang_real.py, the parts that run without a GPU or SGLang: arguments, where
SGLang's JIT finds nvcc, the KV arithmetic in SGLang's own terms, log parsing, SGLang's
outputs as the comparison takes them, the Engine's arguments, the report, and the
environments it builds for its processes. (Its engine process runs for real on CPU in
tests/engines/test_sglang_real.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import engine_real
from benchmarks import sglang_real as bench
from tests.unit.test_vllm_real import adapter_format

REPO = Path(__file__).resolve().parents[2]
GiB = 1 << 30
MiB = 1 << 20


# ----------------------------------------------------------------------------- arguments


def test_sglangs_fraction_and_result_name_and_work_directory(tmp_path: Path) -> None:
    args = bench.parse_args(["--mem-fraction-static", "0.8"], {"OUT": str(tmp_path)})
    assert args.out == tmp_path / "sglang-real.json"
    assert (args.utilization, args.tight_utilization) == (0.8, 0.9)
    assert args.work == Path("/tmp/wc-sglang") and args.phases == list(bench.engine_real.PHASES)
    assert bench.parse_args([], {}).out == REPO / "benchmarks" / "results" / "sglang-real.json"
    for argv in (["--mem-fraction-static", "1.2"], ["--gpu-memory-utilization", "0.9"]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv, {})
    assert bench.check_result(bench.new_result()) == []
    assert bench.check_result(json.loads(json.dumps({**bench.new_result(), "schema": "x"}))) == [
        "schema is 'x', not 'weightcache-sglang-real/1'"]  # fmt: skip


def test_nvcc_is_found_where_sglangs_jit_looks_then_in_usr_local(tmp_path: Path) -> None:
    toolkit = tmp_path / "cuda-13.0"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "bin" / "nvcc").touch()
    bare = tmp_path / "cuda-12.9"
    bare.mkdir()

    def nowhere(_: str) -> None:
        return None

    assert bench.find_cuda_home({"CUDA_HOME": "/opt/cuda"}, nowhere, [toolkit]) == "/opt/cuda"
    assert bench.find_cuda_home({"CUDA_PATH": "/opt/c"}, nowhere, [toolkit]) == "/opt/c"
    on_path = bench.find_cuda_home({}, lambda _: str(toolkit / "bin" / "nvcc"), [])
    assert on_path == str(toolkit.resolve())
    assert bench.find_cuda_home({}, nowhere, [bare, toolkit]) == str(toolkit)
    assert bench.find_cuda_home({}, nowhere, [bare]) is None


# ----------------------------------------------------------------------------- KV


def figures(*, frac: float, sample: int, preloaded: int, load: int, other: int,
            per_token: int = 131072, overhead: int = 0) -> dict:  # fmt: skip
    """A scheduler's figures as SGLang 0.5.23 computes them (_profile_available_bytes,
    calculate_pool_sizes), in bytes where SGLang keeps GiB floats."""
    pre = sample + preloaded
    available = sample - load - other
    rest = int((available / GiB - pre / GiB * (1 - frac)) * GiB)
    tokens = (rest - overhead) // per_token
    return {
        "load": {"device_bytes": load, "seconds": 0.2},
        "account": {"sample_gib": sample / GiB, "preloaded_bytes": preloaded,
                    "baseline_gib": pre / GiB},
        "profile": {"pre_model_load_gib": pre / GiB, "mem_fraction_static": frac,
                    "available_measured_bytes": available, "rest_bytes": rest},
        "pool": {"cell_size": per_token, "fixed_overhead_bytes": overhead,
                 "max_total_num_tokens": tokens},
        "max_total_num_tokens": tokens, "device_used_bytes": 0,
    }  # fmt: skip


H100 = 85_029_158_912  # free at SGLang's sample on an idle H100 (about 79.2 GiB)
WEIGHTS = 16_062_087_168  # the Llama-3-8B layout
DAEMON_CONTEXT = 680 * MiB


def test_the_token_difference_splits_into_sglangs_terms_with_nothing_left_over() -> None:
    cold = figures(frac=0.85, sample=H100, preloaded=0, load=WEIGHTS + 2 * MiB, other=900 * MiB)
    warm = figures(frac=0.85, sample=H100 - WEIGHTS - DAEMON_CONTEXT, preloaded=WEIGHTS,
                   load=4 * MiB, other=900 * MiB + 12345)  # fmt: skip
    kv = bench.explain_tokens(cold, warm)
    terms = kv["terms_bytes"]
    assert terms["daemon_bytes_gone_from_the_pre_load_sample"] == round(
        -0.85 * (WEIGHTS + DAEMON_CONTEXT))
    assert terms["preloaded_bytes_added_back"] == round(-0.15 * WEIGHTS)
    assert terms["weights_the_cold_load_allocated"] == WEIGHTS + 2 * MiB
    assert terms["device_bytes_of_the_warm_load"] == -4 * MiB
    assert terms["other_consumption"] == -12345
    # SGLang's GiB floats and int() leave a byte or two; nothing else is unexplained.
    assert abs(kv["residual_bytes"]) <= 2
    difference = warm["profile"]["rest_bytes"] - cold["profile"]["rest_bytes"]
    assert kv["rest_bytes"]["difference"] == difference
    # What warm loses: f of the daemon's own context, plus what the attach and the cold
    # load's 2 MiB slack moved.
    assert abs(difference - (-0.85 * DAEMON_CONTEXT - 4 * MiB + 2 * MiB - 12345)) <= 2
    assert kv["max_total_num_tokens"] == {
        "cold": cold["max_total_num_tokens"], "warm": warm["max_total_num_tokens"],
        "difference": warm["max_total_num_tokens"] - cold["max_total_num_tokens"]}  # fmt: skip
    assert kv["preloaded_bytes"] == {"cold": 0, "warm": WEIGHTS}
    assert kv["difference_in_tokens"] == round(difference / 131072, 3)


def test_figures_of_other_settings_are_refused_and_a_misread_sample_leaves_a_residual() -> None:
    cold = figures(frac=0.85, sample=H100, preloaded=0, load=WEIGHTS, other=0)
    warm = figures(frac=0.85, sample=H100, preloaded=0, load=WEIGHTS, other=0)
    warm["profile"]["rest_bytes"] += 4096  # SGLang read 4 KiB more free than the probe
    assert bench.explain_tokens(cold, warm)["residual_bytes"] == 4096
    with pytest.raises(ValueError, match="mem_fraction_static differs"):
        bench.explain_tokens(cold, figures(frac=0.9, sample=H100, preloaded=0, load=0, other=0))
    with pytest.raises(ValueError, match="tokens differ in size"):
        bench.explain_tokens(cold, figures(frac=0.85, sample=H100, preloaded=0, load=0, other=0,
                                           per_token=65536))  # fmt: skip


def test_the_device_as_a_whole_warm_may_exceed_cold_by_the_daemons_own_context() -> None:
    cold = figures(frac=0.85, sample=H100, preloaded=0, load=WEIGHTS, other=0)
    warm = figures(frac=0.85, sample=H100 - WEIGHTS - DAEMON_CONTEXT, preloaded=WEIGHTS,
                   load=0, other=0)  # fmt: skip
    warm["device_used_bytes"] = 600 * MiB
    daemon_mib = WEIGHTS // MiB + 680
    use = bench.device_use(cold, warm, daemon_mib)
    assert use["daemon_context_mib"] == 680.0 and use["device_used_warm_minus_cold_mib"] == 600.0
    assert use["warm_device_use_at_most_cold_plus_daemon_context"] is True
    assert use["warm_tokens_at_most_cold"] is True
    warm["device_used_bytes"] = 700 * MiB
    assert bench.device_use(cold, warm, daemon_mib)[
        "warm_device_use_at_most_cold_plus_daemon_context"] is False  # fmt: skip
    assert "daemon_context_mib" not in bench.device_use(cold, warm, None)


# ----------------------------------------------------------------------------- logs


def test_the_log_parser_reads_sglangs_and_the_adapters_lines() -> None:
    layout = adapter_format("weightcache: SGLang's own layout", "sglang") % (
        "173acdbc166a", "vmm_fd", 4242, 195, 16060522496, 0, 0, "")
    checkpoint = adapter_format("weightcache: %d tensor(s)", "sglang") % (
        100, 8_000_000, "vmm_fd", 4242, 191, 8_060_522_496)
    # SGLang 0.5.23's own lines (model_runner, memory_pool, scheduler; the CPU dry run's).
    text = "\n".join([
        "[2026-12-06 08:47:20] Load weight end. elapsed=0.86 s, type=LlamaForCausalLM, "
        "avail mem=15.10 GB, mem usage=-0.01 GB.",
        "[2026-12-06 08:47:21] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 2048, "
        "K size: 0.25 GB, V size: 0.25 GB",
        "[2026-12-06 08:47:21] Memory pool end. avail mem=15.07 GB",
        "[2026-12-06 08:47:21] max_total_num_tokens=2048, chunked_prefill_size=4096, "
        "max_prefill_tokens=16384, max_running_requests=1024, context_len=256",
        layout, checkpoint, "Traceback (most recent call last):",
    ])  # fmt: skip
    found = bench.parse_engine_log(text)
    assert found["load_weight_end"] == {"seconds": 0.86, "avail_gb": 15.10, "usage_gb": -0.01}
    assert found["kv_cache_allocated"] == {"tokens": 2048, "k_gb": 0.25, "v_gb": 0.25}
    assert found["memory_pool_end_avail_gb"] == 15.07 and found["max_total_num_tokens"] == 2048
    assert found["weightcache_layout"] == {
        "plan": "173acdbc166a", "transport": "vmm_fd", "daemon_pid": 4242, "mapped": 195,
        "mapped_bytes": 16060522496, "copied": 0, "copied_bytes": 0}  # fmt: skip
    assert found["weightcache_checkpoint_layout"]["copied_bytes"] == 8_060_522_496
    assert found["tracebacks"] == 1 and "fa3_from_the_hub" not in found


# ----------------------------------------------------------------------------- the engine


def sglang_result(output_ids: list[int], first_prompt_position: object = None) -> dict:
    """One of SGLang's Engine.generate results with logprobs (skip_tokenizer_init: no
    text): per position (logprob, token id, None) tuples, best first."""
    return {"output_ids": output_ids, "meta_info": {
        "output_top_logprobs": [[(-0.25, tok, None), (-1.5, 7, None)] for tok in output_ids],
        "input_top_logprobs": [first_prompt_position, [(-2.0, 9, None), (-0.5, 3, None)]],
    }}  # fmt: skip


def test_sglangs_results_become_the_comparisons_token_ids_and_logprob_pairs() -> None:
    out = bench.output_of(sglang_result([11, 12]))
    assert out == {"token_ids": [11, 12],
                   "logprobs": [[[11, -0.25], [7, -1.5]], [[12, -0.25], [7, -1.5]]],
                   "prompt_logprobs": [[[3, -0.5], [9, -2.0]]]}  # fmt: skip
    # The prompt's first position has no logprob (None or empty): left out either way.
    assert bench.output_of(sglang_result([11, 12], []))["prompt_logprobs"] == out[
        "prompt_logprobs"]  # fmt: skip
    assert engine_real.compare_outputs([out], [bench.output_of(sglang_result([11, 12]))])["equal"]
    assert not engine_real.compare_outputs([out], [bench.output_of(sglang_result([11, 13]))])[
        "equal"]  # fmt: skip


def spec(arm: str, **more: object) -> dict:
    return {"model": "/m", "arm": arm, "eager": False, "deterministic": False,
            "utilization": 0.85, "socket": "/w/sock/gpu.sock", **more}  # fmt: skip


def test_the_arms_differ_only_in_the_load_format() -> None:
    cold = bench.engine_kwargs(spec("cold"))
    warm = bench.engine_kwargs(spec("warm"))
    assert {k: v for k, v in warm.items() if k != "model_loader_extra_config"} == cold
    assert json.loads(warm["model_loader_extra_config"]) == {"weightcache": {
        "socket": "/w/sock/gpu.sock", "transports": ["vmm_fd"], "fallback": False}}
    assert cold["attention_backend"] == "fa3" and cold["sampling_backend"] == "pytorch"
    assert cold["skip_tokenizer_init"] and cold["disable_radix_cache"]
    assert (cold["mem_fraction_static"], cold["disable_cuda_graph"],
            cold["enable_deterministic_inference"]) == (0.85, False, False)  # fmt: skip
    eager = bench.engine_kwargs(spec("cold", eager=True, deterministic=True))
    assert eager["disable_cuda_graph"] and eager["enable_deterministic_inference"]
    # The CPU dry run's device, backend and transport go in last.
    dry = bench.engine_kwargs(spec("warm", transports=["memfd"],
                                   engine_args={"device": "cpu",
                                                "attention_backend": "torch_native"}))
    assert (dry["device"], dry["attention_backend"]) == ("cpu", "torch_native")
    assert json.loads(dry["model_loader_extra_config"])["weightcache"]["transports"] == ["memfd"]


# ----------------------------------------------------------------------------- the report


def start(run: str, arm: str, fig: dict, *, eager: bool = False, counted: bool = True,
          deterministic: bool = False, equal: bool | None = True, difference: float = 0.0,
          first_token: float = 20.0) -> dict:  # fmt: skip
    comparison = None if equal is None else {
        "equal": equal, "max_abs_logprob_difference": difference,
        "max_abs_prompt_logprob_difference": 0.0}  # fmt: skip
    return {"run": run, "arm": arm, "eager": eager, "counted": counted, "status": "ok",
            "deterministic": deterministic, "figures": fig, "comparison": comparison,
            "timing": {"first_token_s": first_token, "ready_s": first_token - 1}}  # fmt: skip


def test_the_report_explains_sglangs_kv_per_mode_and_judges_the_outputs() -> None:
    cold = figures(frac=0.85, sample=H100, preloaded=0, load=WEIGHTS, other=0)
    warm = figures(frac=0.85, sample=H100 - WEIGHTS - DAEMON_CONTEXT, preloaded=WEIGHTS,
                   load=0, other=0)  # fmt: skip
    warm["load"].update({"mapped": 195, "mapped_bytes": WEIGHTS, "copied": 0, "copied_bytes": 0})
    doc = bench.new_result()
    doc["starts"] = [
        start("cold-first", "cold", cold, counted=False, equal=None),
        start("cold-1", "cold", cold, difference=0.25),
        start("cold-eager", "cold", cold, eager=True, deterministic=True, equal=None),
        start("cold-eager-2", "cold", cold, eager=True, deterministic=True),
        start("warm-1", "warm", warm, difference=0.125, first_token=18.0),
        start("warm-eager", "warm", warm, eager=True, deterministic=True),
    ]  # fmt: skip
    doc["daemon_after_warm"] = {"status": {"pid": 7},
                                "compute_apps_mib": {"7": WEIGHTS // MiB + 680}}  # fmt: skip
    report = bench.build_report(doc)
    assert set(report["kv"]) == {"graphs", "eager"}
    graphs = report["kv"]["graphs"]
    assert abs(graphs["residual_bytes"]) <= 2 and graphs["daemon_context_mib"] == 680.0
    assert graphs["max_total_num_tokens"]["difference"] < 0 and graphs["warm_tokens_at_most_cold"]
    assert report["outputs"]["deterministic"] == {
        "method": bench.DETERMINISTIC_METHOD, "cold_vs_cold_bit_equal": True,
        "warm_bit_equal": True}  # fmt: skip
    assert report["outputs"]["graphs"]["warm_within_floor"] is True
    assert report["outputs"]["graphs"]["method"] == bench.GRAPHS_METHOD
    assert report["weights"]["warm-1"]["copied_bytes"] == 0
    assert report["weights"]["warm-1"]["preloaded_bytes"] == WEIGHTS
    assert report["max_total_num_tokens"]["cold-1"] == cold["max_total_num_tokens"]
    assert report["restarts"]["warm_graphs"]["first_token_s"]["samples"] == [18.0]
    assert report["daemon_device_mib"] == WEIGHTS // MiB + 680
    # Figures of another SGLang (a key missing) are named in the report, not fatal.
    del doc["starts"][-1]["figures"]["account"]
    assert "error" in bench.build_report(doc)["kv"]["eager"]


# ----------------------------------------------------------------------------- environments


def test_sglang_finds_both_plugins_and_its_jit_toolkit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    toolkit = tmp_path / "cuda"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "bin" / "nvcc").touch()
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(bench.shutil, "which", lambda name: str(toolkit / "bin" / name))
    site = tmp_path / "site"
    site.mkdir()
    runner = bench.Bench(bench.parse_args(["--work", str(tmp_path / "w"), "--site", str(site)],
                                          {"OUT": str(tmp_path)}))  # fmt: skip
    env = runner.engine_env()
    paths = env["PYTHONPATH"].split(":")
    assert paths[0] == str(site) and paths[-1] == str(REPO)
    assert paths[1] == str(REPO / "sidecar") and paths[2] == str(runner.plugin_dir())
    assert env["CUDA_HOME"] == str(toolkit.resolve())
    assert env["SGLANG_USE_SGL_FA3_KERNEL"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["SGLANG_CACHE_DIR"] == str(tmp_path / "w" / "cache" / "sglang")
    assert env["LD_LIBRARY_PATH"].split(":")[0] == f"{site}/nvidia/nccl/lib"
    listed = subprocess.run(
        [sys.executable, "-c", "import importlib.metadata as md, json; print(json.dumps(sorted("
         "e.value for e in md.entry_points(group='sglang.srt.plugins'))))"],
        env={"PYTHONPATH": str(runner.plugin_dir())}, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert json.loads(listed) == ["wcbench_probe:probe_plugin",
                                  "weightcache.integrations.sglang:register"]  # fmt: skip
    probe = runner.plugin_dir() / f"{engine_real.PROBE_MODULE}.py"
    assert probe.resolve() == Path(bench.__file__).resolve()
    with pytest.raises(RuntimeError, match="JIT-compiles"):
        runner.check_engine({"weightcache_supports": True, "nvcc": None,
                             "host_cxx": ["c++ 12"], "plugins": [
                                 "wcbench_probe:probe_plugin",
                                 "weightcache.integrations.sglang:register"]})  # fmt: skip
