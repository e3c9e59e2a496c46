"""Issue 16: tensor parallel on two GPUs, one rank daemon per GPU, an NCCL TP=2 engine.

One run (the module fixture) on a Llama-3-8B-shaped bf16 checkpoint (16 GB,
~8 GB per rank), then assertions on what it recorded:

1. three daemons, each pinned by ``--gpu-uuid``, vmm_fd: rank 0's shard on
   GPU 0, rank 1's shard on GPU 1, and on GPU 1 also a second cache holding the
   whole model for an extra runner of rank 1 only (so the ranks hold different
   amounts);
2. a TP=2 engine (benchmarks.tp_engine, one process per GPU, NCCL): each rank
   finds its daemon by its own GPU's UUID, attaches its shard, builds the
   Megatron-style forward of benchmarks.tp_llama on meta, ``load_into``, runs
   it; its KV baseline is sampled from real free memory, corrected with the
   rank's own preloaded bytes, then MIN over NCCL (and, for comparison, the
   other order);
3. kill -9 of rank 1's daemon: the engine keeps serving; the restarted daemon
   re-adopts rank 1's shard from rank 1's engine; both ranks attach again;
4. the daemons stop, and the same TP=2 engine starts cold: each rank reads its
   shard from disk (safetensors slices) into the same model code.

Logits through the daemons must equal the cold engine's bit for bit (same
model code, same shards, same NCCL reduction). The corrected KV baseline must
equal the cold engine's up to the daemons' own CUDA contexts, which this
process measures separately (free memory before and after each daemon, less
its weights). Figures go to $WEIGHTCACHE_RESULTS_DIR/tp2_gpu.json.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from benchmarks.checkpoints import LLAMA3_8B, write_llama_checkpoint
from benchmarks.machine import describe
from benchmarks.tp_engine import NO_MULTICAST, EngineRanks
from tests.gpu.conftest import DaemonProcess, start_daemon
from weightcache.checkpoint import read_checkpoint
from weightcache.client import daemon_status
from weightcache.devices import gpu_uuid
from weightcache.kv import cuda_free_bytes
from weightcache.protocol import ShardSpec, socket_path
from weightcache.shard import plan_shards

TP = 2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < TP, reason="needs 2 CUDA devices"),
]

MiB = 1 << 20
# Free-memory readings that must agree: the driver's 2 MiB pages, a few of them.
SAME_MEMORY = 8 * MiB
F = 0.85
# Llama-3-8B KV per token per rank: 32 layers x (8 / TP) KV heads x 128 x (K, V) x 2 bytes.
BYTES_PER_TOKEN = 32 * (8 // TP) * 128 * 2 * 2
PAGE_SIZE = 16


def _compute_apps() -> list[dict] | None:
    """Device memory per process and GPU, as the driver reports it (None: no nvidia-smi)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    done = subprocess.run(
        [smi, "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    apps = []
    for line in done.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit():
            apps.append({"pid": int(parts[0]), "gpu": parts[1], "used_mib": parts[2]})
    return apps


def _logits(reply: dict) -> torch.Tensor:
    return load_file(reply["logits"])["logits"]


def _status(daemon: DaemonProcess) -> dict:
    return msgspec.to_builtins(daemon_status(daemon.socket_path))


def _started(tmp: Path, model: Path, args: list[str], name: str, sock: str):
    started = time.perf_counter()
    daemon = start_daemon(tmp, model, *args, name=name, socket_path=sock)
    return daemon, time.perf_counter() - started


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The whole run; its figures are written even when it fails part way."""
    figures: dict = {}
    try:
        _run(tmp_path_factory.mktemp("tp2"), figures)
    except BaseException as exc:
        figures["error"] = repr(exc)
        raise
    finally:
        text = json.dumps(figures, indent=2)
        print(text)
        results = os.environ.get("WEIGHTCACHE_RESULTS_DIR")
        if results:
            Path(results).mkdir(parents=True, exist_ok=True)
            Path(results, "tp2_gpu.json").write_text(text + "\n")
    return figures


def _run(work: Path, figures: dict) -> None:
    for key, value in NO_MULTICAST.items():
        os.environ[key] = value  # the daemons inherit it too
    logs = work / "logs"
    logs.mkdir()
    started = time.perf_counter()
    model = write_llama_checkpoint(work / "llama8b")
    write_s = time.perf_counter() - started
    checkpoint = read_checkpoint(model)
    whole = sum(t.nbytes for t in checkpoint.tensors)
    specs = [ShardSpec(tp_size=TP, tp_rank=r, plan="llama") for r in range(TP)]
    shard_bytes = [
        sum(s.nbytes for s in plan_shards(checkpoint.tensors, spec).values()) for spec in specs
    ]
    devices = [torch.device("cuda", r) for r in range(TP)]
    uuids = [gpu_uuid(r) for r in range(TP)]
    # This process keeps a context on both GPUs from here on, in every phase alike.
    run_dir = Path(tempfile.mkdtemp(prefix="wct-", dir="/tmp"))  # short socket paths
    sockets = [socket_path(str(run_dir), "tp", "llama", u) for u in uuids]
    extra_socket = socket_path(str(run_dir), "tp", "extra", uuids[1])
    out = work / "logits"
    out.mkdir()

    def free() -> list[int]:
        return [cuda_free_bytes(d) for d in devices]

    daemon_args = {
        f"rank{r}": ["--gpu-uuid", uuids[r], "--transport", "vmm_fd", "--tp-size", str(TP),
                     "--tp-rank", str(r), "--shard-plan", "llama"]
        for r in range(TP)
    }  # fmt: skip
    daemon_args["extra"] = ["--gpu-uuid", uuids[1], "--transport", "vmm_fd"]
    daemon_sockets = {"rank0": sockets[0], "rank1": sockets[1], "extra": extra_socket}
    daemon_gpu = {"rank0": 0, "rank1": 1, "extra": 1}

    figures.update({
        "machine": describe(str(work)),
        "gpus": [
            {"index": r, "name": torch.cuda.get_device_name(r), "uuid": uuids[r]} for r in range(TP)
        ],
        "date": time.strftime("%Y-%m-%d"),
        "env": {k: os.environ.get(k) for k in NO_MULTICAST},
        "checkpoint": {
            "shape": asdict(LLAMA3_8B),
            "tensors": len(checkpoint.tensors),
            "bytes": whole,
            "shard_bytes": shard_bytes,
            "write_s": write_s,
        },
        "daemons": {},
    })  # fmt: skip
    daemons: dict[str, DaemonProcess] = {}
    free_empty = free()
    figures["free_empty"] = free_empty
    try:
        # One at a time, so each daemon's non-weight memory (its CUDA context) is its own.
        for name in ("rank0", "rank1", "extra"):
            gpu = daemon_gpu[name]
            before = free()
            daemons[name], seconds = _started(
                logs, model, daemon_args[name], name, daemon_sockets[name]
            )
            after = free()
            status = _status(daemons[name])
            figures["daemons"][name] = {
                "gpu_index": gpu,
                "spawn_to_ready_s": seconds,
                "status": status,
                "free_drop_by_gpu": [b - a for b, a in zip(before, after, strict=True)],
                "non_weight_bytes": before[gpu] - after[gpu] - status["preloaded_weights_bytes"],
            }
        free_with_daemons = free()
        preloaded_on = [
            sum(figures["daemons"][n]["status"]["preloaded_weights_bytes"]
                for n in daemons if daemon_gpu[n] == r)
            for r in range(TP)
        ]  # fmt: skip
        figures["daemon_non_weight_bytes_by_gpu"] = [
            free_empty[r] - free_with_daemons[r] - preloaded_on[r] for r in range(TP)
        ]

        common = ["--backend", "nccl", "--model", str(model), "--out", str(out),
                  "--mem-fraction", str(F), "--bytes-per-token", str(BYTES_PER_TOKEN),
                  "--page-size", str(PAGE_SIZE)]  # fmt: skip
        extra_args = ["--extra-model", str(model)]
        warm_args = [
            [*common, "--device", f"cuda:{r}", "--socket-dir", str(run_dir), "--cache", "tp.llama",
             "--tag", "attached", *(["--extra-socket", extra_socket, *extra_args] if r else [])]
            for r in range(TP)
        ]  # fmt: skip
        with EngineRanks(warm_args, logs, "warm") as engine:
            figures["warm"] = engine.replies()
            figures["compute_apps"] = _compute_apps()
            figures["roles"] = {
                **{str(d.proc.pid): f"daemon {n}" for n, d in daemons.items()},
                **{str(pid): f"engine rank {r}" for r, pid in enumerate(engine.pids)},
                str(os.getpid()): "pytest",
            }

            killed = daemons["rank1"]
            killed.proc.send_signal(signal.SIGKILL)
            killed.proc.wait()
            figures["after_kill"] = engine.command("forward after-kill")

            daemons["rank1"], seconds = _started(
                logs, model, daemon_args["rank1"], "rank1-restarted", sockets[1]
            )
            figures["daemons"]["rank1_restarted"] = {
                "gpu_index": 1,
                "spawn_to_ready_s": seconds,
                "status": _status(daemons["rank1"]),
            }
            figures["readopted"] = engine.command("reattach readopted")
            figures["warm_engine_pids"] = engine.pids
    finally:
        for daemon in daemons.values():
            daemon.stop()
    figures["free_after_stop"] = free()

    cold_args = [
        [*common, "--device", f"cuda:{r}", "--tag", "cold", *(extra_args if r else [])]
        for r in range(TP)
    ]
    with EngineRanks(cold_args, logs, "cold") as cold:
        figures["cold"] = cold.replies()

    reference = _logits(figures["cold"][0])
    compared = {}
    for phase in ("warm", "after_kill", "readopted", "cold"):
        for reply in figures[phase]:
            got = _logits(reply)
            compared[f"{phase}/rank{reply['rank']}"] = {
                "equal": torch.equal(got, reference),
                "max_abs_diff": float((got.float() - reference.float()).abs().max()),
            }
    figures["logits"] = {
        "shape": list(reference.shape),
        "dtype": str(reference.dtype),
        "vs_cold_rank0": compared,
    }
    figures["kv_summary"] = _kv_summary(figures)
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(model, ignore_errors=True)  # 16 GB


def _kv_summary(figures: dict) -> dict:
    warm = [r["kv"] for r in figures["warm"]]
    cold = [r["kv"] for r in figures["cold"]]
    return {
        "cold_minus_corrected_by_rank": [
            c["pre_load_free_raw"] - w["corrected"] for w, c in zip(warm, cold, strict=True)
        ],
        "daemon_non_weight_bytes_by_gpu": figures["daemon_non_weight_bytes_by_gpu"],
        "correct_then_min": [w["correct_then_min"] for w in warm],
        "min_then_correct": [w["min_then_correct"] for w in warm],
        "cold_min": [c["correct_then_min"] for c in cold],
        "tokens_correct_then_min": [w["tokens_correct_then_min"] for w in warm],
        "tokens_min_then_correct": [w["tokens_min_then_correct"] for w in warm],
        "tokens_cold": [c["tokens_correct_then_min"] for c in cold],
    }


# --------------------------------------------------------------------------- 1. daemons


def test_each_rank_daemon_is_pinned_to_its_gpu_and_holds_only_its_shard(tp_run) -> None:
    daemons = tp_run["daemons"]
    shard, whole = tp_run["checkpoint"]["shard_bytes"], tp_run["checkpoint"]["bytes"]
    assert shard[0] == shard[1] < whole
    for name in ("rank0", "rank1", "extra"):
        d = daemons[name]
        status = d["status"]
        assert status["gpu"] == tp_run["gpus"][d["gpu_index"]]["uuid"]
        assert status["state"] == "ready" and status["transport_backend"] == "vmm_fd"
        expected = whole if name == "extra" else shard[d["gpu_index"]]
        assert status["expected_bytes"] == expected, name
        # vmm_fd: the allocations, each rounded up to the 2 MiB granularity.
        assert 0 <= status["preloaded_weights_bytes"] - expected < 2 * MiB * 4, name
        # Loading touched only the daemon's own GPU.
        other = 1 - d["gpu_index"]
        assert abs(d["free_drop_by_gpu"][other]) <= SAME_MEMORY, (name, d["free_drop_by_gpu"])
    apps = tp_run["compute_apps"]
    if apps:  # the driver names each process's GPUs: every daemon on its own GPU only
        for name in ("rank0", "rank1", "extra"):
            pid = daemons[name]["status"]["pid"]
            gpus = {a["gpu"] for a in apps if a["pid"] == pid}
            assert gpus == {tp_run["gpus"][daemons[name]["gpu_index"]]["uuid"]}, (name, apps)


# --------------------------------------------------------------------------- 2. the engine


def test_each_rank_attaches_its_own_gpus_daemon_zero_copy(tp_run) -> None:
    for rank, reply in enumerate(tp_run["warm"]):
        assert reply["gpu_uuid"] == tp_run["gpus"][rank]["uuid"]
        assert reply["socket"].endswith(f"/tp.llama/gpu-{reply['gpu_uuid']}.sock")
        assert reply["daemon_pid"] == tp_run["daemons"][f"rank{rank}"]["status"]["pid"]
        assert reply["transport"] == "vmm_fd"
        assert reply["held_bytes"] == tp_run["checkpoint"]["shard_bytes"][rank]
        assert reply["zero_copy"]
        # Attaching and building the module cost the engine no device memory.
        assert abs(reply["kv"]["weights_cost_bytes"]) <= SAME_MEMORY, reply["kv"]


def test_tp2_logits_through_the_daemons_equal_the_cold_tp2_engines_bit_for_bit(tp_run) -> None:
    logits = tp_run["logits"]
    assert logits["shape"] == [2, 64, LLAMA3_8B.vocab_size]
    assert all(r["finite"] for phase in ("warm", "cold") for r in tp_run[phase])
    assert [r["mode"] for r in tp_run["cold"]] == ["cold"] * TP
    unequal = {k: v for k, v in logits["vs_cold_rank0"].items() if not v["equal"]}
    assert not unequal


# --------------------------------------------------------------------------- 3. KV baseline


def test_correct_then_min_equals_the_cold_start_up_to_the_daemons_contexts(tp_run) -> None:
    kv = tp_run["kv_summary"]
    assert len(set(kv["correct_then_min"])) == 1 and len(set(kv["cold_min"])) == 1
    for rank in range(TP):
        gap = kv["cold_minus_corrected_by_rank"][rank]
        contexts = kv["daemon_non_weight_bytes_by_gpu"][rank]
        assert contexts > 0
        assert abs(gap - contexts) <= SAME_MEMORY, (rank, gap, contexts)
    # Every daemon freed everything it held once stopped.
    for empty, after in zip(tp_run["free_empty"], tp_run["free_after_stop"], strict=True):
        assert abs(empty - after) <= SAME_MEMORY


def test_min_then_correct_is_wrong_when_the_ranks_hold_different_amounts(tp_run) -> None:
    kv = tp_run["kv_summary"]
    extra = tp_run["daemons"]["extra"]["status"]["preloaded_weights_bytes"]
    own = [r["kv"]["preloaded_bytes"] for r in tp_run["warm"]]
    assert len(own[0]) == 1 and len(own[1]) == 2  # rank 1 also holds the extra runner
    wrong = kv["min_then_correct"]
    # The ranks no longer agree on one baseline, and rank 0's is short by the extra
    # runner that only rank 1 holds: its headroom shrinks, its KV pool over-allocates.
    assert wrong[0] != wrong[1]
    assert kv["cold_min"][0] - wrong[0] >= extra
    assert kv["tokens_min_then_correct"][0] > kv["tokens_cold"][0]
    assert kv["tokens_correct_then_min"][0] <= kv["tokens_cold"][0]


# --------------------------------------------------------------------------- 4. kill -9


def test_a_killed_rank_daemons_engine_keeps_serving_and_the_restart_readopts(tp_run) -> None:
    after_kill = tp_run["after_kill"]
    # Rank 1's own daemon is gone (its extra runner's is not); rank 0's is untouched.
    assert [r["daemon_alive"] for r in after_kill] == [[True], [False, True]]
    assert all(r["finite"] for r in after_kill)

    restarted = tp_run["daemons"]["rank1_restarted"]["status"]
    first = tp_run["daemons"]["rank1"]["status"]
    rank1_engine = tp_run["warm_engine_pids"][1]
    assert restarted["readopted"] and restarted["load_source"] == "readopted"
    assert f"engine pid {rank1_engine}" in restarted["load_reason"], restarted["load_reason"]
    assert restarted["fingerprint"] == first["fingerprint"]
    assert restarted["preloaded_weights_bytes"] == first["preloaded_weights_bytes"]
    assert restarted["gpu"] == first["gpu"]

    readopted = tp_run["readopted"]
    assert readopted[1]["daemon_pid"] == restarted["pid"]
    assert readopted[0]["daemon_pid"] == tp_run["daemons"]["rank0"]["status"]["pid"]
    assert all(r["zero_copy"] for r in readopted)
