"""benchmarks/vllm_real.py, the parts that run without a GPU or vLLM: arguments and
phases, the checkpoint's table, prompts, output comparison, the KV arithmetic, log
parsing, the result's shape and report, and the environments it builds for its
processes."""

from __future__ import annotations

import ast
import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import vllm_real as bench

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "plans" / "vllm-llama-3-8b.json"
GiB = 1 << 30
MiB = 1 << 20


# ----------------------------------------------------------------------------- arguments


def test_phases_run_in_their_order_whatever_order_they_are_asked_in() -> None:
    assert bench.resolve_phases("kill9,env, cold") == ["env", "cold", "kill9"]
    assert bench.resolve_phases("all") == list(bench.PHASES)
    with pytest.raises(ValueError, match="unknown phase"):
        bench.resolve_phases("env,warmup")
    with pytest.raises(ValueError, match="unknown phase"):
        bench.resolve_phases(" , ")


def test_the_result_goes_to_the_device_tools_out_folder_when_it_is_set(tmp_path: Path) -> None:
    args = bench.parse_args(["--phase", "cold"], {"OUT": str(tmp_path)})
    assert args.out == tmp_path / "vllm-real.json" and args.phases == ["cold"]
    args = bench.parse_args([], {})
    assert args.out == REPO / "benchmarks" / "results" / "vllm-real.json"
    assert args.phases == list(bench.PHASES) and args.site == Path("/tmp/site")
    assert bench.parse_args(["--out", "x.json"], {"OUT": "/o"}).out == Path("x.json")


@pytest.mark.parametrize("argv", [["--gpu-memory-utilization", "1.2"], ["--restarts", "0"],
                                  ["--phase", "bogus"], ["--max-tokens", "0"]])  # fmt: skip
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(argv, {})


def test_each_arm_has_an_uncounted_first_start_then_its_restarts_eager_and_tight() -> None:
    plans = bench.schedule("warm", 3)
    assert [p.run for p in plans] == ["warm-first", "warm-1", "warm-2", "warm-3", "warm-eager",
                                      "warm-tight", "warm-tight-eager"]  # fmt: skip
    assert [p.counted for p in plans] == [False] + [True] * 6
    assert [p.mode for p in plans] == ["graphs"] * 4 + ["eager", "tight_graphs", "tight_eager"]
    # Eager starts are the deterministic ones: bit-equal outputs are required of them.
    assert [p.deterministic for p in plans] == [p.eager for p in plans]
    assert {p.arm for p in plans} == {"warm"}
    # The cold arm starts deterministic twice: the second shows the mode holds on the GPU.
    cold = bench.schedule("cold", 1)
    assert [p.run for p in cold if p.deterministic] == ["cold-eager", "cold-eager-2",
                                                         "cold-tight-eager"]  # fmt: skip
    # Every KV pair names starts the schedules make.
    runs = {p.run for p in plans + cold}
    assert all({c, w} <= runs for _, c, w in bench.KV_PAIRS)
    with pytest.raises(ValueError):
        bench.schedule("tepid", 3)
    with pytest.raises(ValueError):
        bench.schedule("cold", 0)


# ----------------------------------------------------------------------------- checkpoint


def test_the_checkpoint_has_the_published_llama_3_8b_names_shapes_and_config() -> None:
    fixture = json.loads(FIXTURE.read_text())
    ours = bench.llama_tensors(bench.LLAMA3_8B)
    assert sorted(ours) == sorted((name, shape) for name, _, shape in fixture["checkpoint"])
    assert {dtype for _, dtype, _ in fixture["checkpoint"]} == {"bfloat16"}
    assert 2 * sum(math.prod(shape) for _, shape in ours) == fixture["planned_bytes"]
    for key, value in fixture["config"].items():
        assert bench.LLAMA3_8B[key] == value, key


