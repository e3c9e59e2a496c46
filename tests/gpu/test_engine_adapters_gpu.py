"""Issue 17 on a GPU: the engine adapters' shared attach-and-load path, Llama, both GPU transports.

Real vLLM/SGLang cannot be carried to the GPU machine (their wheels exceed
the transfer limit), so this runs what both adapters share
(weightcache.integrations: settings -> per-GPU socket -> expected CacheConfig
-> one attach decision -> zero-copy load) through a transformers Llama built
with parameters on meta, against a daemon pinned by GPU UUID, and compares
logits with a cold load bit for bit. The memfd case runs the same code on CPU
(so it also runs where there is no GPU).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from tests.gpu.conftest import DaemonProcess, llama_config
from weightcache.client import daemon_status, meta_parameters
from weightcache.integrations import loading
from weightcache.integrations.loading import (
    EngineTarget,
    attachment,
    expected_configs,
    load_from_daemon,
    still_mapped,
)
from weightcache.integrations.settings import AdapterSettings

MiB = 1 << 20
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
CASES = [
    pytest.param("cuda", "vmm_fd", marks=[pytest.mark.gpu, pytest.mark.smoke, needs_cuda]),
    pytest.param("cuda", "torch_ipc", marks=[pytest.mark.gpu, pytest.mark.smoke, needs_cuda]),
    pytest.param("cpu", "memfd"),
]


def free_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]


def meta_llama(config, device: torch.device):
    """A bf16 transformers Llama built as engines build theirs: ``device`` the default,
    parameters moved to meta as they register."""
    from transformers import LlamaForCausalLM

    torch.set_default_dtype(torch.bfloat16)
    try:
        with device, meta_parameters():
            return LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)


def llama_logits(model, device: torch.device) -> torch.Tensor:
    tokens = torch.arange(64, device=device).reshape(2, 32) * 37 % 8192
    with torch.inference_mode():
        return model(tokens).logits


@pytest.fixture
def run_dir():
    # pytest's tmp paths are too long for a socket address with a GPU UUID in it.
    path = Path(tempfile.mkdtemp(prefix="wc", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize(("device_type", "transport"), CASES)
def test_adapter_path_maps_llama_bit_equal_to_a_cold_load(
    device_type, transport, tied, run_dir, tmp_path
):
    from transformers import LlamaForCausalLM

    from weightcache.devices import gpu_uuid

    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    uuid = gpu_uuid(0) if device_type == "cuda" else None
    config = llama_config(tied)
    checkpoint = tmp_path / "llama"
    torch.manual_seed(2)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(checkpoint)

    where = ["--gpu-uuid", uuid] if uuid else ["--device", "cpu"]
    log = tmp_path / "daemon.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightcache.daemon.cli", "serve", "--model", str(checkpoint),
         "--socket-dir", str(run_dir), "--cache", "ns.llama", *where,
         "--transport", transport, "--http-address", "none"],
        stdout=log.open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    daemon = DaemonProcess("", proc, log)
    try:
        # What an engine rank does, from its loader config: the daemon may still be loading.
        settings = AdapterSettings.from_sources(
            {"socket_dir": str(run_dir), "cache": "ns.llama", "transports": [transport],
             "wait_ready_s": 120},
            {},
        )  # fmt: skip
        socket = settings.socket_for(uuid)
        leaf = f"gpu-{uuid}.sock" if uuid else "cpu.sock"
        assert socket == str(run_dir / "ns.llama" / leaf)
        target = EngineTarget(model_dir=checkpoint, dtype=torch.bfloat16, device=device)
        try:
            decided = attachment(settings, socket, expected_configs(target))
        except Exception as exc:
            raise AssertionError(f"attach failed: {exc}\ndaemon log:\n{log.read_text()}") from exc
        attached = decided.attached
        assert attached is not None and attached.transport == transport
        status = daemon_status(socket)
        assert decided.preloaded_weights_bytes == status.preloaded_weights_bytes > 0
        assert status.gpu == (uuid or "cpu")

        model = meta_llama(config, device)
        before = free_bytes(device)
        report = load_from_daemon(model, attached.tensors, device)
        after = free_bytes(device)
        if before is not None:
            assert abs(before - after) < 2 * MiB, f"load changed free memory by {before - after}"
        assert report.copied == [] and report.unused == []
        assert still_mapped(model, report, attached.tensors) == []
        if tied:
            assert model.lm_head.weight is model.model.embed_tokens.weight

        cold = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).to(device)
        assert torch.equal(llama_logits(model.eval(), device), llama_logits(cold.eval(), device))
        del model, cold
    finally:
        loading.forget_attachments()
        daemon.stop()


@pytest.mark.gpu
@pytest.mark.smoke
@needs_cuda
def test_the_layout_decision_leaves_the_device_as_the_engine_found_it(run_dir, tmp_path):
    """Issue 41: vLLM takes its memory snapshot right after the layout decision. The trace
    builds a throwaway model with the GPU as the default device, as engines build theirs,
    so each parameter is allocated there before it moves to meta; the decision must give
    all of it back, or the engine's later load releases it and its profiler finds more
    free memory than at its snapshot. What remains is the mapping's page tables."""
    from transformers import LlamaForCausalLM

    from weightcache.checkpoint import checkpoint_sources, read_checkpoint
    from weightcache.devices import gpu_uuid
    from weightcache.integrations import layouts
    from weightcache.integrations.trace import trace_load

    device, uuid = torch.device("cuda", 0), gpu_uuid(0)
    config = llama_config()
    checkpoint = tmp_path / "llama"
    torch.manual_seed(3)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(checkpoint)
    log = tmp_path / "daemon.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightcache.daemon.cli", "serve", "--model", str(checkpoint),
         "--socket-dir", str(run_dir), "--cache", "ns.llama", "--gpu-uuid", uuid,
         "--transport", "vmm_fd", "--http-address", "none"],
        stdout=log.open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    daemon = DaemonProcess("", proc, log)
    settings = AdapterSettings.from_sources(
        {"socket_dir": str(run_dir), "cache": "ns.llama", "transports": ["vmm_fd"],
         "wait_ready_s": 120}, {},
    )  # fmt: skip
    socket = settings.socket_for(uuid)
    target = EngineTarget(model_dir=checkpoint, dtype=torch.bfloat16, device=device)
    reserved_in_trace: list[int] = []

    def trace():
        twin = meta_llama(config, device)
        reserved_in_trace.append(torch.cuda.memory_reserved(device))
        params = dict(twin.named_parameters())

        def load(weights):
            for name, tensor in weights:
                params[name].copy_(tensor)

        return trace_load(twin, checkpoint_sources(read_checkpoint(checkpoint)), load)

    try:
        while not Path(socket).exists() and proc.poll() is None:
            time.sleep(0.1)
        # A first engine has the daemon build the layout (the daemon's memory changes while
        # it does); the engine measured is a restart, whose daemon's memory stays put.
        assert layouts.engine_layout(settings, socket, expected_configs(target, own_layout=True),
                                     trace).attached is not None, log.read_text()  # fmt: skip
        layouts.forget_layouts()
        reserved_in_trace.clear()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # where vLLM stands before it asks: nothing cached
        reserved_before = torch.cuda.memory_reserved(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        decided = layouts.engine_layout(settings, socket, expected_configs(target, own_layout=True),
                                        trace)  # fmt: skip
        assert decided.attached is not None, f"{decided.reason}\n{log.read_text()}"
        torch.cuda.synchronize(device)
        # The trace did allocate the model on the GPU (else this proves nothing) ...
        assert reserved_in_trace and reserved_in_trace[0] > reserved_before
        # ... and gave it all back: the allocator holds what it held, the driver's free
        # memory moved only by the new mapping's page tables.
        assert torch.cuda.memory_reserved(device) == reserved_before
        assert 0 <= free_before - torch.cuda.mem_get_info(device)[0] <= 2 * MiB
    finally:
        layouts.forget_layouts()
        daemon.stop()

