"""Issue 3 on a real GPU: vmm_fd and torch_ipc parity, memory, read-only, death, leaks."""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.gpu.conftest import llama_config, minilm_dir
from weightcache.client import (
    DAEMON_DIED_EXIT_CODE,
    attach,
    daemon_status,
    load_into,
    meta_parameters,
)
from weightcache.daemon.resident import load_from_disk
from weightcache.devices import gpu_uuid

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.smoke,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

MiB = 1 << 20
TRANSPORTS = ["vmm_fd", "torch_ipc"]
CUDA = torch.device("cuda", 0)


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info(CUDA)[0]


def build_on_meta(factory):
    """Parameters on meta, buffers real on the GPU: what an engine does before attach."""
    with torch.device(CUDA), meta_parameters():
        return factory()


def minilm_outputs(model) -> torch.Tensor:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir())
    batch = tokenizer(
        ["weights stay resident", "engines restart fast", "a third, longer sentence here"],
        padding=True,
        return_tensors="pt",
    ).to(CUDA)
    with torch.inference_mode():
        return model(**batch).last_hidden_state


def llama_logits(model) -> torch.Tensor:
    tokens = torch.arange(64, device=CUDA).reshape(2, 32) * 37 % 8192
    with torch.inference_mode():
        return model(tokens).logits


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_minilm_through_cuda_transport_equals_plain_gpu_load(transport, daemon_factory):
    from transformers import BertConfig, BertModel

    daemon = daemon_factory(minilm_dir(), "--transport", transport)
    attached = attach(daemon.socket_path, transports=[transport], watchdog=False)
    assert attached.transport == transport
    config = BertConfig.from_pretrained(minilm_dir())
    model = build_on_meta(lambda: BertModel(config, add_pooling_layer=False))
    load_into(model, attached)
    reference = BertModel.from_pretrained(minilm_dir(), add_pooling_layer=False).to(CUDA)
    assert torch.equal(minilm_outputs(model.eval()), minilm_outputs(reference.eval()))
    word = model.embeddings.word_embeddings.weight
    assert word.data_ptr() == attached.tensors["embeddings.word_embeddings.weight"].data_ptr()


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_llama_logits_equal_cold_load_and_attach_costs_no_memory(
    transport, tied, daemon_factory, tmp_path
):
    from transformers import LlamaForCausalLM

    config = llama_config(tied)
    checkpoint = tmp_path / "llama"
    torch.manual_seed(1)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(checkpoint)
    daemon = daemon_factory(checkpoint, "--transport", transport)

    torch.set_default_dtype(torch.bfloat16)
    try:
        model = build_on_meta(lambda: LlamaForCausalLM(config))
    finally:
        torch.set_default_dtype(torch.float32)
    before = free_bytes()
    attached = attach(daemon.socket_path, transports=[transport], watchdog=False)
    load_into(model, attached)
    after = free_bytes()
    assert abs(before - after) < 2 * MiB, f"attach changed free device memory by {before - after}"
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight

    cold = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).to(CUDA)
    assert torch.equal(llama_logits(model.eval()), llama_logits(cold.eval()))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_preloaded_bytes_match_the_drivers_view(transport, llama_dir, daemon_factory):
    # A process's first load pays one-time CUDA costs (~70 MiB on an H200: loader
    # threads' streams, lazily loaded modules) that are not weights; pay them first.
    load_from_disk(llama_dir, CUDA, transport).close()
    gc.collect()
    torch.cuda.empty_cache()
    before = free_bytes()
    resident = load_from_disk(llama_dir, CUDA, transport)
    torch.cuda.empty_cache()
    used = before - free_bytes()
    held = resident.preloaded_weights_bytes
    resident.close()
    del resident
    gc.collect()
    # Rounding: the VMM granularity / the allocator's 2 MiB blocks.
    assert abs(used - held) <= 2 * MiB + 2 * MiB, f"driver saw {used}, daemon says {held}"

    daemon = daemon_factory(
        llama_dir, "--transport", transport, "--http-address", "127.0.0.1:18491"
    )
    via_status = daemon_status(daemon.socket_path).preloaded_weights_bytes
    with urllib.request.urlopen("http://127.0.0.1:18491/status") as response:
        via_http = json.load(response)["preloaded_weights_bytes"]
    attached = attach(daemon.socket_path, transports=[transport], watchdog=False)
    assert via_status == via_http == attached.preloaded_weights_bytes
    assert abs(via_status - held) <= 2 * MiB
    attached.close()