def test_shards_keep_the_order_and_stay_under_the_limit() -> None:
    tensors = bench.llama_tensors(bench.LLAMA3_8B)
    shards = bench.shard_tensors(tensors, itemsize=2)
    assert [t for shard in shards for t in shard] == tensors
    sizes = [2 * sum(math.prod(s) for _, s in shard) for shard in shards]
    assert all(size <= bench.SHARD_BYTES for size in sizes)
    # Each shard is full: the next tensor would not have fitted.
    for shard, following in zip(shards, shards[1:], strict=False):
        size = 2 * sum(math.prod(s) for _, s in shard)
        assert size + 2 * math.prod(following[0][1]) > bench.SHARD_BYTES
    assert len(shards) == 4  # as the published Llama-3-8B is cut
    # A tensor larger than the limit gets a shard of its own.
    assert bench.shard_tensors([("a", [4]), ("b", [100]), ("c", [4])], 1, limit=10) == [
        [("a", [4])], [("b", [100])], [("c", [4])]]


def test_the_prompts_are_fixed_spread_and_below_the_special_tokens() -> None:
    prompts = bench.prompt_set(8, 128256)
    assert prompts == bench.prompt_set(8, 128256)
    assert prompts != bench.prompt_set(8, 128256, seed=1)
    lengths = [len(p) for p in prompts]
    assert lengths[0] == 5 and lengths[-1] == 300 and lengths == sorted(lengths)
    assert max(max(p) for p in prompts) < 128000
    assert max(max(p) for p in bench.prompt_set(3, 1000)) < 1000


# ----------------------------------------------------------------------------- outputs


def outputs(seed: int = 0) -> list[dict]:
    return [
        {"token_ids": [10 + seed, 11, 12],
         "logprobs": [[[10 + seed, -0.5], [7, -1.25]], [[11, -0.25], [3, -2.0]],
                      [[12, -0.125], [4, -3.0]]]},
        {"token_ids": [20, 21],
         "logprobs": [[[20, -0.75], [1, -1.0]], [[21, -0.5], [2, -0.625]]]},
    ]  # fmt: skip


def test_outputs_equal_only_when_every_token_and_logprob_is() -> None:
    reference = outputs()
    # Read back from the reference's file: tuples and lists alike.
    same = json.loads(json.dumps(reference))
    same[1]["logprobs"][0] = [tuple(pair) for pair in same[1]["logprobs"][0]]
    result = bench.compare_outputs(reference, same)
    assert result["equal"] and result["first_difference"] is None
    assert result["max_abs_logprob_difference"] == 0.0

    shifted = copy.deepcopy(reference)
    shifted[1]["logprobs"][1][1][1] = -0.6875  # a top-k logprob, not the chosen token
    result = bench.compare_outputs(reference, shifted)
    assert not result["equal"] and result["token_ids_equal"] and not result["logprobs_equal"]
    assert result["max_abs_logprob_difference"] == 0.0625

    other = copy.deepcopy(reference)
    other[1]["token_ids"][1] = 99
    result = bench.compare_outputs(reference, other)
    assert not result["equal"]
    assert result["first_difference"] == {"prompt": 1, "position": 1, "reference": [21],
                                          "got": [99]}  # fmt: skip
    assert not bench.compare_outputs(reference, reference[:1])["equal"]
    assert bench.outputs_digest(reference) == bench.outputs_digest(json.loads(json.dumps(
        reference)))
    assert bench.outputs_digest(reference) != bench.outputs_digest(other)

    # The prompt's logprobs count too: equal generations with another prompt logprob differ.
    with_prompt = copy.deepcopy(reference)
    for out in with_prompt:
        out["prompt_logprobs"] = [[[5, -2.0], [6, -3.0]]]
    moved = copy.deepcopy(with_prompt)
    moved[0]["prompt_logprobs"][0][1][1] = -3.5
    result = bench.compare_outputs(with_prompt, moved)
    assert not result["equal"] and result["token_ids_equal"]
    assert (result["max_abs_prompt_logprob_difference"], result["max_abs_logprob_difference"]) \
        == (0.5, 0.0)


