"""A toy engine for load-plan tests: a vLLM-shaped model of our own and its checkpoint.

Fused qkv with biases and gate/up-less stacked MoE experts (w13, w2), a padded
vocabulary tied to lm_head, tensor-parallel narrowing, optional casting or
concatenating loaders: each parameter filled by a loader writing a view of
it, as vLLM's weight loaders do.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from weightcache.client import meta_parameters
from weightcache.plan import SourceTensor

H, HEADS_Q, HEADS_KV, HEAD, INTER, EXPERTS, VOCAB = 16, 4, 2, 4, 24, 4, 30
PAD = 8


def checkpoint(layers: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    out = {"model.embed_tokens.weight": r(VOCAB, H), "model.norm.weight": r(H)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": r(HEADS_Q * HEAD, H),
            p + "self_attn.k_proj.weight": r(HEADS_KV * HEAD, H),
            p + "self_attn.v_proj.weight": r(HEADS_KV * HEAD, H),
            p + "self_attn.q_proj.bias": r(HEADS_Q * HEAD),
            p + "self_attn.k_proj.bias": r(HEADS_KV * HEAD),
            p + "self_attn.v_proj.bias": r(HEADS_KV * HEAD),
            p + "self_attn.o_proj.weight": r(H, HEADS_Q * HEAD),
            p + "self_attn.rotary_emb.inv_freq": r(HEAD // 2),
            p + "mlp.gate.weight": r(EXPERTS, H),
            p + "input_layernorm.weight": r(H),
        }
        for e in range(EXPERTS):
            q = f"{p}mlp.experts.{e}."
            out |= {q + "w1.weight": r(INTER, H), q + "w3.weight": r(INTER, H),
                    q + "w2.weight": r(H, INTER)}  # fmt: skip
    return out


def sources(tensors: dict[str, torch.Tensor]) -> dict[str, SourceTensor]:
    return {n: SourceTensor(str(t.dtype).removeprefix("torch."), tuple(t.shape))
            for n, t in tensors.items()}  # fmt: skip


class ToyEngine(nn.Module):
    """A vLLM-shaped model: fused and stacked parameters, each with a weight_loader."""

    def __init__(self, layers=2, tp_rank=0, tp_size=1, dtype=torch.bfloat16, style="narrow"):
        super().__init__()
        self.rank, self.tp, self.style = tp_rank, tp_size, style
        q, kv = HEADS_Q * HEAD // tp_size, HEADS_KV * HEAD // tp_size
        self.q, self.kv, self.inter = q, kv, INTER // tp_size
        padded = -(-VOCAB // (PAD * tp_size)) * PAD * tp_size
        self.rows = padded // tp_size

        def param(*shape):
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.embed = param(self.rows, H)
        self.lm_head = self.embed  # tied
        self.norm = param(H)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            layer = nn.Module()
            layer.qkv_weight = param(q + 2 * kv, H)
            layer.qkv_bias = param(q + 2 * kv)
            layer.o_proj = param(H, q)
            layer.router = param(EXPERTS, H)
            layer.w13 = param(EXPERTS, 2 * self.inter, H)
            layer.w2 = param(EXPERTS, H, self.inter)
            layer.norm = param(H)
            self.layers.append(layer)

    # Each loader writes a view of its parameter, as vLLM's do.
    def _qkv(self, param, w, shard):
        size = {"q": self.q, "k": self.kv, "v": self.kv}[shard]
        offset = {"q": 0, "k": self.q, "v": self.q + self.kv}[shard]
        part = w.narrow(0, self.rank * size, size)
        if self.style == "cast":
            part = part.to(torch.float16)  # a lossy hop the plan must keep
        param.data.narrow(0, offset, size).copy_(part)

    def load_weights(self, weights):
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, w in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "model.embed_tokens.weight":
                start = self.rank * self.rows
                n = max(0, min(self.rows, VOCAB - start))
                self.embed.data[:n].copy_(w[start : start + n])
                self.embed.data[n:].fill_(0)
                continue
            if name == "model.norm.weight":
                self.norm.data.copy_(w)
                continue
            parts = name.split(".")
            layer = self.layers[int(parts[2])]
            rest = ".".join(parts[3:])
            if rest.startswith("self_attn.") and rest[10] in "qkv" and rest[11:17] == "_proj.":
                shard = rest[10]
                target = layer.qkv_weight if rest.endswith("weight") else layer.qkv_bias
                if self.style == "cat":
                    pending.setdefault(f"{parts[2]}.{rest[17:]}", {})[shard] = w
                    group = pending[f"{parts[2]}.{rest[17:]}"]
                    if len(group) == 3:
                        size = {"q": self.q, "k": self.kv, "v": self.kv}
                        fused = torch.cat([group[s].narrow(0, self.rank * size[s], size[s])
                                           for s in "qkv"])  # fmt: skip
                        target.data.copy_(fused)
                else:
                    self._qkv(target, w, shard)
            elif rest == "self_attn.o_proj.weight":
                layer.o_proj.data.copy_(w.narrow(1, self.rank * self.q, self.q))
            elif rest == "mlp.gate.weight":
                layer.router.data.copy_(w.t().contiguous().t())  # a clone in between
            elif rest == "input_layernorm.weight":
                layer.norm.data.copy_(w)
            elif rest.startswith("mlp.experts."):
                e, which = int(parts[5]), parts[6]
                n = self.inter
                if which == "w2":
                    layer.w2.data[e].copy_(w.narrow(1, self.rank * n, n))
                else:
                    at = 0 if which == "w1" else n
                    layer.w13.data[e].narrow(0, at, n).copy_(w.narrow(0, self.rank * n, n))
            else:
                raise KeyError(name)


def real_load(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        model.load_weights(iter(tensors.items()))
    return dict(model.named_parameters(remove_duplicate=False))


def meta_model(**kw) -> nn.Module:
    with meta_parameters():
        return ToyEngine(**kw)


def save_checkpoint(directory: Path, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "model.safetensors")
    return directory
