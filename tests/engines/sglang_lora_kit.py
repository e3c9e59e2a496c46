"""SGLang's LoRA on a model loaded from the daemon, in a rank process of SGLang's own.

``python -m tests.engines.sglang_lora_kit RANK WORLD PORT OUT JOB`` (JOB:
``MODEL_DIR=SOCKET_DIR=ADAPTER_DIR``; TP 1) publishes SGLang's server
arguments with LoRA on (``--lora-paths tuned=ADAPTER_DIR``, the
``torch_native`` LoRA backend, the one that runs on CPU), loads the model
through our loader from the daemon at ``<SOCKET_DIR>/tests.tiny/cpu.sock``,
then does what SGLang's model runner and scheduler do with LoRA: builds the
``LoRAManager`` as ``ModelRunner.init_lora_manager`` does (it wraps the
target layers and loads the adapter from disk) and, as for a batch that uses
the adapter, ``fetch_new_loras`` (the adapter's A and B copied into SGLang's
LoRA memory pool and set on the wrapped layers). It writes to OUT what the
engine's state says about the base weights, read from their own storages.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.engines.sglang_layout_kit import CACHE, load_ours, publish_rank, rotary_kernel_stand_in


def _pinned_memory_stand_in() -> None:
    """SGLang's LoRA layers and backends ask for page-locked ("pinned") host tensors
    unconditionally (``pin_memory=True``, ``.pin_memory()``: staging for copies to a GPU);
    torch pins through the CUDA driver, which a machine without a GPU lacks ("Found no
    NVIDIA driver"). Pinning changes where host memory may be paged, never a value: here
    a request to pin gives plain host memory (a stand-in for a driver facility that
    cannot exist here; the base weights are not host tensors SGLang creates)."""
    import functools

    import torch

    def unpinned(factory):
        @functools.wraps(factory)
        def make(*args, pin_memory=False, **kwargs):
            return factory(*args, **kwargs)

        return make

    for name in ("tensor", "empty", "zeros", "ones", "full", "arange"):
        setattr(torch, name, unpinned(getattr(torch, name)))
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self


def run_rank(rank: int, world: int, port: int, out: Path, job: str) -> None:
    import torch

    from tests.engines.enginekit import in_daemon_memory

    rotary_kernel_stand_in()
    _pinned_memory_stand_in()
    from sglang.srt.plugins import load_plugins

    load_plugins()  # as every SGLang process does: weightcache's hooks (sglang/lora.py)
    model_dir, socket_dir, adapter = job.split("=", 2)
    from sglang.srt.arg_groups.lora_hook import check_lora_server_args

    # SGLang's launch resolves --lora-paths into LoRARefs (its LoRA checks) before it
    # publishes the arguments to its processes.
    server_args = publish_rank(
        model_dir, world, rank, port, "bfloat16", "--enable-lora", "--lora-backend",
        "torch_native", "--max-lora-rank", "8", "--lora-paths", f"tuned={adapter}",
        "--max-loras-per-batch", "2", resolve=check_lora_server_args,
    )  # fmt: skip
    from sglang.srt.lora.layers import BaseLayerWithLoRA
    from sglang.srt.lora.lora_manager import LoRAManager
    from sglang.srt.runtime_context import get_lora

    extra = {"socket_dir": socket_dir, "cache": CACHE}
    loader, model, model_config = load_ours(model_dir, "bfloat16", rank, extra)
    inside = in_daemon_memory(loader._layout.attached)
    base = [(name, p, p.detach().clone()) for name, p in model.named_parameters()]
    mapped_before = sorted(name for name, p, _ in base if inside(p))
    modules = dict(model.named_modules())

    lora = get_lora()  # ModelRunner.init_lora_manager's arguments
    manager = LoRAManager(
        base_model=model, base_hf_config=model_config.hf_config,
        max_loras_per_batch=lora.max_loras_per_batch, load_config=loader.load_config,
        dtype=torch.bfloat16, server_args=server_args, lora_backend=lora.lora_backend,
        max_lora_rank=lora.max_lora_rank, target_modules=lora.lora_target_modules,
        lora_paths=lora.lora_paths,
    )  # fmt: skip
    (ref,) = lora.lora_paths
    manager.fetch_new_loras({ref.lora_id})  # as the scheduler prepares a batch using it

    wrapped = {n: m for n, m in model.named_modules() if isinstance(m, BaseLayerWithLoRA)}
    # One batch of one 5-token request under the adapter, as SGLang's model runner
    # prepares it (its own ForwardMode; the fields the LoRA batch reads), then the first
    # layer's wrapped qkv_proj run forward by the LoRA backend over the mapped weight.
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    tokens = 5
    batch = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, batch_size=1, lora_ids=[ref.lora_id],
        extend_seq_lens=torch.tensor([tokens], dtype=torch.int32),
        extend_seq_lens_cpu=[tokens], can_run_decode_cuda_graph=False,
    )  # fmt: skip
    manager.prepare_lora_batch(batch)
    qkv = wrapped["model.layers.0.self_attn.qkv_proj"]
    x = torch.randn(tokens, model_config.hf_config.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        tuned, base_out = qkv(x)[0], qkv.base_layer(x)[0]
    pool = manager.memory_pool
    slot = pool.uid_to_buffer_id[ref.lora_id]
    buffers = {
        f"{kind}.{module}.{layer}": tensor[slot]
        for kind, by_module in (("A", pool.A_buffer), ("B", pool.B_buffer))
        for module, layers in by_module.items()
        for layer, tensor in enumerate(layers)
    }
    result = {
        "backend": lora.lora_backend,
        "adapters": sorted(manager.loras),
        "names": [name for name, _, _ in base],
        "wrapped": sorted(wrapped),
        "same_base_layer": sorted(n for n, m in wrapped.items() if m.base_layer is modules[n]),
        "mapped_before": mapped_before,
        "mapped_after": sorted(n for n, p, _ in base if inside(p)),  # after the forward too
        "changed": sorted(n for n, p, before in base if not torch.equal(p, before)),
        "still_parameters": all(
            any(p is q for q in model.parameters()) for _, p, _ in base
        ),
        "adapter_buffers": sorted(buffers),
        "empty_buffers": sorted(n for n, t in buffers.items() if not t.any()),
        "buffers_in_daemon": sorted(n for n, t in buffers.items() if inside(t)),
        "forward_changed_columns": (tuned != base_out).any(dim=0).nonzero().flatten().tolist(),
        "out_size": tuned.shape[-1],
    }
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    rank, world, port, out, job = sys.argv[1:]
    run_rank(int(rank), int(world), int(port), Path(out), job)