# ----------------------------------------------------------------------------- KV


def figures(*, total: int, util: float, external: int, load: int, other: int, transient: int,
            cudagraph: int, applied: bool, per_block: int) -> dict:
    """A worker's figures as vLLM 0.33 computes them (determine_available_memory)."""
    requested = math.ceil(total * util) - external
    applied_cg = cudagraph if applied else 0
    available = requested - (load + other + transient) - applied_cg
    return {
        "gpu_memory_utilization": util, "init_snapshot": {"total_memory": total},
        "requested_memory": requested, "total_consumed": load + other,
        "peak_activation_memory": transient + applied_cg,
        "cudagraph_memory_estimate": cudagraph, "cudagraph_estimate_applied": applied,
        "available_kv_cache_memory_bytes": available, "num_gpu_blocks": available // per_block,
        "bytes_per_block": per_block, "load": {"device_bytes": load, "seconds": 1.0},
        "device_used_bytes": 0,
    }  # fmt: skip


H200 = 150_754_820_096  # an H200's total (143,771 MiB), as torch reports it


@pytest.mark.parametrize("applied", [True, False])
def test_the_kv_difference_splits_into_its_terms_with_nothing_left_over(applied: bool) -> None:
    per_block = 2 * 1024 * 1024
    layout = 16_060_522_496 + 4096
    cold = figures(total=H200, util=0.9, external=0, load=16_062_087_168, other=700 * 1024**2,
                   transient=3 * GiB, cudagraph=400 * 1024**2, applied=applied,
                   per_block=per_block)  # fmt: skip
    warm = figures(total=H200, util=0.9, external=layout, load=2 * 1024**2,
                   other=700 * 1024**2 + 12345, transient=3 * GiB + 512, cudagraph=400 * 1024**2,
                   applied=applied, per_block=per_block)  # fmt: skip
    assert bench.external_weight_bytes(cold) == 0
    assert bench.external_weight_bytes(warm) == layout
    kv = bench.explain_kv(cold, warm)
    difference = warm["available_kv_cache_memory_bytes"] - cold["available_kv_cache_memory_bytes"]
    assert kv["available_kv_bytes"]["difference"] == difference
    assert sum(kv["terms_bytes"].values()) == difference and kv["residual_bytes"] == 0
    terms = kv["terms_bytes"]
    assert terms["external_weights_off_the_budget"] == -layout
    assert terms["weights_the_cold_load_allocated"] == 16_062_087_168
    assert terms["device_bytes_of_the_warm_load"] == -2 * 1024**2
    assert terms["other_consumption"] == -12345 and terms["transient_peak"] == -512
    assert terms["cudagraph_estimate"] == 0
    assert kv["external_minus_cold_load_bytes"] == layout - 16_062_087_168
    assert kv["num_gpu_blocks"]["difference"] == warm["num_gpu_blocks"] - cold["num_gpu_blocks"]
    assert kv["difference_mib"] == round(difference / 2**20, 3)


def test_figures_off_vllms_formula_leave_a_residual() -> None:
    cold = figures(total=H200, util=0.9, external=0, load=10 * GiB, other=GiB, transient=GiB,
                   cudagraph=0, applied=True, per_block=4096)  # fmt: skip
    warm = copy.deepcopy(cold)
    warm["available_kv_cache_memory_bytes"] += 8192  # what no term accounts for
    kv = bench.explain_kv(cold, warm)
    assert kv["residual_bytes"] == 8192 and kv["residual_mib"] == round(8192 / 2**20, 3)
    warm["bytes_per_block"] = 8192
    with pytest.raises(ValueError, match="blocks differ in size"):
        bench.explain_kv(cold, warm)


# ----------------------------------------------------------------------------- logs


