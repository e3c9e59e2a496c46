"""Synthetic checkpoints of real model shapes, written as sharded safetensors."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.tp_llama import LlamaShape

SHARD_BYTES = 4 * 2**30

# Llama-3-8B without its rope scaling (the TP forward implements the default RoPE only).
LLAMA3_8B = LlamaShape(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
)


def llama_shapes(shape: LlamaShape) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama checkpoint with ``shape``, in transformers' names and order."""
    hidden, inter = shape.hidden_size, shape.intermediate_size
    q = shape.num_attention_heads * shape.head_dim
    kv = shape.num_key_value_heads * shape.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab_size, hidden)}
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q, hidden),
                p + "self_attn.k_proj.weight": (kv, hidden),
                p + "self_attn.v_proj.weight": (kv, hidden),
                p + "self_attn.o_proj.weight": (hidden, q),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
            }
        )
    shapes["model.norm.weight"] = (hidden,)
    if not shape.tie_word_embeddings:
        shapes["lm_head.weight"] = (shape.vocab_size, hidden)
    return shapes


def llama8b_shapes() -> dict[str, tuple[int, ...]]:
    """Llama-3-8B: 291 tensors, ~16 GB in bf16."""
    return llama_shapes(LLAMA3_8B)


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


def write_checkpoint(
    path: Path,
    shapes: dict[str, tuple[int, ...]],
    seed: int = 0,
    init: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> Path:
    """Random bf16 tensors (generated on the GPU when there is one), ~4 GiB shards + index.

    ``init(name, standard_normal)`` may rescale each tensor (default: left standard normal).
    """
    if (path / "model.safetensors.index.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size = total = 0
    names = list(shapes)
    index = 0
    for i, name in enumerate(names):
        t = torch.randn(shapes[name], generator=generator, device=device, dtype=torch.bfloat16)
        if init is not None:
            t = init(name, t)
        shard[name] = t.cpu()
        size += t.numel() * 2
        total += t.numel() * 2
        if size >= SHARD_BYTES or i == len(names) - 1:
            index += 1
            file = f"model-{index:05d}.safetensors"
            save_file(shard, path / file)
            weight_map.update(dict.fromkeys(shard, file))
            shard, size = {}, 0
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}  # as transformers
    (path / "model.safetensors.index.json").write_text(json.dumps(index_json))
    if device == "cuda":
        torch.cuda.empty_cache()  # the generator's blocks go back: callers measure free memory
    return path


def _llama_init(name: str, t: torch.Tensor) -> torch.Tensor:
    """Norm weights 1, matrices N(0, 0.02): activations of a real model's scale, not overflow."""
    return torch.ones_like(t) if t.dim() == 1 else t * 0.02


def write_llama_checkpoint(path: Path, shape: LlamaShape = LLAMA3_8B, seed: int = 0) -> Path:
    """A runnable Llama checkpoint: ``config.json`` plus tensors of a real model's scale."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(shape.config_json(), indent=2))
    return write_checkpoint(path, llama_shapes(shape), seed, init=_llama_init)
