"""benchmarks/vllm_real.py --tp 2 and benchmarks/vllm_tp2_real.py (issue 45), the parts that run
without GPUs or vLLM: the arguments and file names, the schedule's uneven starts, each rank's
KV reading and the order of correction and MIN, the report's TP section, the per-rank daemons'
command lines against the adapter's socket derivation, and the kill -9 of one rank's daemon."""

from __future__ import annotations

import json
import math
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from benchmarks import engine_real
from benchmarks import vllm_real as bench
from benchmarks import vllm_tp2_real as tp2

REPO = Path(__file__).resolve().parents[2]
GiB = 1 << 30
MiB = 1 << 20
H100 = 85_045_608_448  # an H100 80GB's total, as torch reports it
# Llama-3-8B at TP 2: 4 KV heads x 128 x 2 (K, V) x 2 B x 16 tokens x 32 layers
PER_BLOCK = 1 << 20
H100_SMI = "\n".join(["NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB"] * 2)


# ----------------------------------------------------------------------------- arguments, names


def test_tp_1_stays_the_default_with_its_folder_and_file(tmp_path: Path) -> None:
    args = bench.parse_args([], {"OUT": str(tmp_path)})
    assert args.tp == 1 and args.work == Path("/tmp/wc-vllm")
    assert args.out == tmp_path / "vllm-real.json" and args.out_auto is False


def test_tp_2_has_its_own_folder_and_a_file_named_for_the_gpus(tmp_path: Path) -> None:
    args = bench.parse_args(["--tp", "2"], {"OUT": str(tmp_path)})
    assert args.tp == 2 and args.work == Path("/tmp/wc-vllm-tp2") and args.uneven_mib == 2048
    # Until env has named the GPU; then <gpu>x2-vllm-tp2-real.json (Bench.save).
    assert args.out == tmp_path / "vllm-tp2-real.json" and args.out_auto is True
    given = bench.parse_args(["--tp", "2", "--out", "x.json", "--work", "/w"], {})
    assert given.out == Path("x.json") and given.out_auto is False and given.work == Path("/w")


@pytest.mark.parametrize("argv", [["--tp", "3"], ["--tp", "2", "--uneven-mib", "3"],
                                  ["--tp", "2", "--uneven-mib", "0"]])  # fmt: skip
def test_bad_tp_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(argv, {})


def test_result_names_follow_benchmarks_results() -> None:
    assert engine_real.tp_result_name("vllm-real.json", 1, "h100") == "vllm-real.json"
    assert engine_real.tp_result_name("vllm-real.json", 2) == "vllm-tp2-real.json"
    assert engine_real.tp_result_name("vllm-real.json", 2, "h200") == "h200x2-vllm-tp2-real.json"
    assert engine_real.tp_result_name("vllm-real-logs.txt", 2) == "vllm-tp2-real-logs.txt"
    assert engine_real.gpu_slug(H100_SMI) == "h100"
    assert engine_real.gpu_slug("NVIDIA H200, 580.159.04, 143771 MiB") == "h200"
    assert engine_real.gpu_slug("NVIDIA A100-SXM4-80GB, 550.1, 81920 MiB") == "a100"
    assert engine_real.gpu_slug("") is None and engine_real.gpu_slug("no GPU") is None


def test_tp_2_adds_one_uneven_start_per_arm_and_nothing_at_tp_1() -> None:
    assert bench.vllm_tp2_real.tp_schedule("cold", 2, 1) == bench.schedule("cold", 2)
    for arm in ("cold", "warm"):
        plans = tp2.tp_schedule(arm, 2, 2)
        assert plans[:-1] == bench.schedule(arm, 2)
        last = plans[-1]
        assert (last.run, last.arm, last.uneven) == (f"{arm}-uneven", arm, True)
        # Read against the eager pair, bit-equal outputs required; no restart figure.
        assert last.eager and last.deterministic and not last.counted and not last.tight
    assert tp2.UNEVEN_RUNS == ("cold-uneven", "warm-uneven")


