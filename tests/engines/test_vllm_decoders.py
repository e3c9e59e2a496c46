"""Decoders generating through vLLM's own OpenAI server on CPU (vLLM's CPU build, issue 33).

Real processes throughout: a daemon (the project's venv and torch) over memfd,
and vLLM's server (this venv's vLLM 0.32 CPU build and torch). Each model is a
tiny random decoder built and saved by transformers with a word-level
tokenizer (``tiny_models.write_hf_model``):

- Llama: rotary embeddings (vLLM caches its rotary modules process-wide: a
  trace that moved their buffers to meta broke the first request), a
  vocabulary vLLM pads (250 -> 256), and its norms kept in float32 in a
  bfloat16 checkpoint (mixed dtypes; the daemon runs without ``--dtype``, so
  it holds each tensor in its own);
- Qwen2: q/k/v biases, tied embeddings;
- Qwen2-MoE: experts stacked by vLLM and a shared expert (vLLM's CPU build
  carries CPU MoE kernels; the CUDA wheel does not, docs/engines.md).

Per model one server with vLLM's default loader (the reference) and one with
``--load-format weightcache``, each started once (module fixtures), the same
greedy prompts sent one at a time: the generated token ids and their logprobs
must be equal (JSON floats are exact). Half-way through the weightcache
server's prompts its daemon is killed (SIGKILL): the memfd mappings are the
engine's own, so the rest are served, and equal, as well.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests.engines.enginekit import EngineServer, fetches, require_engine

require_engine("vllm")

from tests.engines.test_vllm_server import (  # noqa: E402
    START_WITHIN_S,
    server_env,
    weightcache_args,
)
from tests.engines.tiny_models import HF_KINDS, write_hf_model  # noqa: E402
from tests.unit.wc_harness import free_port  # noqa: E402

# Token ids: transformers reads Qwen2's tokenizer as its own BPE class whatever was saved, so
# a text prompt would tokenize differently per model; ids are the same for every model.
PROMPTS = [[5, 17, 100, 42], [200, 3], [9] * 8, [128], [31, 64, 127, 249]]
MAX_TOKENS = 12
# What the adapter says once it mapped vLLM's own layout: the counts, read from storages.
LAYOUT_LINE = re.compile(
    r"weightcache: vLLM's own layout \(plan [0-9a-f]{12}\) over memfd from daemon pid (\d+): "
    r"(\d+) parameter\(s\) \((\d+) bytes\) mapped zero-copy, (\d+) \((\d+) bytes\) in engine "
    r"memory"
)
# Tensors of the Llama checkpoint kept in float32 (every norm weight).
FP32 = ("norm.weight",)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-decoders")


@pytest.fixture(scope="module")
def decoders(tmp) -> dict[str, Path]:
    return {kind: write_hf_model(kind, tmp / kind, fp32=FP32 if kind == "llama" else ())
            for kind in HF_KINDS}  # fmt: skip


def decoder_argv(model: Path, port: int, *extra: str) -> list[str]:
    # float32: vLLM's CPU kernels for it exist on every x86 CPU (bfloat16 needs AVX-512 BF16).
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--port", str(port), "--dtype", "float32", "--max-model-len", "128",
            "--max-num-seqs", "4", "--enforce-eager", *extra]  # fmt: skip


def serve(model: Path, tmp: Path, name: str, *extra: str) -> EngineServer:
    port = free_port()
    server = EngineServer(decoder_argv(model, port, *extra), port, tmp / f"{name}.log",
                          server_env(tmp))  # fmt: skip
    return server.wait_healthy(START_WITHIN_S)


def generate(
    server: EngineServer, model: Path, prompt: list[int]
) -> tuple[list[int], list[float]]:
    """Greedy: the generated token ids and each one's logprob."""
    status, body = server.post("/v1/completions", {
        "model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "ignore_eos": True, "logprobs": 1, "return_token_ids": True,
    })  # fmt: skip
    assert status == 200, body
    choice = body["choices"][0]
    ids, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    assert len(ids) == len(logprobs) == MAX_TOKENS, choice
    return ids, logprobs


@pytest.fixture(scope="module", params=HF_KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference(kind, decoders, tmp) -> list:
    """What vLLM's own default loader generates, prompt by prompt."""
    server = serve(decoders[kind], tmp, f"{kind}-default")
    try:
        return [generate(server, decoders[kind], p) for p in PROMPTS]
    finally:
        server.stop()


@pytest.fixture(scope="module")
def through_weightcache(kind, decoders, tmp, session_daemons) -> dict:
    """The same prompts through ``--load-format weightcache``; the daemon killed half-way."""
    # No --dtype: the daemon holds every tensor in its own dtype (Llama's mixed ones too);
    # vLLM's own layout, float32, is built from them by the plan's casts.
    daemon = session_daemons(decoders[kind], "--transport", "memfd")
    fetched = fetches(daemon, "fetch_layout")
    server = serve(decoders[kind], tmp, f"{kind}-weightcache", *weightcache_args(daemon.socket))
    try:
        half = len(PROMPTS) // 2
        before = [generate(server, decoders[kind], p) for p in PROMPTS[:half]]
        fetched = fetches(daemon, "fetch_layout") - fetched
        daemon_pid = daemon.pid
        daemon.kill()
        after = [generate(server, decoders[kind], p) for p in PROMPTS[half:]]
        return {"outputs": before + after, "fetched": fetched, "daemon_pid": daemon_pid,
                "alive": server.proc.poll() is None, "log": server.log()}  # fmt: skip
    finally:
        server.stop()


def test_weightcache_generates_the_default_loaders_tokens_and_logprobs(
    kind, reference, through_weightcache
) -> None:
    assert through_weightcache["outputs"] == reference
    # The greedy tokens are the model's, not a constant: the prompts give different ones.
    assert len({tuple(ids) for ids, _ in reference}) > 1


def test_the_server_mapped_vllms_own_layout_from_the_daemon(kind, through_weightcache) -> None:
    log = through_weightcache["log"]
    lines = LAYOUT_LINE.findall(log)
    assert len(lines) == 1, log[-6000:]
    pid, mapped, mapped_bytes, _, _ = (int(v) for v in lines[0])
    assert pid == through_weightcache["daemon_pid"] and mapped > 0 and mapped_bytes > 0
    assert through_weightcache["fetched"] >= 1
    assert "loading from disk" not in log and "Cannot copy out of meta tensor" not in log


def test_requests_are_served_after_the_daemon_is_killed(kind, through_weightcache) -> None:
    """The second half of the prompts ran after SIGKILL of the daemon (memfd mappings
    outlive it); the first test compares them with the reference."""
    assert through_weightcache["alive"]
    with pytest.raises(ProcessLookupError):
        os.kill(through_weightcache["daemon_pid"], 0)