def adapter_format(prefix: str, engine: str = "vllm") -> str:
    """The format string of an adapter's log call that starts with ``prefix``, read from its
    source (``integrations/<engine>/loader.py``): the parser follows the adapter's own words."""
    source = (REPO / "sidecar" / "weightcache" / "integrations" / engine / "loader.py").read_text()
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                and str(node.args[0].value).startswith(prefix)):  # fmt: skip
            return node.args[0].value
    raise AssertionError(f"no log call starting {prefix!r} in the adapter")


def test_the_log_parser_reads_vllms_and_the_adapters_lines() -> None:
    layout = adapter_format("weightcache: vLLM's own layout") % (
        "30db620329b9", "vmm_fd", 4242, 195, 16060522496, 0, 0, "")
    checkpoint = adapter_format("weightcache: %d tensor(s)") % (
        100, 8_000_000, "vmm_fd", 4242, 191, 8_060_522_496)
    # vLLM 0.33.0's own format strings (gpu worker and runner, engine core, compilation).
    text = "\n".join([
        "INFO Model loading took 14.96 GiB memory and 3.512345 seconds",
        "INFO Loading weights took 2.91 seconds",
        "INFO torch.compile took 21.40 s in total",
        "INFO Graph capturing finished in 9 secs, took 0.45 GiB",
        "INFO init engine (profile, create kv cache, warmup model) took 35.20 s "
        "(compilation: 21.40 s)",
        "INFO Available KV cache memory: 104.16 GiB",
        "INFO GPU KV cache size: 853,264 tokens, "
        "Maximum concurrency for 8,192 tokens per request: 104.16x",
        "INFO Directly load the compiled graph(s) for compile range (1, 8192) from the cache",
        layout, checkpoint,
        "Traceback (most recent call last):", "Traceback (most recent call last):",
    ])  # fmt: skip
    found = bench.parse_engine_log(text)
    assert found["model_loading"] == {"gib": 14.96, "seconds": 3.512345}
    assert found["loading_weights_s"] == 2.91 and found["torch_compile_s"] == 21.40
    assert found["graph_capture"] == {"seconds": 9, "gib": 0.45}
    assert found["init_engine_s"] == 35.20 and found["available_kv_gib"] == 104.16
    assert found["kv_cache_tokens"] == 853_264 and found["compile_cache_hit"] is True
    assert found["weightcache_layout"] == {
        "plan": "30db620329b9", "transport": "vmm_fd", "daemon_pid": 4242, "mapped": 195,
        "mapped_bytes": 16060522496, "copied": 0, "copied_bytes": 0}  # fmt: skip
    assert found["weightcache_checkpoint_layout"]["copied_bytes"] == 8_060_522_496
    assert found["tracebacks"] == 2
    assert "compiled_graphs" not in found and "weightcache_disk_fallback" not in found

    fallback = bench.parse_engine_log(
        "WARNING weightcache: loading from disk instead of the daemon: no daemon answers on x\n")
    assert fallback["weightcache_disk_fallback"] == "no daemon answers on x"
    assert fallback["tracebacks"] == 0


def test_nvidia_smis_process_list_is_read_by_pid() -> None:
    text = "4242, 17012\n977, 612\n[N/A], [N/A]\n"
    assert bench.parse_compute_apps(text) == {"4242": 17012, "977": 612}
    assert bench.parse_compute_apps("") == {}


# ----------------------------------------------------------------------------- the result


def start(run: str, arm: str, *, eager: bool = False, counted: bool = True, blocks: int = 100,
          first_token: float = 10.0, equal: bool | None = True, load: int = 0,
          deterministic: bool = False, difference: float = 0.0, used: int = 0) -> dict:
    fig = figures(total=H200, util=0.9, external=0 if arm == "cold" else 16 * GiB,
                  load=load, other=GiB, transient=GiB, cudagraph=0, applied=True,
                  per_block=2 << 20)  # fmt: skip
    fig["num_gpu_blocks"] = blocks
    fig["device_used_bytes"] = used
    comparison = None if equal is None else {
        "equal": equal, "max_abs_logprob_difference": difference,
        "max_abs_prompt_logprob_difference": difference / 2}  # fmt: skip
    return {"run": run, "arm": arm, "eager": eager, "counted": counted, "status": "ok",
            "deterministic": deterministic,
            "timing": {"first_token_s": first_token, "ready_s": first_token - 1},
            "figures": fig, "comparison": comparison}  # fmt: skip