def test_auto_transport_prefers_vmm_fd_and_pins_by_uuid(llama_dir, tmp_path):
    from tests.gpu.conftest import DaemonProcess

    # pytest's tmp paths are too long for a socket address with a GPU UUID in it.
    run_dir = Path(tempfile.mkdtemp(prefix="wc", dir="/tmp"))
    uuid = gpu_uuid(0)
    log = tmp_path / "auto.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightcache.daemon.cli", "serve", "--model", str(llama_dir),
         "--socket-dir", str(run_dir), "--cache", "ns.llama", "--gpu-uuid", uuid,
         "--http-address", "none"],
        stdout=log.open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    daemon = DaemonProcess(str(run_dir / "ns.llama" / f"gpu-{uuid}.sock"), proc, log)
    try:
        daemon.wait_ready()
        status = daemon_status(daemon.socket_path)
        assert status.gpu == uuid
        assert status.transport_backend == "vmm_fd"
        assert attach(daemon.socket_path).transport == "vmm_fd"
    finally:
        daemon.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


WRITER = textwrap.dedent(
    """
    import sys, torch
    from weightcache.client import attach
    attached = attach(sys.argv[1], transports=["vmm_fd"], read_write=sys.argv[2] == "rw")
    tensor = attached.tensors[sys.argv[3]]
    tensor.add_(1)
    torch.cuda.synchronize()
    print("wrote")
    """
)


def test_vmm_fd_views_are_read_only_unless_asked(llama_dir, daemon_factory):
    name = "model.layers.0.mlp.down_proj.weight"
    original = load_file(llama_dir / "model.safetensors")[name].to(CUDA)
    daemon = daemon_factory(llama_dir, "--transport", "vmm_fd")

    denied = subprocess.run(
        [sys.executable, "-c", WRITER, daemon.socket_path, "ro", name],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert denied.returncode != 0 and "wrote" not in denied.stdout
    attached = attach(daemon.socket_path, transports=["vmm_fd"])
    assert torch.equal(attached.tensors[name], original), "daemon's copy changed"

    allowed = subprocess.run(
        [sys.executable, "-c", WRITER, daemon.socket_path, "rw", name],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert allowed.returncode == 0 and "wrote" in allowed.stdout, allowed.stderr
    assert torch.equal(attached.tensors[name], original + 1)
    attached.close()


def test_engine_survives_daemon_kill_under_vmm_fd(llama_dir, daemon_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(llama_dir)
    daemon = daemon_factory(llama_dir, "--transport", "vmm_fd")
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = build_on_meta(lambda: LlamaForCausalLM(config))
    finally:
        torch.set_default_dtype(torch.float32)
    attached = attach(daemon.socket_path, transports=["vmm_fd"])
    load_into(model, attached)
    before = llama_logits(model.eval())
    assert attached.daemon_alive()

    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait()
    assert not attached.daemon_alive()
    assert attached.degraded()
    torch.cuda.empty_cache()
    assert torch.equal(llama_logits(model), before)


ENGINE = textwrap.dedent(
    """
    import sys, time, torch
    from weightcache.client import attach
    attached = attach(sys.argv[1], transports=["torch_ipc"], watchdog_interval=0.2)
    print("attached", flush=True)
    while True:
        torch.cuda.synchronize()
        time.sleep(0.05)
    """
)


def test_torch_ipc_engine_fail_stops_when_daemon_dies(llama_dir, daemon_factory):
    daemon = daemon_factory(llama_dir, "--transport", "torch_ipc")
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE, daemon.socket_path],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = engine.stdout.readline().strip()
        if line != "attached":
            _, stderr = engine.communicate(timeout=30)
            pytest.fail(f"engine exited {engine.returncode} before attaching: {stderr}")
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait()
        assert engine.wait(timeout=60) == DAEMON_DIED_EXIT_CODE
        assert "exiting with code" in engine.stderr.read()
    finally:
        if engine.poll() is None:
            engine.kill()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def mapped_regions() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_hundred_attach_close_cycles_leak_nothing(transport, llama_dir, daemon_factory):
    daemon = daemon_factory(llama_dir, "--transport", transport)

    def cycle() -> None:
        attached = attach(daemon.socket_path, transports=[transport], watchdog=False)
        assert len(attached.tensors) > 0
        attached.close()

    cycle()  # first-use costs (CUDA IPC's ref-counter file, driver caches)
    gc.collect()
    fds, regions, free = open_fds(), mapped_regions(), free_bytes()
    for _ in range(100):
        cycle()
    gc.collect()
    time.sleep(0.5)
    assert open_fds() == fds
    assert mapped_regions() <= regions + 2
    assert abs(free_bytes() - free) < 2 * MiB
