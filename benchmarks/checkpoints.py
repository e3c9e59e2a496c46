"""Synthetic checkpoints of real model shapes, written as sharded safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

SHARD_BYTES = 4 * 2**30


def llama8b_shapes() -> dict[str, tuple[int, ...]]:
    """Llama-3-8B: 291 tensors, ~16 GB in bf16."""
    hidden, inter, vocab, kv = 4096, 14336, 128256, 1024
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(32):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (hidden, hidden),
                p + "self_attn.k_proj.weight": (kv, hidden),
                p + "self_attn.v_proj.weight": (kv, hidden),
                p + "self_attn.o_proj.weight": (hidden, hidden),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
            }
        )
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def moe_shapes() -> dict[str, tuple[int, ...]]:
    """36,864 expert tensors (48 layers x 256 experts x 3), ~9.7 GB in bf16."""
    shapes = {}
    for layer in range(48):
        for expert in range(256):
            p = f"model.layers.{layer}.mlp.experts.{expert}."
            shapes[p + "gate_proj.weight"] = (512, 256)
            shapes[p + "up_proj.weight"] = (512, 256)
            shapes[p + "down_proj.weight"] = (256, 512)
    return shapes


def write_checkpoint(path: Path, shapes: dict[str, tuple[int, ...]], seed: int = 0) -> Path:
    """Random bf16 tensors (generated on the GPU when there is one), ~4 GiB shards + index."""
    if (path / "model.safetensors.index.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size = 0
    names = list(shapes)
    index = 0
    for i, name in enumerate(names):
        t = torch.randn(shapes[name], generator=generator, device=device, dtype=torch.bfloat16)
        shard[name] = t.cpu()
        size += t.numel() * 2
        if size >= SHARD_BYTES or i == len(names) - 1:
            index += 1
            file = f"model-{index:05d}.safetensors"
            save_file(shard, path / file)
            weight_map.update(dict.fromkeys(shard, file))
            shard, size = {}, 0
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path
