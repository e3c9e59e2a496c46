"""The tensor-parallel engine (benchmarks.tp_engine) on CPU: two gloo ranks, two memfd daemons.

The flow tests/gpu/test_tp2_gpu.py runs on two GPUs (NCCL, vmm_fd), minus real
free memory: a real transformers Llama checkpoint (tiny, float32), one rank
daemon per rank holding only its shard, two engine processes joined in a
process group, each attaching its own daemon's shard and running the
Megatron-style forward of benchmarks.tp_llama.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from benchmarks.tp_engine import EngineRanks, prompt_ids
from tests.unit.wc_harness import DaemonFactory

TP = 2


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=250,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def _logits(reply: dict) -> torch.Tensor:
    return load_file(reply["logits"])["logits"]


def _ranks(model: Path, out: Path, sockets: list[str | None], tag: str) -> list[list[str]]:
    common = ["--backend", "gloo", "--device", "cpu", "--model", str(model), "--out", str(out)]
    return [[*common, "--tag", tag, *(["--socket", s] if s else [])] for s in sockets]


def test_tp2_through_rank_daemons_equals_cold_tp2_and_transformers_and_survives_a_kill(
    daemons: DaemonFactory, llama_dir: Path, tmp_path: Path
) -> None:
    from transformers import LlamaForCausalLM

    rank_daemons = [
        daemons(llama_dir, "--tp-size", str(TP), "--tp-rank", str(r), "--shard-plan", "llama",
                "--transport", "memfd", wait=False)
        for r in range(TP)
    ]  # fmt: skip
    for daemon in rank_daemons:
        daemon.wait_ready()
    sockets = [d.socket for d in rank_daemons]

    with EngineRanks(_ranks(llama_dir, tmp_path, sockets, "attached"), tmp_path) as engine:
        attached = engine.replies()
        assert [r["transport"] for r in attached] == ["memfd"] * TP
        assert all(r["zero_copy"] and r["finite"] for r in attached)
        assert [r["daemon_pid"] for r in attached] == [d.pid for d in rank_daemons]
        whole = sum(t.nbytes for t in load_file(llama_dir / "model.safetensors").values())
        assert all(r["held_bytes"] < whole for r in attached)

        rank_daemons[1].kill()
        after_kill = engine.command("forward after-kill")
        assert [r["daemon_alive"] for r in after_kill] == [[True], [False]]

        status = rank_daemons[1].start().status()
        assert status.readopted and status.load_source == "readopted", status.load_reason
        assert f"engine pid {engine.pids[1]}" in status.load_reason
        readopted = engine.command("reattach readopted")
        assert [r["daemon_pid"] for r in readopted] == [d.pid for d in rank_daemons]
        assert all(r["zero_copy"] for r in readopted)

    with EngineRanks(_ranks(llama_dir, tmp_path, [None, None], "cold"), tmp_path, "cold") as cold:
        cold_replies = cold.replies()
    assert [r["mode"] for r in cold_replies] == ["cold"] * TP

    reference = _logits(cold_replies[0])
    assert torch.equal(_logits(cold_replies[1]), reference)
    for reply in [*attached, *after_kill, *readopted]:
        assert torch.equal(_logits(reply), reference), (reply["tag"], reply["rank"])

    # The split forward is a Llama forward: the whole model in one process agrees up to
    # float32 rounding (the row-parallel sums add the two halves in another order).
    whole_model = LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = whole_model(prompt_ids(250)).logits
    assert reference.shape == expected.shape == (2, 64, 250)
    assert torch.allclose(reference, expected, rtol=1e-4, atol=1e-5), (
        (reference - expected).abs().max()
    )


def test_a_config_the_forward_does_not_implement_is_refused_naming_it(tmp_path: Path) -> None:
    from benchmarks.checkpoints import LLAMA3_8B
    from benchmarks.tp_llama import LlamaShape

    config = LLAMA3_8B.config_json()
    assert LlamaShape.from_checkpoint(_write(tmp_path, config)) == LLAMA3_8B
    llama3_rope = {**config, "rope_parameters": {"rope_type": "llama3", "factor": 8.0}}
    with pytest.raises(ValueError, match="rope type 'llama3' is not implemented"):
        LlamaShape.from_checkpoint(_write(tmp_path, llama3_rope))
    with pytest.raises(ValueError, match="attention_bias is not implemented"):
        LlamaShape.from_checkpoint(_write(tmp_path, {**config, "attention_bias": True}))
    with pytest.raises(ValueError, match="num_key_value_heads = 8 is not divisible by tp_size 16"):
        LLAMA3_8B.check_tp(16)


def _write(directory: Path, config: dict) -> Path:
    (directory / "config.json").write_text(json.dumps(config))
    return directory