def test_a_new_result_is_well_formed_and_broken_ones_are_named() -> None:
    doc = bench.new_result()
    assert bench.check_result(doc) == []
    doc["starts"] = [start("cold-1", "cold"), start("cold-1", "cold"), {"run": "x"}]
    doc["phases_done"] = ["env", "warmup"]
    del doc["starts"][0]["figures"]
    problems = bench.check_result(doc)
    assert "start 'cold-1' is ok but has no figures" in problems
    assert "start 'cold-1' recorded twice" in problems
    assert any(p.startswith("start 'x' lacks") for p in problems)
    assert "unknown phase done: 'warmup'" in problems


def test_the_report_compares_outputs_restarts_and_kv_of_what_ran() -> None:
    doc = bench.new_result()
    doc["starts"] = [
        start("cold-first", "cold", counted=False, first_token=60.0, equal=None, load=16 * GiB),
        start("cold-1", "cold", first_token=30.0, load=16 * GiB, difference=0.25,
              used=20 * GiB),
        start("cold-2", "cold", first_token=32.0, load=16 * GiB, difference=0.5),
        start("cold-eager", "cold", eager=True, first_token=20.0, equal=None, load=16 * GiB,
              deterministic=True),
        start("cold-eager-2", "cold", eager=True, load=16 * GiB, deterministic=True),
        start("warm-1", "warm", first_token=21.0, blocks=99, difference=0.375, equal=False,
              used=20 * GiB + 600 * MiB),
        start("warm-2", "warm", first_token=23.0, difference=0.75, equal=False),
        start("warm-eager", "warm", eager=True, blocks=101, deterministic=True, equal=False),
        {"run": "warm-3", "arm": "warm", "eager": False, "counted": True, "status": "failed"},
    ]  # fmt: skip
    # The daemon: the weights' allocation (16 GiB) and 512 MiB of its own.
    doc["daemon_after_warm"] = {"status": {"pid": 7}, "compute_apps_mib": {"7": 16 * 1024 + 512}}
    report = bench.build_report(doc)
    assert report["starts_ok"] == 8 and report["starts_failed"] == 1
    assert report["outputs_equal"] == {"cold-1": True, "cold-2": True, "cold-eager-2": True,
                                       "warm-1": False, "warm-2": False,
                                       "warm-eager": False}  # fmt: skip
    # Graphs: the cold starts' noise floor is 0.5; warm-2 differs by 0.75: outside it.
    graphs = report["outputs"]["graphs"]
    assert (graphs["cold_vs_cold_floor"], graphs["warm_max_difference"]) == (0.5, 0.75)
    assert graphs["warm_within_floor"] is False
    # Deterministic: cold equals cold (the mode holds), so warm must be bit-equal: it is not.
    assert report["outputs"]["deterministic"] == {
        "method": "VLLM_BATCH_INVARIANT=1, eager: bit-equal required",
        "cold_vs_cold_bit_equal": True, "warm_bit_equal": False}  # fmt: skip
    cold = report["restarts"]["cold_graphs"]["first_token_s"]
    assert (cold["median"], cold["runs"]) == (31.0, 2)  # the first start is not counted
    assert report["restarts"]["warm_graphs"]["first_token_s"]["samples"] == [21.0, 23.0]
    assert report["restarts"]["warm_tight_eager"]["first_token_s"] is None
    assert set(report["kv"]) == {"graphs", "eager"}  # no tight start yet
    graphs_kv = report["kv"]["graphs"]
    assert graphs_kv["num_gpu_blocks"] == {"cold": 100, "warm": 99, "difference": -1}
    assert graphs_kv["warm_blocks_at_most_cold"] is True
    assert report["kv"]["eager"]["warm_blocks_at_most_cold"] is False
    # 600 MiB more in use warm, the daemon's own 512 MiB allowed: more than that.
    assert graphs_kv["device_used_warm_minus_cold_mib"] == 600.0
    assert graphs_kv["daemon_context_mib"] == 512.0
    assert graphs_kv["warm_device_use_at_most_cold_plus_daemon_context"] is False
    assert report["num_gpu_blocks"]["warm-1"] == 99


