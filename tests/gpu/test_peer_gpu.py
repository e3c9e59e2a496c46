"""Issue 20 on two GPUs: a daemon seeds its weights from its neighbour's GPU (vmm_fd).

One run (the module fixture ``seeding``) on a Llama-3-8B-shaped bf16
checkpoint (16 GB), daemons on GPU 0 and GPU 1 of one cache and socket
directory, each pinned by ``--gpu-uuid``:

1. GPU 0's daemon reads the checkpoint with the page cache dropped; GPU 1's
   daemon then seeds from it (device to device); an engine in this process,
   on GPU 1, runs the model through GPU 1's daemon and cold from disk, and
   the logits must be bit-equal; GPU 1's daemon is restarted twice more
   (peer loads), then twice with ``--no-peer-seed`` (page-cache loads);
2. a fresh cache directory, page cache dropped, both daemons started
   together: exactly one reads the checkpoint (``/proc/<pid>/io``), the
   other seeds from it.

Fault tests run on the small Llama of conftest.py. On a machine with one GPU
the second daemon runs on GPU 0 too, on a socket of its own: every check but
peer access and the NVLink copy (the figures say which GPUs). Figures go to
``$WEIGHTCACHE_RESULTS_DIR/peer_gpu.json``; nothing here asserts on time.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from benchmarks.checkpoints import write_llama_checkpoint
from benchmarks.machine import describe
from benchmarks.run import drop_page_cache
from benchmarks.tp_engine import build, prompt_ids, read_shard_from_disk
from benchmarks.tp_llama import LlamaShape, TPGroup
from tests.gpu.conftest import DaemonProcess
from weightcache.checkpoint import checkpoint_files
from weightcache.client import attach, daemon_status
from weightcache.daemon.seed import obtain_weights
from weightcache.daemon.statedir import prepare_state_dir
from weightcache.devices import gpu_uuid
from weightcache.layout import build_views
from weightcache.protocol import ShardSpec, socket_path

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

# Where the second daemon (and the engine) runs: GPU 1, or GPU 0 itself on a one-GPU machine
# (two daemons of one GPU, on sockets of their own: every check but peer access).
SECOND = torch.device("cuda", 1 if torch.cuda.device_count() >= 2 else 0)


def placements() -> tuple[list[str], list[str | None]]:
    """GPU UUIDs of the first and second daemon, and their socket names (None: the GPU's)."""
    uuids = [gpu_uuid(0), gpu_uuid(SECOND.index)]
    names = [None, None] if uuids[0] != uuids[1] else ["first.sock", "second.sock"]
    return uuids, names


COPIED = re.compile(r"copied ([\d.]+) GB in ([\d.]+) s \(([\d.]+) GB/s\), verified in ([\d.]+) s")


def io_counters(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


class Node:
    """Daemons of one cache on one node: one socket directory, one per GPU."""

    def __init__(self, root: Path, cache: str) -> None:
        self.root = root
        self.cache = cache
        self.started: list[DaemonProcess] = []

    def socket(self, uuid: str) -> str:
        namespace, name = self.cache.split(".")
        return socket_path(str(self.root / "sockets"), namespace, name, uuid)

    def start(
        self, model: Path, uuid: str, *args: str, tag: str, env: dict | None = None,
        wait: bool = True, name: str | None = None,
    ) -> DaemonProcess:  # fmt: skip
        """The daemon of GPU ``uuid``; with ``name``, on ``<dir>/<name>`` instead of the GPU's
        socket (two daemons of one GPU)."""
        log = self.root / f"{self.cache}-{tag}.log"
        where = self.socket(uuid)
        if name is not None:
            where = os.path.join(os.path.dirname(where), name)
        proc = subprocess.Popen(
            [sys.executable, "-m", "weightcache.daemon.cli", "serve", "--model", str(model),
             "--socket", where, "--gpu-uuid", uuid, "--transport", "vmm_fd",
             "--http-address", "none", *args],
            stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
        )  # fmt: skip
        daemon = DaemonProcess(where, proc, log)
        self.started.append(daemon)
        if wait:
            daemon.wait_ready(timeout=600)
        return daemon

    def stop_all(self) -> None:
        for daemon in self.started:
            daemon.stop()


def status_dict(daemon: DaemonProcess) -> dict:
    status = daemon_status(daemon.socket_path)
    return {
        "pid": status.pid,
        "load_source": status.load_source,
        "seeded_from": status.seeded_from,
        "load_seconds": status.load_seconds,
        "load_reason": status.load_reason,
        "preloaded_weights_bytes": status.preloaded_weights_bytes,
        "fingerprint": status.fingerprint,
    }


def engine_check(socket: str, model: Path) -> dict:
    """An engine on the second GPU: every tensor and the logits through the daemon at
    ``socket`` against a cold read of the checkpoint (safetensors, no weightcache code)."""
    shape = LlamaShape.from_checkpoint(model)
    ids = prompt_ids(shape.vocab_size).to(SECOND)
    cold_weights = read_shard_from_disk(model, ShardSpec(), SECOND)
    with torch.cuda.device(SECOND), torch.no_grad():
        attached = attach(socket, transports=["vmm_fd"], watchdog=False, handback=False)
        try:
            same_names = sorted(attached.tensors) == sorted(cold_weights)
            tensors_equal = same_names and all(
                torch.equal(attached.tensors[n], cold_weights[n]) for n in cold_weights
            )
            through = build(shape, TPGroup(), attached, torch.bfloat16)(ids).cpu()
        finally:
            attached.close()
        cold = build(shape, TPGroup(), cold_weights, torch.bfloat16)(ids).cpu()
    del cold_weights
    torch.cuda.empty_cache()
    return {
        "tensors_bit_equal": tensors_equal,
        "logits_bit_equal": torch.equal(through, cold),
        "finite": bool(torch.isfinite(through).all()),
    }


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


# --------------------------------------------------------------------------- faults
# On the small Llama (conftest.llama_dir), daemons of one socket directory.


@pytest.fixture
def node():
    root = Path(tempfile.mkdtemp(prefix="wcf-", dir="/tmp"))
    n = Node(root, "ns.fault")
    yield n
    n.stop_all()
    shutil.rmtree(root, ignore_errors=True)


def _small_llama_logits(module) -> torch.Tensor:
    tokens = torch.arange(64, device=SECOND).reshape(2, 32) * 37 % 8192
    with torch.inference_mode():
        return module.eval()(tokens).logits.cpu()


def small_logits(socket: str, model: Path) -> torch.Tensor:
    """The small Llama's logits on GPU 1, its weights from the daemon at ``socket``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from weightcache.client import load_into, meta_parameters

    config = LlamaConfig.from_pretrained(model)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(SECOND), meta_parameters():
            module = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.cuda.device(SECOND):
        attached = attach(socket, transports=["vmm_fd"], watchdog=False, handback=False)
        try:
            load_into(module, attached)
            return _small_llama_logits(module)
        finally:
            attached.close()


def cold_small_logits(model: Path) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    cold = LlamaForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to(SECOND)
    return _small_llama_logits(cold)


def test_a_neighbour_holding_other_weights_is_ignored(node, llama_dir) -> None:
    uuids, names = placements()
    other = node.start(llama_dir, uuids[0], "--dtype", "float16", tag="other", name=names[0])
    d1 = node.start(llama_dir, uuids[1], tag="second", name=names[1])
    status = daemon_status(d1.socket_path)
    assert status.load_source == "disk"
    assert f"(pid {other.proc.pid}): holds other weights" in status.load_reason
    assert torch.equal(small_logits(d1.socket_path, llama_dir), cold_small_logits(llama_dir))


CORRUPTER = """
import sys, torch
from weightcache.client import attach
with torch.cuda.device(0):
    attached = attach(sys.argv[1], transports=["vmm_fd"], watchdog=False, handback=False,
                      read_write=True)
    name = sorted(attached.tensors)[0]
    attached.tensors[name].view(torch.uint8)[:1].bitwise_xor_(1)
    torch.cuda.synchronize()
    attached.close()
print("flipped", flush=True)
"""


def test_a_corrupted_neighbour_allocation_is_caught_by_the_checksum(node, llama_dir) -> None:
    uuids, names = placements()
    d0 = node.start(llama_dir, uuids[0], tag="first", name=names[0])
    done = subprocess.run([sys.executable, "-c", CORRUPTER, d0.socket_path],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.stdout.strip() == "flipped", done.stderr
    d1 = node.start(llama_dir, uuids[1], tag="second", name=names[1])
    status = daemon_status(d1.socket_path)
    assert status.load_source == "disk", status.load_reason
    assert "does not match its manifest" in status.load_reason
    assert torch.equal(small_logits(d1.socket_path, llama_dir), cold_small_logits(llama_dir))


@TWO_GPUS
def test_a_neighbour_gpu_this_daemon_cannot_see_means_the_disk(node, llama_dir) -> None:
    uuids = [gpu_uuid(0), gpu_uuid(1)]
    node.start(llama_dir, uuids[0], tag="gpu0")
    # One GPU per container, as device-plugin access gives.
    d1 = node.start(llama_dir, uuids[1], tag="gpu1", env={"CUDA_VISIBLE_DEVICES": uuids[1]})
    status = daemon_status(d1.socket_path)
    assert status.load_source == "disk"
    assert f"its GPU {uuids[0]} is not visible to this daemon" in status.load_reason


def seeding_device() -> torch.device:
    """Where this process seeds: GPU 1 (from GPU 0) where there are two, else GPU 0 itself."""
    return SECOND


def obtain_here(node: Node, model: Path, progress):
    """This process as the seeding daemon, on its own socket of the node's directory."""
    device = seeding_device()
    socket = os.path.join(os.path.dirname(node.socket(gpu_uuid(0))), "here.sock")
    prepare_state_dir(socket)
    return obtain_weights(
        socket, gpu_uuid(device.index), model, device, "vmm_fd", timeout=10.0, progress=progress
    )


def killer(daemon: DaemonProcess, prefix: str):
    def progress(phase: str | None = None) -> None:
        if phase and phase.startswith(prefix) and daemon.proc.poll() is None:
            daemon.proc.send_signal(signal.SIGKILL)
            daemon.proc.wait()

    return progress


def first_tensors_equal_cold(obtained, model: Path) -> bool:
    views = build_views(obtained.resident.memory.buffers, obtained.resident.layout)
    cold = read_shard_from_disk(model, ShardSpec(), seeding_device())
    return all(torch.equal(views[n], cold[n]) for n in cold)


@pytest.mark.parametrize(
    ("phase", "source"), [("asking", "disk"), ("copying from", "peer")]
)  # fmt: skip
def test_a_neighbour_killed_during_seeding_never_spoils_the_weights(
    node, llama_dir, phase, source
) -> None:
    d0 = node.start(llama_dir, gpu_uuid(0), tag="gpu0")
    obtained = obtain_here(node, llama_dir, killer(d0, phase))
    try:
        assert d0.proc.returncode == -signal.SIGKILL
        # Killed before its fds arrived: the disk. Killed once they were here: its memory
        # outlives it while mapped, and the checksums vouch for the copy.
        assert obtained.resident.load_source == source, obtained.reason
        assert first_tensors_equal_cold(obtained, llama_dir)
    finally:
        obtained.release()
        obtained.resident.close()


def test_two_daemons_of_one_gpu_seed_each_other_over_vmm_fd(node, llama_dir) -> None:
    """The vmm_fd path without peer access (one GPU, two sockets): seeding, the engine's
    logits, daemons started together, and a corrupted neighbour caught."""
    from tests.gpu.test_readopt_gpu import cold_logits, logits_through_daemon

    uuid = gpu_uuid(0)
    cold = cold_logits(llama_dir)
    pair = [node.start(llama_dir, uuid, tag=f"one{i}", name=f"one-{i}.sock", wait=False)
            for i in range(2)]  # fmt: skip
    for daemon in pair:
        daemon.wait_ready()
    statuses = [daemon_status(d.socket_path) for d in pair]
    assert sorted(s.load_source for s in statuses) == ["disk", "peer"], [
        s.load_reason for s in statuses
    ]
    seeded = next(d for d, s in zip(pair, statuses, strict=True) if s.load_source == "peer")
    assert daemon_status(seeded.socket_path).seeded_from == uuid
    assert torch.equal(logits_through_daemon(seeded.socket_path, llama_dir), cold)

    done = subprocess.run([sys.executable, "-c", CORRUPTER, seeded.socket_path],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.stdout.strip() == "flipped", done.stderr
    reader = next(d for d in pair if d is not seeded)
    reader.stop()  # the only neighbour left is the corrupted one
    third = node.start(llama_dir, uuid, tag="one2", name="one-2.sock")
    status = daemon_status(third.socket_path)
    assert status.load_source == "disk", status.load_reason
    assert "does not match its manifest" in status.load_reason
    assert torch.equal(logits_through_daemon(third.socket_path, llama_dir), cold)


# --------------------------------------------------------------------------- 16 GB, last:
# its fixture writes the checkpoint and runs the whole sequence once.


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> Path:
    return write_llama_checkpoint(tmp_path_factory.mktemp("llama8b"))


@pytest.fixture(scope="module")
def seeding(big_model: Path) -> dict:
    root = Path(tempfile.mkdtemp(prefix="wcp-", dir="/tmp"))
    uuids, names = placements()
    files = checkpoint_files(big_model)
    size = sum(p.stat().st_size for p in files)
    figures: dict = {"machine": describe(str(big_model)), "checkpoint_bytes": size, "gpus": uuids}
    node = Node(root, "ns.peer")
    together = Node(root, "ns.together")
    try:
        # 1. One after the other.
        figures["page_cache_drop"] = drop_page_cache(files)
        started = time.perf_counter()
        d0 = node.start(big_model, uuids[0], tag="first", name=names[0])
        figures["disk_cold"] = {**status_dict(d0), "spawn_to_ready": time.perf_counter() - started,
                                "io": io_counters(d0.proc.pid)}  # fmt: skip
        peer_runs = []
        for run in range(3):
            started = time.perf_counter()
            d1 = node.start(big_model, uuids[1], tag=f"second-peer{run}", name=names[1])
            peer_runs.append({**status_dict(d1), "spawn_to_ready": time.perf_counter() - started,
                              "io": io_counters(d1.proc.pid)})  # fmt: skip
            if run == 0:
                figures["engine"] = engine_check(d1.socket_path, big_model)
            d1.stop()
        figures["peer"] = peer_runs
        warm_runs = []
        for run in range(2):
            d1 = node.start(
                big_model, uuids[1], "--no-peer-seed", tag=f"second-warm{run}", name=names[1]
            )
            warm_runs.append(status_dict(d1))
            d1.stop()
        figures["disk_warm"] = warm_runs
        d0.stop()

        # 2. Together, page cache dropped.
        figures["together_page_cache_drop"] = drop_page_cache(files)
        pair = [together.start(big_model, u, tag=f"d{i}", wait=False, name=n)
                for i, (u, n) in enumerate(zip(uuids, names, strict=True))]  # fmt: skip
        for daemon in pair:
            daemon.wait_ready(timeout=600)
        figures["together"] = [{**status_dict(d), "gpu": u, "io": io_counters(d.proc.pid)}
                               for d, u in zip(pair, uuids, strict=True)]  # fmt: skip
    finally:
        node.stop_all()
        together.stop_all()
        logs = {p.name: p.read_text(errors="replace")[-4000:] for p in root.glob("*.log")}
        figures["logs"] = logs
        out = os.environ.get("WEIGHTCACHE_RESULTS_DIR")
        if out:
            summarise(figures)
            Path(out, "peer_gpu.json").write_text(json.dumps(figures, indent=1, default=str))
        shutil.rmtree(root, ignore_errors=True)
    return figures


def summarise(figures: dict) -> None:
    """Rates from what the run recorded (for the benchmarks table; never asserted on)."""
    size = figures["checkpoint_bytes"]
    summary: dict = {}
    if "disk_cold" in figures:
        cold = figures["disk_cold"]["load_seconds"]
        summary["disk_cold"] = {"seconds": cold, "gb_per_s": size / cold / 1e9}
    if figures.get("disk_warm"):
        warm = median([r["load_seconds"] for r in figures["disk_warm"]])
        summary["disk_warm_median"] = {"seconds": warm, "gb_per_s": size / warm / 1e9}
    if figures.get("peer"):
        loads = [r["load_seconds"] for r in figures["peer"]]
        parsed = [COPIED.search(r["load_reason"] or "") for r in figures["peer"]]
        summary["peer_load_median"] = {
            "seconds": median(loads), "gb_per_s": size / median(loads) / 1e9,
            "samples": loads,
        }  # fmt: skip
        if all(parsed):
            copies = [float(m.group(2)) for m in parsed]
            verifies = [float(m.group(4)) for m in parsed]
            summary["peer_copy_median"] = {
                "seconds": median(copies), "gb_per_s": size / median(copies) / 1e9,
                "samples": copies,
            }  # fmt: skip
            summary["peer_verify_median"] = {"seconds": median(verifies), "samples": verifies}
        summary["peer_spawn_to_ready"] = [r["spawn_to_ready"] for r in figures["peer"]]
    figures["summary"] = summary


def test_the_second_daemon_seeds_from_the_first(seeding: dict) -> None:
    cold = seeding["disk_cold"]
    assert cold["load_source"] == "disk", cold["load_reason"]
    gpu0, gpu1 = seeding["gpus"]
    for run in seeding["peer"]:
        assert run["load_source"] == "peer", run["load_reason"]
        assert run["seeded_from"] == gpu0
        assert f"pid {cold['pid']}" in run["load_reason"]
        assert run["preloaded_weights_bytes"] == cold["preloaded_weights_bytes"]
        assert run["fingerprint"] == cold["fingerprint"]
        # Seeding reads no tensor bytes: less than 1 % of the checkpoint from storage.
        assert run["io"]["read_bytes"] < seeding["checkpoint_bytes"] / 100
    for run in seeding["disk_warm"]:
        assert run["load_source"] == "disk" and "peer seeding is off" in run["load_reason"]


def test_an_engine_on_the_seeded_gpu_gets_the_cold_logits(seeding: dict) -> None:
    engine = seeding["engine"]
    assert engine["finite"]
    assert engine["tensors_bit_equal"]
    assert engine["logits_bit_equal"]


def test_started_together_exactly_one_reads_the_checkpoint(seeding: dict) -> None:
    size = seeding["checkpoint_bytes"]
    runs = {r["load_source"]: r for r in seeding["together"]}
    assert sorted(runs) == ["disk", "peer"], [r["load_reason"] for r in seeding["together"]]
    reader, seeder = runs["disk"], runs["peer"]
    assert seeder["seeded_from"] == reader["gpu"]
    assert f"pid {reader['pid']}" in seeder["load_reason"]
    # The reader's read() calls covered the checkpoint; the seeder's did not come close.
    assert reader["io"]["rchar"] >= size
    assert seeder["io"]["rchar"] < size / 100
    if seeding["together_page_cache_drop"] == "drop_caches":
        # With the page cache dropped, storage reads prove the same. Both processes also
        # fault their libraries (torch, CUDA) back in from storage: ~0.14 GB on an H200 VM.
        assert reader["io"]["read_bytes"] - seeder["io"]["read_bytes"] >= 0.9 * size
        assert seeder["io"]["read_bytes"] < size / 20