# ----------------------------------------------------------------------------- KV per rank


def rank_figures(*, rank: int, external: int, load: int, other: int = 700 * MiB,
                 transient: int = 2 * GiB, util: float = 0.9, uneven: dict | None = None,
                 used: int = 0) -> dict:  # fmt: skip
    """A worker's figures as vLLM 0.33 computes them (eager: no CUDA-graph estimate)."""
    requested = math.ceil(H100 * util) - external
    consumed = load + other
    available = requested - consumed - transient
    return {
        "tp_rank": rank, "gpu_memory_utilization": util,
        "init_snapshot": {"total_memory": H100}, "requested_memory": requested,
        "total_consumed": consumed, "peak_activation_memory": transient,
        "cudagraph_memory_estimate": 0, "cudagraph_estimate_applied": True,
        "available_kv_cache_memory_bytes": available, "bytes_per_block": PER_BLOCK,
        "num_gpu_blocks": None, "load": {"device_bytes": load, "seconds": 0.2, "mapped": 195,
                                         "mapped_bytes": external, "copied": 0,
                                         "copied_bytes": 0},
        "device_used_bytes": used, "uneven": uneven,
    }  # fmt: skip


def engine(ranks: list[dict]) -> dict:
    """A start's figures: vLLM's MIN of the ranks' blocks, rank 0's at the top."""
    blocks = min(r["available_kv_cache_memory_bytes"] // r["bytes_per_block"] for r in ranks)
    for r in ranks:
        r["num_gpu_blocks"] = blocks
    return {**ranks[0], "ranks": ranks}


W = 8_031_043_584  # a rank's layout (half of Llama-3-8B's 16.06 GB, 2 MiB-granular)
X = 2048 * MiB  # the uneven case's extra buffer


def cold_and_warm(*, uneven: bool, noise: int = 0) -> tuple[dict, dict]:
    """A TP 2 pair: cold loads W on each rank (and, uneven, rank 1 its X too); warm's ranks
    take W (and X) off their budget; rank 0 consumes ``noise`` more of everything else."""
    extra = X if uneven else 0
    cold = engine([
        rank_figures(rank=0, external=0, load=W, other=700 * MiB + noise),
        rank_figures(rank=1, external=0, load=W + extra,
                     uneven={"rank": 1, "bytes": X, "arm": "cold"} if uneven else None),
    ])  # fmt: skip
    warm = engine([
        rank_figures(rank=0, external=W, load=2 * MiB, other=698 * MiB + noise),
        rank_figures(rank=1, external=W + extra, load=2 * MiB, other=698 * MiB,
                     uneven={"rank": 1, "bytes": X, "arm": "warm"} if uneven else None),
    ])  # fmt: skip
    return cold, warm


def test_each_ranks_reading_is_vllms_formula_with_and_without_its_correction() -> None:
    _, warm = cold_and_warm(uneven=True)
    r0, r1 = (tp2.rank_kv(f) for f in tp2.rank_figures(warm))
    assert (r0["rank"], r0["external_bytes"], r1["external_bytes"]) == (0, W, W + X)
    assert r0["formula_residual_bytes"] == 0 and r1["formula_residual_bytes"] == 0
    assert r1["uncorrected_kv_bytes"] - r1["corrected_kv_bytes"] == W + X
    assert r1["uneven_extra_bytes"] == X and r0["uneven_extra_bytes"] == 0
    assert r0["blocks_alone"] - r1["blocks_alone"] == X // PER_BLOCK
    # A TP 1 start's figures are its only rank.
    assert tp2.rank_figures({"a": 1}) == [{"a": 1}]


def test_even_ranks_both_orders_agree_and_give_the_cold_blocks() -> None:
    cold, warm = cold_and_warm(uneven=False, noise=3 * MiB)
    order = tp2.min_order([tp2.rank_kv(f) for f in warm["ranks"]], warm["num_gpu_blocks"],
                          cold["num_gpu_blocks"])  # fmt: skip
    assert order["external_spread_bytes"] == 0 and order["orders_agree"] is True
    assert order["correct_then_min_is_vllms"] and order["correct_then_min_equals_cold"]
    assert order["min_then_correct_equals_cold_on_every_rank"] is True
    # Rank 0 consumed 3 MiB more: it is the MIN, 3 blocks under rank 1 alone.
    assert order["blocks_alone_by_rank"][1] - order["blocks_alone_by_rank"][0] == 3


def test_uneven_ranks_correct_then_min_gives_cold_and_min_then_correct_does_not() -> None:
    cold, warm = cold_and_warm(uneven=True, noise=3 * MiB)
    order = tp2.min_order([tp2.rank_kv(f) for f in warm["ranks"]], warm["num_gpu_blocks"],
                          cold["num_gpu_blocks"])  # fmt: skip
    assert order["external_spread_bytes"] == X and order["external_spread_mib"] == 2048.0
    assert order["correct_then_min_is_vllms"] and order["correct_then_min_equals_cold"]
    assert order["correct_then_min_minus_cold_blocks"] == 0
    # The smallest uncorrected reading is rank 0's (its 3 MiB); rank 0 then subtracts only
    # W: its cache is X larger than rank 1 can hold. Rank 1 subtracts W + X: 3 blocks short.
    assert order["min_then_correct_minus_cold_blocks_by_rank"] == [X // PER_BLOCK - 3, -3]
    assert order["min_then_correct_ranks_agree"] is False and order["orders_agree"] is False
    assert order["min_then_correct_equals_cold_on_every_rank"] is False
    verdict = tp2.uneven_verdict(order)
    assert verdict["shown"] is True and verdict["extra_buffer_blocks"] == 2048.0
    assert verdict["min_then_correct_excess_blocks_by_rank"] == [2045, -3]
    # vLLM's own blocks off the correct-then-MIN prediction: said, and nothing is shown.
    wrong = tp2.min_order([tp2.rank_kv(f) for f in warm["ranks"]], warm["num_gpu_blocks"] + 1,
                          cold["num_gpu_blocks"])  # fmt: skip
    assert wrong["correct_then_min_is_vllms"] is False
    assert tp2.uneven_verdict(wrong)["shown"] is False


def test_ranks_with_blocks_of_different_sizes_or_no_ranks_are_refused() -> None:
    _, warm = cold_and_warm(uneven=False)
    ranks = [tp2.rank_kv(f) for f in warm["ranks"]]
    ranks[1]["bytes_per_block"] *= 2
    with pytest.raises(ValueError, match="blocks differ in size"):
        tp2.min_order(ranks, 1)
    with pytest.raises(ValueError, match="no rank"):
        tp2.min_order([], 1)


def test_warm_against_cold_rank_by_rank_to_the_mib() -> None:
    cold, warm = cold_and_warm(uneven=True)
    # Each GPU's use: warm = cold + its daemon's context (500 MiB beyond the layout).
    for rank, (c, w) in enumerate(zip(cold["ranks"], warm["ranks"], strict=True)):
        c["device_used_bytes"] = 20 * GiB + rank * X
        w["device_used_bytes"] = c["device_used_bytes"] + 500 * MiB
    daemon_mib = [W / MiB + 500, W / MiB + 500]  # the layout and the context: X is the engine's
    ranks = tp2.per_rank_pair(cold, warm, bench.explain_kv, bench.device_use, daemon_mib)
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["residual_bytes"] == 0
        assert r["daemon_context_mib"] == 500.0
        assert r["warm_device_use_at_most_cold_plus_daemon_context"] is True
    # Rank 1's X counts in cold's load and in warm's external bytes alike.
    assert ranks[1]["terms_bytes"]["external_weights_off_the_budget"] == -(W + X)
    assert ranks[1]["terms_bytes"]["weights_the_cold_load_allocated"] == W + X
    with pytest.raises(ValueError, match="1 cold ranks against 2 warm"):
        tp2.per_rank_pair(cold["ranks"][0], warm, bench.explain_kv, bench.device_use, [])


def start(run: str, arm: str, figures: dict, *, eager: bool = True, counted: bool = True,
          equal: bool | None = True) -> dict:  # fmt: skip
    return {"run": run, "arm": arm, "eager": eager, "counted": counted, "status": "ok",
            "deterministic": eager, "timing": {"first_token_s": 30.0, "ready_s": 29.0},
            "figures": figures,
            "comparison": None if equal is None else {
                "equal": equal, "max_abs_logprob_difference": 0.0}}  # fmt: skip


def tp2_doc() -> dict:
    doc = bench.new_result()
    doc["settings"] = {"tensor_parallel_size": 2}
    cold, warm = cold_and_warm(uneven=False)
    cold_u, warm_u = cold_and_warm(uneven=True)
    doc["starts"] = [
        start("cold-eager", "cold", cold, equal=None), start("cold-eager-2", "cold", cold),
        start("warm-eager", "warm", warm),
        start("cold-uneven", "cold", cold_u, counted=False),
        start("warm-uneven", "warm", warm_u, counted=False),
    ]  # fmt: skip
    doc["daemon_after_warm"] = {
        "status": {"pid": 10, "gpu": "GPU-a"},
        "ranks": [{"pid": 10, "gpu": "GPU-a"}, {"pid": 11, "gpu": "GPU-b"}],
        "compute_apps_by_gpu": {"GPU-a": {"10": 8160, "20": 30000}, "GPU-b": {"11": 8162}},
        "compute_apps_mib": {"10": 8160, "11": 8162},
    }  # fmt: skip
    doc["kill9"] = {"rank": 1, "batches": {"failed": 0, "not_equal_to_the_first": 0},
                    "readopted": True, "fresh_engine_equal": True}  # fmt: skip
    return doc


def test_the_report_has_a_tp_section_only_at_tp_2() -> None:
    doc = tp2_doc()
    report = bench.build_report(doc)
    section = report["tp"]
    assert section["tensor_parallel_size"] == 2
    assert section["daemon_device_mib_by_rank"] == [8160, 8162]
    assert set(section["kv_per_rank"]) == {"eager", "uneven"}
    assert set(section["min_order"]) == {"eager", "uneven"}
    assert section["min_order"]["eager"]["orders_agree"] is True
    assert section["uneven_verdict"]["shown"] is True
    assert all(r["residual_bytes"] == 0 for r in section["kv_per_rank"]["uneven"])
    assert section["zero_bytes_copied_every_rank"] is True
    assert set(section["weights_per_rank"]) == {"warm-eager", "warm-uneven"}
    assert [w["rank"] for w in section["weights_per_rank"]["warm-eager"]] == [0, 1]
    assert section["kill9"]["rank"] == 1 and section["kill9"]["readopted"] is True
    # The uneven starts are no restart figures and their outputs are judged like the rest.
    assert report["restarts"]["warm_eager"]["first_token_s"]["runs"] == 1
    assert report["outputs"]["deterministic"]["warm_bit_equal"] is True
    # A copy anywhere says so.
    doc["starts"][2]["figures"]["ranks"][1]["load"]["copied_bytes"] = 4096
    assert bench.build_report(doc)["tp"]["zero_bytes_copied_every_rank"] is False
    # TP 1: no section (the single-GPU report as before).
    doc["settings"] = {"tensor_parallel_size": 1}
    assert "tp" not in bench.build_report(doc)
    del doc["settings"]["tensor_parallel_size"]
    assert "tp" not in bench.build_report(doc)


def test_figures_of_another_release_are_named_not_raised() -> None:
    doc = tp2_doc()
    del doc["starts"][4]["figures"]["ranks"][1]["requested_memory"]
    section = bench.build_report(doc)["tp"]
    assert "error" in section["min_order"]["uneven"] and "uneven_verdict" not in section


# ----------------------------------------------------------------------------- the run's processes


def tp2_bench(tmp_path: Path, *extra: str) -> bench.Bench:
    args = bench.parse_args(["--tp", "2", "--work", str(tmp_path / "w"), *extra],
                            {"OUT": str(tmp_path / "out")})  # fmt: skip
    return bench.Bench(args)


def test_each_rank_has_a_daemon_pinned_to_its_gpu_holding_its_shards(tmp_path: Path) -> None:
    runner = tp2_bench(tmp_path)
    for rank in (0, 1):
        cmd = runner.daemon_command(rank)
        flags = dict(zip(cmd[4::2], cmd[5::2], strict=False))
        assert cmd[1:4] == ["-m", "weightcache.daemon.cli", "serve"]
        assert flags["--device"] == f"cuda:{rank}" and flags["--transport"] == "vmm_fd"
        assert (flags["--tp-size"], flags["--tp-rank"], flags["--shard-plan"]) == (
            "2", str(rank), "llama")
        assert flags["--socket-dir"] == str(runner.socket_dir)
        assert flags["--cache"] == engine_real.TP_CACHE
        # Two daemons on one host: an HTTP port each.
        assert flags["--http-address"] == f"127.0.0.1:{8470 + rank}"
        assert "--socket" not in flags
        assert runner.daemon_file(rank).name == f"daemon-r{rank}.json"
    # The socket is the one the daemon wrote, once it listens.
    (runner.work / "daemon-r1.socket").write_text("/run/x/gpu-GPU-b.sock\n")
    assert runner.rank_socket(1) == Path("/run/x/gpu-GPU-b.sock")
    # The kill9 phase kills the last rank's daemon; the uneven buffer sits on that rank.
    assert runner.kill_rank == 1
    plan = tp2.tp_schedule("warm", 1, 2)[-1]
    assert runner.uneven_spec(plan) == {"rank": 1, "bytes": 2048 * MiB, "arm": "warm"}
    assert runner.uneven_spec(bench.schedule("warm", 1)[-1]) is None
    assert runner.log_digest_name == "vllm-tp2-real-logs.txt" and runner.doc["issue"] == 45
    # TP 1 keeps its one socket path, daemon.json and port.
    single = bench.Bench(bench.parse_args(["--work", str(tmp_path / "w1")], {"OUT": "/o"}))
    cmd = single.daemon_command(0)
    assert cmd[cmd.index("--socket") + 1] == str(single.socket)
    assert "--tp-size" not in cmd and cmd[cmd.index("--http-address") + 1] == "127.0.0.1:8470"
    assert single.daemon_file(0).name == "daemon.json" and single.kill_rank == 0
    assert single.log_digest_name == "vllm-real-logs.txt" and single.doc["issue"] == 35


def test_the_daemons_command_line_parses_and_names_the_socket_each_rank_asks_for(
    tmp_path: Path,
) -> None:
    """The daemon derives its socket from --socket-dir/--cache and its GPU's UUID; the adapter's
    rank derives it from the loader config the engine is given: the same path."""
    from weightcache.daemon.cli import build_parser
    from weightcache.integrations.settings import AdapterSettings
    from weightcache.protocol import socket_path

    uuid = "GPU-0f0e0d0c-1111-2222-3333-444455556666"
    # A short folder: pytest's own is longer than a socket address may be.
    with tempfile.TemporaryDirectory(prefix="t2", dir="/tmp") as short:
        runner = bench.Bench(bench.parse_args(["--tp", "2", "--work", short],
                                              {"OUT": str(tmp_path)}))  # fmt: skip
        args = build_parser().parse_args(runner.daemon_command(1)[3:])
        assert (args.tp_size, args.tp_rank, args.shard_plan) == (2, 1, "llama")
        daemon_side = socket_path(args.socket_dir, *args.cache, uuid)
        settings = AdapterSettings.from_sources(
            {"socket_dir": str(runner.socket_dir), "cache": runner.cache,
             "transports": ["vmm_fd"], "fallback": False}, {})  # fmt: skip
        assert settings.socket_for(uuid, 2) == daemon_side
    # The default --work's sockets fit a Unix socket address.
    socket_path("/tmp/wc-vllm-tp2/sock", *engine_real.TP_CACHE.split("."), uuid)


def test_the_tp_2_file_is_named_for_the_gpus_once_env_has_read_them(tmp_path: Path) -> None:
    runner = tp2_bench(tmp_path)
    runner.save()
    assert (tmp_path / "out" / "vllm-tp2-real.json").exists()
    runner.doc["machine"] = {"gpu": H100_SMI}
    runner.save()
    saved = json.loads((tmp_path / "out" / "h100x2-vllm-tp2-real.json").read_text())
    assert saved["result_problems"] == [] and saved["issue"] == 45
    assert (tmp_path / "out" / "vllm-tp2-real-logs.txt").exists()
    # An --out given is kept as given.
    given = tp2_bench(tmp_path, "--out", str(tmp_path / "mine.json"))
    given.doc["machine"] = {"gpu": H100_SMI}
    given.save()
    assert (tmp_path / "mine.json").exists()


def test_the_uneven_buffer_is_left_alone_where_it_is_not_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(bench.UNEVEN_ENV, raising=False)
    assert bench._uneven("warm") == 0
    monkeypatch.setenv(bench.UNEVEN_ENV, json.dumps({"rank": 1, "bytes": X, "arm": "cold"}))
    assert bench._uneven("warm") == 0  # the warm arm's hook, a cold start's buffer
    monkeypatch.setattr(bench, "_tp_rank", lambda: 0)
    assert bench._uneven("cold") == 0  # another rank's
    assert "uneven" not in bench._PROBE and bench._HELD == []


def test_kill_9_ends_the_last_ranks_daemon_and_restarts_that_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = tp2_bench(tmp_path)
    daemons = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    engine_proc = subprocess.Popen(["sleep", "60"])
    restarted: list[int] = []
    try:
        for rank, proc in enumerate(daemons):
            engine_real.write_json(runner.daemon_file(rank), {"pid": proc.pid})
        monkeypatch.setattr(runner, "ensure_daemon", lambda: daemons[0].pid)
        monkeypatch.setattr(runner, "left", lambda: 1000.0)

        def start_daemon(why: str, rank: int = 0) -> dict:
            restarted.append(rank)
            return {"pid": 1, "status": {"load_source": "readopted"}}

        def start_engine(plan: bench.StartPlan, while_serving=None) -> dict:  # noqa: ANN001
            if while_serving is not None:
                events = tmp_path / "events"
                stop = threading.Event()

                def batches() -> None:  # an engine serving a batch every 50 ms
                    with events.open("a") as f:
                        while not stop.is_set():
                            f.write(json.dumps({"started": time.time(), "equal": True,
                                                "error": None}) + "\n")  # fmt: skip
                            f.flush()
                            time.sleep(0.05)

                thread = threading.Thread(target=batches)
                thread.start()
                try:
                    while_serving(events, engine_proc)
                finally:
                    stop.set()
                    thread.join()
                (runner.work / f"{plan.run}.events").write_text(events.read_text())
            record = start(plan.run, "warm", cold_and_warm(uneven=False)[1], counted=False)
            record["wall_s"] = 1.0
            return record

        monkeypatch.setattr(runner, "start_daemon", start_daemon)
        monkeypatch.setattr(runner, "start_engine", start_engine)
        runner.phase_kill9()
        kill = runner.doc["kill9"]
        assert kill["rank"] == 1 and kill["old_daemon_pid"] == daemons[1].pid
        assert kill["old_daemon_gone"] is True and restarted == [1]
        assert daemons[1].wait(5) == -9 and daemons[0].poll() is None  # rank 0's untouched
        assert kill["readopted"] is True and kill["batches"]["failed"] == 0
        assert kill["batches"]["without_a_daemon"] >= 3
    finally:
        for proc in [*daemons, engine_proc]:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
