"""Tiny checkpoints of real model shapes, random weights, written as a model directory.

``config.json`` + ``model.safetensors`` under the checkpoint's own tensor names
(Hugging Face's), as a published checkpoint of that architecture stores them:
dense Llama, Qwen2 (biases on q/k/v, tied embeddings), Mixtral (MoE experts
``block_sparse_moe.experts.N.w1/w2/w3``) and Qwen2-MoE (experts plus a shared
expert behind a gate, q/k/v biases). Sizes are a few hundred KB: shapes
divisible for TP 2, a vocabulary that engines pad (250 -> 256 and beyond).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

H, LAYERS, HEADS, KV_HEADS, INTER, VOCAB = 64, 2, 4, 2, 128, 250
EXPERTS, MOE_INTER = 4, 32

_COMMON = {
    "hidden_size": H,
    "intermediate_size": INTER,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "vocab_size": VOCAB,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

CONFIGS: dict[str, dict] = {
    "llama": {**_COMMON, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "tie_word_embeddings": False},
    "qwen2": {**_COMMON, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
              "tie_word_embeddings": True, "use_sliding_window": False,
              "sliding_window": 256, "max_window_layers": LAYERS},
    "mixtral": {**_COMMON, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "tie_word_embeddings": False, "num_local_experts": EXPERTS,
                "num_experts_per_tok": 2, "sliding_window": None},
    "qwen2_moe": {**_COMMON, "architectures": ["Qwen2MoeForCausalLM"],
                  "model_type": "qwen2_moe", "tie_word_embeddings": False,
                  "moe_intermediate_size": MOE_INTER, "shared_expert_intermediate_size": INTER,
                  "num_experts": EXPERTS, "num_experts_per_tok": 2, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False,
                  "sliding_window": 256, "max_window_layers": LAYERS, "qkv_bias": True},
}  # fmt: skip


def _tensors(kind: str) -> dict[str, tuple[int, ...]]:
    c = CONFIGS[kind]
    d = H // HEADS
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, H)}
    bias = kind in ("qwen2", "qwen2_moe")
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (H,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (H,)
        q, kv = HEADS * d, KV_HEADS * d
        for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[f"{p}.self_attn.{proj}.weight"] = (rows, H)
            if bias:
                shapes[f"{p}.self_attn.{proj}.bias"] = (rows,)
        shapes[f"{p}.self_attn.o_proj.weight"] = (H, HEADS * d)
        if kind in ("llama", "qwen2"):
            shapes.update(_mlp(f"{p}.mlp", INTER))
        elif kind == "mixtral":
            moe = f"{p}.block_sparse_moe"
            shapes[f"{moe}.gate.weight"] = (EXPERTS, H)
            for j in range(EXPERTS):
                e = f"{moe}.experts.{j}"
                shapes[f"{e}.w1.weight"] = (INTER, H)
                shapes[f"{e}.w2.weight"] = (H, INTER)
                shapes[f"{e}.w3.weight"] = (INTER, H)
        else:  # qwen2_moe
            mlp = f"{p}.mlp"
            shapes[f"{mlp}.gate.weight"] = (EXPERTS, H)
            for j in range(EXPERTS):
                shapes.update(_mlp(f"{mlp}.experts.{j}", MOE_INTER))
            shapes.update(_mlp(f"{mlp}.shared_expert", c["shared_expert_intermediate_size"]))
            shapes[f"{mlp}.shared_expert_gate.weight"] = (1, H)
    shapes["model.norm.weight"] = (H,)
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (VOCAB, H)
    return shapes


def _mlp(prefix: str, inter: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.gate_proj.weight": (inter, H),
        f"{prefix}.up_proj.weight": (inter, H),
        f"{prefix}.down_proj.weight": (H, inter),
    }


def write_tiny_model(kind: str, directory: Path, seed: int = 0) -> Path:
    """A ``kind`` checkpoint (bfloat16, random normal weights) in ``directory``."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {
        name: torch.randn(shape, generator=generator).to(torch.bfloat16)
        for name, shape in _tensors(kind).items()
    }
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(CONFIGS[kind], indent=1))
    return directory


# --------------------------------------------------------------------------- with transformers

# Decoders written by transformers itself (its model classes' own initialisation and
# save_pretrained), with a tokenizer, for the engine servers to generate from.
HF_KINDS = ("llama", "qwen2", "qwen2_moe")
# Words "w3".."w249" after three special tokens: every id a word, so prompts are plain text.
SPECIAL = ("<unk>", "<s>", "</s>")


# Heads of 32: the smallest head size vLLM's CPU attention runs (it refuses 16).
HF_H = 4 * 32


def hf_config(kind: str):
    """A transformers config of ``kind``: the tiny shapes above but for heads of 32
    (``HF_H``), and a vocabulary of 250 that vLLM pads to 256."""
    import transformers

    common = dict(
        hidden_size=HF_H, intermediate_size=INTER, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
        max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.2,
    )  # fmt: skip
    if kind == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=False)
    if kind == "qwen2":  # q/k/v biases, tied embeddings
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    if kind == "qwen2_moe":  # experts and a shared expert behind a gate
        return transformers.Qwen2MoeConfig(
            **common, tie_word_embeddings=False, num_experts=EXPERTS, num_experts_per_tok=2,
            moe_intermediate_size=MOE_INTER, shared_expert_intermediate_size=INTER,
            norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
        )  # fmt: skip
    raise ValueError(f"unknown kind {kind!r}; expected one of {HF_KINDS}")


def write_hf_model(
    kind: str, directory: Path, *, seed: int = 0, fp32: tuple[str, ...] = ()
) -> Path:
    """A ``kind`` decoder built and saved by transformers (bfloat16, its own random
    initialisation under ``seed``) plus a word-level tokenizer, in ``directory``.
    ``fp32``: name suffixes of tensors kept in float32 (a mixed-dtype checkpoint, as
    checkpoints keeping their norms in float32 are)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(kind))
    model = model.to(torch.bfloat16)
    for name, param in model.named_parameters():
        if name.endswith(fp32):
            param.data = param.data.float()
    model.save_pretrained(directory)
    write_tokenizer(directory)
    return directory


def write_tokenizer(directory: Path) -> None:
    """A word-level tokenizer of VOCAB ids ("w<id>" words, split on whitespace)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL), VOCAB)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<unk>",
    )  # fmt: skip
    fast.save_pretrained(directory)