# ----------------------------------------------------------------------------- environments


def test_vllm_finds_both_plugins_through_the_stub_distributions(tmp_path: Path) -> None:
    args = bench.parse_args(["--work", str(tmp_path / "w"), "--site", str(tmp_path / "site")], {})
    site = tmp_path / "site"
    (site / "msgspec").mkdir(parents=True)
    (site / "msgspec-0.23.0.dist-info").mkdir()
    (site / "other").mkdir()
    runner = bench.Bench(args)
    env = runner.engine_env()
    paths = env["PYTHONPATH"].split(":")
    assert paths[0] == str(site) and str(REPO / "sidecar") in paths
    assert env["LD_LIBRARY_PATH"].split(":")[0] == f"{site}/nvidia/nccl/lib"
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    listed = subprocess.run(
        [sys.executable, "-c", "import importlib.metadata as md, json; print(json.dumps(sorted("
         "e.value for e in md.entry_points(group='vllm.general_plugins'))))"],
        env={"PYTHONPATH": str(runner.plugin_dir())}, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert json.loads(listed) == ["wcbench_probe:probe_plugin",
                                  "weightcache.integrations.vllm:register"]  # fmt: skip
    # The probe module is this file, by another name.
    probe = runner.plugin_dir() / f"{bench.PROBE_MODULE}.py"
    assert probe.resolve() == Path(bench.__file__).resolve()
    daemon_paths = runner.daemon_env()["PYTHONPATH"].split(":")
    assert str(site) not in daemon_paths  # the daemon keeps the image's torch
    assert sorted(p.name for p in Path(daemon_paths[0]).iterdir()) == [
        "msgspec", "msgspec-0.23.0.dist-info"]


def test_a_schedule_resumes_where_it_stopped_and_stops_before_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = bench.parse_args(["--work", str(tmp_path / "w"), "--restarts", "2"],
                            {"OUT": str(tmp_path / "out")})  # fmt: skip
    runner = bench.Bench(args)
    started: list[str] = []

    def fake_start(plan: bench.StartPlan) -> dict:
        started.append(plan.run)
        record = start(plan.run, plan.arm, eager=plan.eager, counted=plan.counted)
        record["wall_s"] = 100.0
        return record

    monkeypatch.setattr(runner, "start_engine", fake_start)
    plans = bench.schedule("cold", 2)
    # 280 s left: the first start's guess (240 s, +20 %) does not fit; nothing starts.
    monkeypatch.setattr(runner, "left", lambda: 280.0)
    with pytest.raises(bench.Incomplete, match="cold-first needs about 288 s"):
        runner.run_schedule(plans)
    assert started == []
    # The first start fits, then 100 s are left; no restart is timed yet: 120 s, +20 %.
    monkeypatch.setattr(runner, "left", lambda: 100.0 if started else 400.0)
    with pytest.raises(bench.Incomplete, match="cold-1 needs about 144 s"):
        runner.run_schedule(plans)
    assert started == ["cold-first"]
    monkeypatch.setattr(runner, "left", lambda: 1000.0)
    runner.run_schedule(plans)  # resumes after the start already recorded
    assert started == [p.run for p in plans]
    assert [s["run"] for s in runner.doc["starts"]] == started
    # Each start's record reaches --out at once (a call cut off later keeps it).
    saved = json.loads((tmp_path / "out" / "vllm-real.json").read_text())
    assert [s["run"] for s in saved["starts"]] == started and saved["result_problems"] == []
    # Once counted starts are timed, they set the guess: the longest, +20 %.
    assert runner.duration_guess(bench.StartPlan("cold-3", "cold", False, True)) == 120.0

    failed = {"run": "cold-2", "arm": "cold", "eager": False, "counted": True,
              "status": "failed", "exit_code": 1}  # fmt: skip
    with pytest.raises(RuntimeError, match="start cold-2 failed"):
        runner.record(failed)
    assert [s["run"] for s in runner.doc["starts"]] == [
        p.run for p in plans if p.run != "cold-2"] + ["cold-2"]  # fmt: skip


def test_an_event_line_still_being_written_is_not_read(tmp_path: Path) -> None:
    events = tmp_path / "e"
    assert bench.read_events(events) == []
    events.write_text('{"started": 1.0, "equal": true, "error": null}\n{"started": 2.')
    assert bench.read_events(events) == [{"started": 1.0, "equal": True, "error": None}]


def test_an_engine_a_cut_off_call_left_running_is_ended_by_the_next(tmp_path: Path) -> None:
    work = tmp_path / "w"
    work.mkdir()
    left = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        (work / "engine.pid").write_text(str(left.pid))
        bench.Bench(bench.parse_args(["--work", str(work)], {"OUT": str(tmp_path)}))
        assert left.wait(10) == -9
        assert not (work / "engine.pid").exists()
    finally:
        if left.poll() is None:
            left.kill()
            left.wait()


def test_a_starts_seconds_split_into_its_phases_and_add_up_to_the_first_token() -> None:
    """Issue 44: where a start's time goes, from the driver's spawn to the first token: the
    driver's imports, the engine process's spawn and imports (its probe's stamps), each
    worker phase and the gaps between them, until ready, the first token."""
    t0 = 1000.0
    times = {"imported": 1012.0, "ready": 1034.0, "first_token": 1034.5}
    stamps = {"process_started": [1013.0, 1016.0], "plugin_loaded": [1016.0, 1016.0],
              "init_device": [1016.5, 1018.0], "load_model": [1018.0, 1018.25],
              "determine_available_memory": [1020.0, 1025.0],
              "initialize_from_config": [1025.0, 1025.5],
              "compile_or_warm_up_model": [1025.5, 1031.0]}  # fmt: skip
    parts = bench.engine_real.timeline(t0, times, stamps, bench.WORKER_PHASES)
    assert list(parts) == [
        "driver_imports", "engine_process_spawn", "engine_process_imports",
        "before_init_device", "init_device", "before_load_model", "load_model",
        "before_determine_available_memory", "determine_available_memory",
        "before_initialize_from_config", "initialize_from_config",
        "before_compile_or_warm_up_model", "compile_or_warm_up_model", "until_ready",
        "first_token",
    ]  # fmt: skip
    assert parts["engine_process_imports"] == 3.0 and parts["load_model"] == 0.25
    assert parts["before_determine_available_memory"] == 1.75  # torch.compile's first pass
    assert sum(parts.values()) == pytest.approx(times["first_token"] - t0)
    # A phase the probe did not see (another vLLM) leaves its time to the next gap.
    del stamps["initialize_from_config"]
    fewer = bench.engine_real.timeline(t0, times, stamps, bench.WORKER_PHASES)
    assert "initialize_from_config" not in fewer
    assert fewer["before_compile_or_warm_up_model"] == 0.5
    assert sum(fewer.values()) == pytest.approx(times["first_token"] - t0)
    # The report's figure per arm and mode: each part's median over the counted starts.
    medians = bench.engine_real._median_parts([parts, {**parts, "load_model": 0.75}, parts])
    assert medians["load_model"] == 0.25 and list(medians) == list(parts)
