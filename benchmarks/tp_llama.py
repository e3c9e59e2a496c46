"""A Llama forward pass split Megatron-style across a tensor-parallel group.

The engine side of the tensor-parallel proofs: parameter names and rank-local
shapes are the checkpoint's, cut as the ``llama`` shard plan cuts them
(:mod:`weightcache.shard`), so ``load_into`` fills the module straight from a
rank daemon's tensors (or from a rank's shard read off disk):

- ``q/k/v_proj``, ``gate/up_proj``: column parallel (rows split), no
  communication; each rank runs its own attention heads and MLP columns;
- ``o_proj``, ``down_proj``: row parallel (columns split), one all-reduce
  (sum) of the partial outputs after each;
- ``embed_tokens``: vocab parallel; each rank looks up the ids in its block
  of rows, zeros the rest, and an all-reduce sums the (one-hot) contributions;
- ``lm_head``: vocab parallel; each rank computes its block of the logits,
  gathered along the vocabulary;
- norms: replicated.

One forward pass over a batch of prompts, no KV cache, no sampling: what the
tests compare. Parameters are created on ``meta``; nothing is allocated until
``load_into`` points them at real tensors, and the module registers no buffers
(the rotary tables are computed per call), so a module fed by a daemon holds
no device memory of its own.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaShape:
    """The hyper-parameters the forward needs, as transformers' ``config.json`` names them."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path) -> LlamaShape:
        """Read ``config.json``; refuse what this forward does not implement, naming it."""
        path = Path(model_dir) / "config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the model config {path}: {exc}") from None
        if config.get("model_type", "llama") != "llama":
            raise ValueError(f"{path}: model_type {config['model_type']!r} is not 'llama'")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"{path}: rope type {rope.get('rope_type')!r} is not implemented")
        for flag in ("attention_bias", "mlp_bias"):
            if config.get(flag):
                raise ValueError(f"{path}: {flag} is not implemented")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{path}: hidden_act {config['hidden_act']!r} is not 'silu'")
        heads = config["num_attention_heads"]
        return cls(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab_size=config["vocab_size"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-5),
            rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
        )

    def config_json(self) -> dict:
        """A transformers ``config.json`` for this shape (for synthetic checkpoints)."""
        config = asdict(self)
        config.update(
            model_type="llama",
            architectures=["LlamaForCausalLM"],
            hidden_act="silu",
            rope_parameters={"rope_theta": self.rope_theta, "rope_type": "default"},
            torch_dtype="bfloat16",
        )
        del config["rope_theta"]
        return config

    def check_tp(self, tp_size: int) -> None:
        """Every split dimension must divide evenly, whole heads per rank."""
        for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size",
                      "vocab_size"):  # fmt: skip
            if getattr(self, field) % tp_size:
                raise ValueError(
                    f"{field} = {getattr(self, field)} is not divisible by tp_size {tp_size}"
                )


class TPGroup:
    """This rank's place in the tensor-parallel group; collectives are no-ops at size 1."""

    def __init__(self, size: int = 1, rank: int = 0, group: dist.ProcessGroup | None = None):
        self.size = size
        self.rank = rank
        self.group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def _weight(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device="meta"), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _weight(size, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As transformers' LlamaRMSNorm: normalise in float32, scale in the input dtype.
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class ColumnLinear(nn.Module):
    """``out // tp`` rows of ``[out, in]``: this rank's slice of the output features."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, dtype) -> None:
        super().__init__()
        self.weight = _weight(out_features // tp.size, in_features, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RowLinear(nn.Module):
    """``in // tp`` columns of ``[out, in]``: a partial sum of every output, summed across ranks."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, dtype) -> None:
        super().__init__()
        self.weight = _weight(out_features, in_features // tp.size, dtype=dtype)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(F.linear(x, self.weight))


class VocabEmbedding(nn.Module):
    """This rank's block of vocabulary rows; ids outside it contribute zeros to the sum."""

    def __init__(self, vocab: int, hidden: int, tp: TPGroup, dtype) -> None:
        super().__init__()
        self.weight = _weight(vocab // tp.size, hidden, dtype=dtype)
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        local = ids - self.tp.rank * rows
        outside = (local < 0) | (local >= rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))


def rotary(shape: LlamaShape, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin of the default RoPE, computed as transformers computes them (float32)."""
    exponents = torch.arange(0, shape.head_dim, 2, dtype=torch.int64, device=positions.device)
    inv_freq = 1.0 / (shape.rope_theta ** (exponents.float() / shape.head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, shape: LlamaShape, tp: TPGroup, dtype) -> None:
        super().__init__()
        hidden, head_dim = shape.hidden_size, shape.head_dim
        self.heads = shape.num_attention_heads // tp.size
        self.kv_heads = shape.num_key_value_heads // tp.size
        self.head_dim = head_dim
        self.q_proj = ColumnLinear(hidden, shape.num_attention_heads * head_dim, tp, dtype)
        self.k_proj = ColumnLinear(hidden, shape.num_key_value_heads * head_dim, tp, dtype)
        self.v_proj = ColumnLinear(hidden, shape.num_key_value_heads * head_dim, tp, dtype)
        self.o_proj = RowLinear(shape.num_attention_heads * head_dim, hidden, tp, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape

        def heads(t: torch.Tensor, n: int) -> torch.Tensor:
            return t.view(batch, length, n, self.head_dim).transpose(1, 2)

        q = heads(self.q_proj(x), self.heads)
        k = heads(self.k_proj(x), self.kv_heads)
        v = heads(self.v_proj(x), self.kv_heads)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        # Grouped-query attention: the rank's query heads share its k/v heads in order,
        # because the plan hands each rank whole, consecutive heads of both.
        groups = self.heads // self.kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, shape: LlamaShape, tp: TPGroup, dtype) -> None:
        super().__init__()
        hidden, inter = shape.hidden_size, shape.intermediate_size
        self.gate_proj = ColumnLinear(hidden, inter, tp, dtype)
        self.up_proj = ColumnLinear(hidden, inter, tp, dtype)
        self.down_proj = RowLinear(inter, hidden, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape, tp: TPGroup, dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, dtype)
        self.self_attn = Attention(shape, tp, dtype)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, dtype)
        self.mlp = MLP(shape, tp, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(self, shape: LlamaShape, tp: TPGroup, dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(shape.vocab_size, shape.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(shape, tp, dtype) for _ in range(shape.num_hidden_layers)
        )
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, dtype)


class TPLlamaForCausalLM(nn.Module):
    """The rank's shard of a Llama; ``forward(ids)`` returns the full ``[B, T, vocab]`` logits."""

    def __init__(self, shape: LlamaShape, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        shape.check_tp(tp.size)
        self.shape = shape
        self.tp = tp
        self.model = LlamaBody(shape, tp, dtype)
        self.lm_head = ColumnLinear(shape.hidden_size, shape.vocab_size, tp, dtype)
        if shape.tie_word_embeddings:
            # Both vocab parallel along dim 0: the rank's embedding rows are its lm_head rows.
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(ids)
        positions = torch.arange(ids.shape[-1], device=ids.device)
        cos, sin = rotary(self.shape, positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.tp.all_gather_last(self.lm_head(self.model.norm(x)))
