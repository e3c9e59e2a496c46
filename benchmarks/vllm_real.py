"""Real vLLM on a GPU through weightcache, against vLLM's own cold start (issues 35, 41).

Run on the GPU machine with its plain ``python3`` (no project install, no
network), after ``tools/offline_env.py`` installed the wheels of
``benchmarks/vllm_env.txt`` into ``--site`` (benchmarks/README.md,
"Running on an offline GPU machine"):

    python3 benchmarks/vllm_real.py --site /tmp/site            # every phase not done
    python3 benchmarks/vllm_real.py --site /tmp/site --phase cold

State lives under ``--work`` (default /tmp/wc-vllm: the checkpoint, the
daemon's socket and pid, logs, each start's outputs, ``result.json``), so
phases spread over several calls while the machine stays warm. Each call
stops starting engines when the next one would not finish by
``--deadline-s`` (default 540 s, for 600 s calls) and exits 3: call again,
it goes on where it stopped (``--phase all`` skips finished phases). It
exits 0 once the requested phases are done, 1 on a failure (recorded in the
result with the log's tail). After every call the result (and a digest of
the logs) is written to ``--out`` (default ``$OUT/vllm-real.json``
where the device tool sets ``OUT``); it belongs in
``benchmarks/results/<gpu>-vllm-real.json`` (``h100``, ``h200``: its
``machine.gpu`` names it).

Phases, in order, with their time on an H100 (2026-12-06):

- ``env`` (~30 s): GPU, driver, CUDA, the torch on each side, vLLM; vLLM's run
  path imported in the engine's environment; the weightcache plugin found
  through vLLM's own entry points; Python's asserts on (vLLM's memory
  profiler checks with one: a run with them off proves nothing); the site
  byte-compiled once (``install`` writes no bytecode and the GPU machine sets
  PYTHONDONTWRITEBYTECODE: every start compiled vLLM's sources again, 10-20 s).
- ``checkpoint`` (~1 min): a random Llama-3-8B-shaped bf16 checkpoint
  (the published names and shapes, ``config.json``, N(0, 0.02) weights and
  unit norms, 4 safetensors shards, 16.06 GB) under ``WORK/model``.
- ``cold`` (~5.5 min with ``--restarts 2``): vLLM's default loader, no daemon
  on the GPU: a first start (empty torch.compile cache; not counted),
  ``--restarts`` starts with CUDA graphs (the default), two eager and
  deterministic (``VLLM_BATCH_INVARIANT=1``: the second shows the mode is
  deterministic on this GPU), then one of each at ``--tight-utilization``
  (0.95).
- ``warm`` (~4 min): the daemon over ``vmm_fd``, ``--load-format
  weightcache``: a first start (the daemon builds vLLM's layout; not
  counted), ``--restarts`` with graphs, one eager and deterministic, one of
  each at the tight utilization.
- ``kill9`` (~1.5 min): a weightcache engine generating in a loop
  (deterministic: every batch must equal the first); ``kill -9`` of the
  daemon; the engine keeps serving; a new daemon re-adopts the engine's
  weights; a fresh engine attaches to it.
- ``report`` (seconds): outputs compared (deterministic starts bit for bit;
  graphs within the cold-vs-cold floor), vLLM's KV blocks warm vs cold per
  mode explained term by term, the device's use against a cold start plus
  the daemon's own context, restart figures. Computed after every call.

Every start is a fresh ``vllm.LLM`` in a process of its own (TP 1: one GPU),
at the same ``--gpu-memory-utilization`` both ways, and records: process
start to ready and to the first token; vLLM's own ``num_gpu_blocks`` and the
worker's memory figures (``collective_rpc``); the device bytes its load took
(free memory around ``load_model`` and around the budget call, where
weightcache attaches) and, with weightcache, the
adapter's own storage report (parameters mapped vs in engine memory); greedy
outputs (token ids and top-``--logprobs`` logprobs, the prompt's and the
generated ones) of a fixed set of token-id prompts; nvidia-smi's per-process
memory. The two arms differ only
in the load format. Both run with ``enable_prefix_caching=False`` (a
repeated prompt would otherwise be served from cached KV blocks by other
kernels, and the kill -9 loop repeats its prompts) and
``VLLM_USE_FLASHINFER_SAMPLER=0`` (FlashInfer is not carried; greedy
decoding samples nothing; see benchmarks/vllm_env.txt).

No tokenizer: the engines run with ``skip_tokenizer_init`` and token-id
prompts. A random-weight model's text means nothing; token ids and
logprobs are what two loads are compared by; and a tokenizer of
Llama-3's 128,256 tokens would have to be made up here, adding a part
that is the same in both arms and no part of loading.

The engine processes run on the offline-installed torch 2.14 and vLLM
(``--site`` first on PYTHONPATH, its NCCL on LD_LIBRARY_PATH); the daemon
and the checkpoint writer run on the image's own torch (2.11 on the H200
machine), as a sidecar image and an engine image would, with only msgspec
taken from ``--site``. vLLM finds weightcache through the same
``vllm.general_plugins`` entry point pip would register (a stub
dist-info under ``WORK/plugin``), beside a second plugin (this file,
imported as ``wcbench_probe``) that records the load and adds the
``wcbench_figures`` worker method.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCHEMA = "weightcache-vllm-real/1"
RESULT_NAME = "vllm-real.json"
LOG_DIGEST_NAME = "vllm-real-logs.txt"
PHASES = ("env", "checkpoint", "cold", "warm", "kill9", "report")
MiB = 1 << 20
DAEMON_HTTP = ("127.0.0.1", 8470)
PROBE_MODULE = "wcbench_probe"
# The published Llama-3-8B config (the shape of tests/fixtures/plans/vllm-llama-3-8b.json).
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
SHARD_BYTES = 5 * 10**9  # published checkpoints are cut at about 5 GB
# How long a start may take before it is called hung, and what the deadline reserves
# for one when no start of its kind has been timed yet (the first compiles: longer).
START_TIMEOUT_S = 480
EXIT_GRACE_S = 15
# A call's deadline (--deadline-s) leaves this much of the device tool's 600 s for the last
# start to end and the result to be written.
DEADLINE_SLACK_S = 40
FIRST_START_GUESS_S = 240
START_GUESS_S = 120
KILL9_GUESS_S = 240


# =========================================================================== pure parts


@dataclass(frozen=True)
class StartPlan:
    """One engine start of the schedule."""

    run: str  # its name in the result and its files
    arm: str  # "cold": vLLM's default loader, no daemon; "warm": --load-format weightcache
    eager: bool
    counted: bool  # a restart figure (not the first start of its arm)
    tight: bool = False  # at --tight-utilization instead of --gpu-memory-utilization
    # vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1): deterministic kernels, so two
    # loads of the same bytes must give bit-equal outputs. Eager starts run in it.
    deterministic: bool = False

    @property
    def mode(self) -> str:
        """Which starts compare with which: outputs and KV depend on it (not on the arm)."""
        return ("tight_" if self.tight else "") + ("eager" if self.eager else "graphs")


def schedule(arm: str, restarts: int) -> list[StartPlan]:
    """An arm's starts: a first one (cold: empty compile cache; warm: the daemon builds the
    layout), ``restarts`` with CUDA graphs, one eager (deterministic; cold twice: the
    second shows the mode is deterministic on this GPU), then both at the tight
    utilization."""
    if arm not in ("cold", "warm"):
        raise ValueError(f"unknown arm {arm!r}")
    if restarts < 1:
        raise ValueError("at least one restart")
    plans = [StartPlan(f"{arm}-first", arm, False, False)]
    plans += [StartPlan(f"{arm}-{i}", arm, False, True) for i in range(1, restarts + 1)]
    plans.append(StartPlan(f"{arm}-eager", arm, True, True, deterministic=True))
    if arm == "cold":
        plans.append(StartPlan("cold-eager-2", arm, True, True, deterministic=True))
    plans.append(StartPlan(f"{arm}-tight", arm, False, True, tight=True))
    plans.append(StartPlan(f"{arm}-tight-eager", arm, True, True, tight=True,
                           deterministic=True))  # fmt: skip
    return plans


def resolve_phases(spec: str) -> list[str]:
    """``all`` or a comma list of :data:`PHASES`, returned in run order."""
    names = list(PHASES) if spec == "all" else [p.strip() for p in spec.split(",") if p.strip()]
    unknown = [p for p in names if p not in PHASES]
    if unknown or not names:
        raise ValueError(f"unknown phase(s) {unknown or spec!r}; expected 'all' or some of "
                         f"{', '.join(PHASES)}")  # fmt: skip
    return [p for p in PHASES if p in names]


def default_out(environ: Mapping[str, str]) -> Path:
    """``$OUT/vllm-real.json`` where the device tool sets OUT, else the repository's."""
    if environ.get("OUT"):
        return Path(environ["OUT"]) / RESULT_NAME
    return REPO / "benchmarks" / "results" / RESULT_NAME


def parse_args(argv: Sequence[str] | None, environ: Mapping[str, str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="vllm_real", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--phase", default="all",
                        help=f"'all' (what is not done yet) or some of {', '.join(PHASES)}")
    parser.add_argument("--site", type=Path, default=Path("/tmp/site"),
                        help="the offline-installed vLLM environment (tools/offline_env.py)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/wc-vllm"))
    parser.add_argument("--out", type=Path, default=None,
                        help=f"result file (default: $OUT/{RESULT_NAME}, else benchmarks/results)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--tight-utilization", type=float, default=0.95,
                        help="the utilization of the tight starts")
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--logprobs", type=int, default=5)
    parser.add_argument("--deadline-s", type=float, default=540.0,
                        help="start no engine that would not finish within this many seconds")
    args = parser.parse_args(argv)  # fmt: skip
    try:
        args.phases = resolve_phases(args.phase)
    except ValueError as exc:
        parser.error(str(exc))
    for name in ("gpu_memory_utilization", "tight_utilization"):
        if not 0.0 < getattr(args, name) < 1.0:
            parser.error(f"--{name.replace('_', '-')} must lie between 0 and 1")
    for name in ("restarts", "prompts", "max_tokens", "logprobs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.out is None:
        args.out = default_out(environ)
    return args


def llama_tensors(config: Mapping) -> list[tuple[str, list[int]]]:
    """Every tensor of a Llama checkpoint of ``config`` in transformers' names, in the
    published checkpoints' order (embeddings, layers, final norm, lm_head)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head
    tensors = [("model.embed_tokens.weight", [config["vocab_size"], hidden])]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors += [
            (p + "input_layernorm.weight", [hidden]),
            (p + "post_attention_layernorm.weight", [hidden]),
            (p + "self_attn.q_proj.weight", [hidden, hidden]),
            (p + "self_attn.k_proj.weight", [kv, hidden]),
            (p + "self_attn.v_proj.weight", [kv, hidden]),
            (p + "self_attn.o_proj.weight", [hidden, hidden]),
            (p + "mlp.gate_proj.weight", [inter, hidden]),
            (p + "mlp.up_proj.weight", [inter, hidden]),
            (p + "mlp.down_proj.weight", [hidden, inter]),
        ]
    tensors.append(("model.norm.weight", [hidden]))
    if not config.get("tie_word_embeddings"):
        tensors.append(("lm_head.weight", [config["vocab_size"], hidden]))
    return tensors


def shard_tensors(
    tensors: Sequence[tuple[str, list[int]]], itemsize: int, limit: int = SHARD_BYTES
) -> list[list[tuple[str, list[int]]]]:
    """Consecutive tensors into shards of at most ``limit`` bytes (one tensor may exceed it
    alone), as ``save_pretrained`` cuts them."""
    shards: list[list[tuple[str, list[int]]]] = [[]]
    size = 0
    for name, shape in tensors:
        nbytes = itemsize * _numel(shape)
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def prompt_set(count: int, vocab: int, seed: int = 35) -> list[list[int]]:
    """``count`` token-id prompts of 5 to 300 tokens (a spread of prefill lengths), ids below
    the special tokens (Llama-3's start at 128000), the same for every start."""
    rng = random.Random(seed)
    lengths = [5 + (295 * i) // max(1, count - 1) for i in range(count)]
    top = min(vocab, 128000)
    return [[rng.randrange(top) for _ in range(n)] for n in lengths]


def outputs_digest(outputs: Sequence[Mapping]) -> str:
    """A short name for a set of outputs: equal digests, equal token ids and logprobs."""
    return hashlib.sha256(json.dumps(outputs, sort_keys=True).encode()).hexdigest()[:16]


def compare_outputs(reference: Sequence[Mapping], got: Sequence[Mapping]) -> dict:
    """Greedy outputs of two starts, prompt by prompt: ``equal`` only if every token id and
    every top-k logprob (ids and values, the prompt's and the generated ones) are the same;
    else where they first differ and by how much the logprobs of the positions both share
    differ at most (generated, and the prompt's: what the model says of fixed tokens, which
    greedy decoding's first flip cannot move)."""
    if len(reference) != len(got):
        return {"equal": False, "error": f"{len(got)} outputs against {len(reference)}"}
    first = None
    max_diff = 0.0
    tokens_equal = True
    prompt_diff = _max_logprob_difference(
        [pos for out in reference for pos in out.get("prompt_logprobs", [])],
        [pos for out in got for pos in out.get("prompt_logprobs", [])],
    )
    for p, (ref, out) in enumerate(zip(reference, got, strict=True)):
        if ref["token_ids"] != out["token_ids"] and tokens_equal:
            tokens_equal = False
            pairs = zip(ref["token_ids"], out["token_ids"], strict=False)
            pos = next((i for i, (a, b) in enumerate(pairs) if a != b),
                       min(len(ref["token_ids"]), len(out["token_ids"])))  # fmt: skip
            first = {"prompt": p, "position": pos,
                     "reference": ref["token_ids"][pos: pos + 1],
                     "got": out["token_ids"][pos: pos + 1]}  # fmt: skip
        max_diff = max(max_diff, _max_logprob_difference(ref["logprobs"], out["logprobs"]))
    # As JSON: pairs read back from a file (lists) compare equal to fresh ones (lists or
    # tuples), and floats by their exact repr.
    logprobs_equal = all(
        json.dumps(r["logprobs"]) == json.dumps(o["logprobs"])
        and json.dumps(r.get("prompt_logprobs")) == json.dumps(o.get("prompt_logprobs"))
        for r, o in zip(reference, got, strict=True)
    )
    return {
        "equal": tokens_equal and logprobs_equal,
        "token_ids_equal": tokens_equal,
        "logprobs_equal": logprobs_equal,
        "first_difference": first,
        "max_abs_logprob_difference": max_diff,
        "max_abs_prompt_logprob_difference": prompt_diff,
        "prompts": len(reference),
    }


def _max_logprob_difference(reference: Sequence, got: Sequence) -> float:
    """The largest |difference| of the logprobs two runs give the same token at the same
    position (positions as ``[[token, logprob], ...]`` lists)."""
    largest = 0.0
    for ref_top, out_top in zip(reference, got, strict=False):
        ref_lp, out_lp = dict(map(tuple, ref_top)), dict(map(tuple, out_top))
        for token in ref_lp.keys() & out_lp.keys():
            largest = max(largest, abs(ref_lp[token] - out_lp[token]))
    return largest


def external_weight_bytes(figures: Mapping) -> int:
    """What vLLM took off the worker's budget for weights held outside it
    (``get_external_weight_memory``): the utilization's bytes less the requested ones."""
    total = figures["init_snapshot"]["total_memory"]
    # vLLM's request_memory: math.ceil(total * utilization), less the external bytes.
    return math.ceil(total * figures["gpu_memory_utilization"]) - figures["requested_memory"]


def explain_kv(cold: Mapping, warm: Mapping) -> dict:
    """vLLM's KV cache warm (weightcache) against cold (its default loader), term by term.

    vLLM 0.33's worker sizes the cache as ``requested - (total_consumed +
    transient peak) - CUDA-graph estimate`` (``determine_available_memory``),
    where ``requested`` is ``ceil(total * utilization)`` less the external
    weight bytes and ``total_consumed`` is the device's free memory consumed
    from its snapshot to the end of profiling (the load included). The
    difference warm - cold therefore splits into: the external bytes taken off
    the budget, the bytes the cold load took, the bytes the warm load (the
    attach) took, everything else consumed, the transient peak and the graph
    estimate; ``residual`` is what those leave unexplained (0 when the
    figures obey that formula)."""

    def side(f: Mapping) -> dict:
        cg_applied = f["cudagraph_memory_estimate"] if f["cudagraph_estimate_applied"] else 0
        load = f["load"]["device_bytes"]
        return {
            "external": external_weight_bytes(f),
            "load": load,
            "other": f["total_consumed"] - load,
            "transient": f["peak_activation_memory"] - cg_applied,
            "cudagraph": cg_applied,
            "available": f["available_kv_cache_memory_bytes"],
            "blocks": f["num_gpu_blocks"],
        }

    c, w = side(cold), side(warm)
    per_block = warm["bytes_per_block"]
    if per_block != cold["bytes_per_block"]:
        raise ValueError(f"blocks differ in size: {cold['bytes_per_block']} cold, {per_block} warm")
    terms = {
        "external_weights_off_the_budget": -(w["external"] - c["external"]),
        "weights_the_cold_load_allocated": c["load"],
        "device_bytes_of_the_warm_load": -w["load"],
        "other_consumption": -(w["other"] - c["other"]),
        "transient_peak": -(w["transient"] - c["transient"]),
        "cudagraph_estimate": -(w["cudagraph"] - c["cudagraph"]),
    }
    difference = w["available"] - c["available"]
    residual = difference - sum(terms.values())
    return {
        "num_gpu_blocks": {"cold": c["blocks"], "warm": w["blocks"],
                           "difference": w["blocks"] - c["blocks"]},
        "bytes_per_block": per_block,
        "available_kv_bytes": {"cold": c["available"], "warm": w["available"],
                               "difference": difference},
        "terms_bytes": terms,
        "terms_mib": {k: round(v / MiB, 3) for k, v in terms.items()},
        "residual_bytes": residual,
        "residual_mib": round(residual / MiB, 3),
        "difference_mib": round(difference / MiB, 3),
        "difference_in_blocks": round(difference / per_block, 3),
        "external_minus_cold_load_bytes": w["external"] - c["load"],
    }  # fmt: skip


_LOG_PATTERNS: dict[str, tuple[str, Callable[[re.Match], object]]] = {
    "model_loading": (r"Model loading took ([\d.]+) GiB memory and ([\d.]+) seconds",
                      lambda m: {"gib": float(m[1]), "seconds": float(m[2])}),
    "loading_weights_s": (r"Loading weights took ([\d.]+) seconds", lambda m: float(m[1])),
    "torch_compile_s": (r"torch\.compile took ([\d.]+) s in total", lambda m: float(m[1])),
    "graph_capture": (r"Graph capturing finished in (\d+) secs, took ([\d.]+) GiB",
                      lambda m: {"seconds": int(m[1]), "gib": float(m[2])}),
    "init_engine_s": (r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
                      lambda m: float(m[1])),
    "available_kv_gib": (r"Available KV cache memory: ([\d.]+) GiB", lambda m: float(m[1])),
    "kv_cache_tokens": (r"GPU KV cache size: ([\d,]+) tokens",
                        lambda m: int(m[1].replace(",", ""))),
    "weightcache_layout": (
        r"weightcache: vLLM's own layout \(plan (\w+)\) over (\w+) from daemon pid (\d+): "
        r"(\d+) parameter\(s\) \((\d+) bytes\) mapped zero-copy, (\d+) \((\d+) bytes\) in "
        r"engine memory",
        lambda m: {"plan": m[1], "transport": m[2], "daemon_pid": int(m[3]),
                   "mapped": int(m[4]), "mapped_bytes": int(m[5]),
                   "copied": int(m[6]), "copied_bytes": int(m[7])}),
    "weightcache_checkpoint_layout": (
        r"weightcache: (\d+) tensor\(s\) \((\d+) bytes\) mapped zero-copy over (\w+) from "
        r"daemon pid (\d+); (\d+) tensor\(s\) \((\d+) bytes\) copied",
        lambda m: {"mapped": int(m[1]), "mapped_bytes": int(m[2]), "transport": m[3],
                   "daemon_pid": int(m[4]), "copied": int(m[5]), "copied_bytes": int(m[6])}),
    "weightcache_disk_fallback": (r"weightcache: loading from disk instead of the daemon: (.*)",
                                  lambda m: m[1].strip()),
    "compiled_graphs": (r"Compiling a graph for compile range", lambda m: True),
    "compile_cache_hit": (r"Directly load the compiled graph", lambda m: True),
    "model_runner_v1_fallback": (r"Model Runner V2 does not yet support (.*?); using the V1",
                                 lambda m: m[1]),
}  # fmt: skip


def parse_engine_log(text: str) -> dict:
    """What vLLM and the adapter logged about a start: the first match of each pattern
    (absent keys: not logged)."""
    found = {}
    for key, (pattern, convert) in _LOG_PATTERNS.items():
        match = re.search(pattern, text)
        if match is not None:
            found[key] = convert(match)
    found["tracebacks"] = text.count("Traceback (most recent call last)")
    return found


def parse_compute_apps(text: str) -> dict[str, int]:
    """``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits``:
    pid (a string: it is a JSON key) -> MiB."""
    apps = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            apps[parts[0]] = int(parts[1])
    return apps


def new_result() -> dict:
    return {"schema": SCHEMA, "issue": 35, "phases_done": [], "machine": {}, "settings": {},
            "checkpoint": None, "daemons": [], "starts": [], "kill9": None, "report": None,
            "errors": []}  # fmt: skip


REQUIRED_START_KEYS = ("run", "arm", "eager", "counted", "status")


def check_result(doc: Mapping) -> list[str]:
    """What is wrong with a result document's shape (empty: nothing)."""
    problems = []
    if doc.get("schema") != SCHEMA:
        problems.append(f"schema is {doc.get('schema')!r}, not {SCHEMA!r}")
    for key, kind in (("phases_done", list), ("machine", dict), ("settings", dict),
                      ("daemons", list), ("starts", list), ("errors", list)):  # fmt: skip
        if not isinstance(doc.get(key), kind):
            problems.append(f"{key} is not a {kind.__name__}")
    for phase in doc.get("phases_done", []):
        if phase not in PHASES:
            problems.append(f"unknown phase done: {phase!r}")
    runs = set()
    for start in doc.get("starts", []):
        missing = [k for k in REQUIRED_START_KEYS if k not in start]
        if missing:
            problems.append(f"start {start.get('run')!r} lacks {missing}")
        if start.get("run") in runs:
            problems.append(f"start {start.get('run')!r} recorded twice")
        runs.add(start.get("run"))
        if start.get("status") == "ok" and "figures" not in start:
            problems.append(f"start {start.get('run')!r} is ok but has no figures")
    return problems


def build_report(doc: Mapping) -> dict:
    """Outputs, KV and restart figures from the starts recorded so far."""
    from benchmarks.stats import summary

    def seconds(samples: list[float]) -> dict | None:
        return summary(samples, "s") if samples else None

    ok = [s for s in doc["starts"] if s.get("status") == "ok"]
    by_run = {s["run"]: s for s in ok}
    report: dict = {"starts_ok": len(ok),
                    "starts_failed": sum(1 for s in doc["starts"] if s.get("status") != "ok")}
    report["outputs_equal"] = {
        s["run"]: s["comparison"]["equal"] for s in ok if s.get("comparison") is not None
    }
    report["outputs"] = outputs_verdict(ok)
    restarts: dict = {}
    for arm in ("cold", "warm"):
        for mode, _, _ in KV_PAIRS:
            counted = [s for s in ok if s["arm"] == arm and s["counted"] and _mode(s) == mode]
            restarts[f"{arm}_{mode}"] = {
                "first_token_s": seconds([s["timing"]["first_token_s"] for s in counted]),
                "ready_s": seconds([s["timing"]["ready_s"] for s in counted]),
                "load_s": seconds([s["figures"]["load"]["seconds"] for s in counted]),
            }
    report["restarts"] = restarts
    daemon = (doc.get("daemon_after_warm") or {})
    pid = (daemon.get("status") or {}).get("pid")
    daemon_mib = daemon["compute_apps_mib"].get(str(pid)) if pid is not None else None
    kv = {}
    for mode, cold_run, warm_run in KV_PAIRS:
        if cold_run in by_run and warm_run in by_run:
            cold, warm = by_run[cold_run]["figures"], by_run[warm_run]["figures"]
            try:
                kv[mode] = {**explain_kv(cold, warm), **device_use(cold, warm, daemon_mib)}
            except (KeyError, ValueError) as exc:  # the figures of another vLLM: say so
                kv[mode] = {"error": repr(exc)}
    report["kv"] = kv
    report["num_gpu_blocks"] = {s["run"]: s["figures"]["num_gpu_blocks"] for s in ok}
    report["weights"] = {
        s["run"]: {"load_device_bytes": s["figures"]["load"]["device_bytes"],
                   "budget_call_device_bytes": s["figures"].get("budget", {}).get("device_bytes"),
                   "mapped": s["figures"]["load"].get("mapped"),
                   "mapped_bytes": s["figures"]["load"].get("mapped_bytes"),
                   "copied": s["figures"]["load"].get("copied"),
                   "copied_bytes": s["figures"]["load"].get("copied_bytes")}
        for s in ok
    }  # fmt: skip
    if daemon_mib is not None:
        # The daemon's own device memory: its CUDA context and the layout it holds.
        report["daemon_device_mib"] = daemon_mib
    report["asserts_on"] = (doc.get("machine") or {}).get("engine", {}).get("optimize") == 0
    return report


def _mode(start: Mapping) -> str:
    """A recorded start's :attr:`StartPlan.mode`."""
    return ("tight_" if start.get("tight") else "") + ("eager" if start["eager"] else "graphs")


# Which cold and warm starts compare, per mode: same utilization, graphs or eager.
KV_PAIRS = (("graphs", "cold-1", "warm-1"), ("eager", "cold-eager", "warm-eager"),
            ("tight_graphs", "cold-tight", "warm-tight"),
            ("tight_eager", "cold-tight-eager", "warm-tight-eager"))  # fmt: skip


def device_use(cold: Mapping, warm: Mapping, daemon_mib: int | None) -> dict:
    """The device as a whole, warm (the engine and its daemon) against cold (the engine
    alone), once each engine is ready: warm may exceed cold by the daemon's own context
    (its CUDA context and allocator, what it holds beyond the weights' allocation: its
    process's memory less the bytes the engine's budget took for the weights), never
    more; and the warm engine's KV blocks are never more than cold's."""
    used = warm["device_used_bytes"] - cold["device_used_bytes"]
    out = {"device_used_warm_minus_cold_mib": round(used / MiB, 3),
           "warm_blocks_at_most_cold": warm["num_gpu_blocks"] <= cold["num_gpu_blocks"]}
    if daemon_mib is not None:
        context = daemon_mib - external_weight_bytes(warm) / MiB
        out["daemon_context_mib"] = round(context, 3)
        out["warm_device_use_at_most_cold_plus_daemon_context"] = used / MiB <= context
    return out


def outputs_verdict(ok: Sequence[Mapping]) -> dict:
    """What the outputs say about weightcache, per mode. Deterministic (batch-invariant)
    starts: every cold one bit-equal to the first shows the mode holds on this GPU, and
    then warm must be bit-equal too. Graphs (vLLM's defaults, not deterministic): the
    noise floor is the largest logprob difference between cold starts; warm must lie
    within it."""
    verdict: dict = {}
    for deterministic in (True, False):
        starts = [s for s in ok if s.get("comparison") is not None
                  and s.get("deterministic", False) == deterministic]  # fmt: skip
        cold = [s["comparison"] for s in starts if s["arm"] == "cold"]
        warm = [s["comparison"] for s in starts if s["arm"] == "warm"]
        if not warm:
            continue
        if deterministic:
            verdict["deterministic"] = {
                "method": "VLLM_BATCH_INVARIANT=1, eager: bit-equal required",
                "cold_vs_cold_bit_equal": bool(cold) and all(c["equal"] for c in cold),
                "warm_bit_equal": all(c["equal"] for c in warm),
            }
            continue
        floor = max((max(c["max_abs_logprob_difference"],
                         c.get("max_abs_prompt_logprob_difference", 0.0)) for c in cold),
                    default=None)  # fmt: skip
        worst = max(max(c["max_abs_logprob_difference"],
                        c.get("max_abs_prompt_logprob_difference", 0.0)) for c in warm)
        verdict["graphs"] = {
            "method": "vLLM's defaults (not deterministic): within the cold-vs-cold floor",
            "cold_vs_cold_floor": floor,
            "warm_max_difference": worst,
            "warm_within_floor": floor is not None and worst <= floor,
            "bit_equal": all(c["equal"] for c in warm),
        }
    return verdict


# =========================================================================== the probe plugin
# Imported in every vLLM process as ``wcbench_probe`` (a stub dist-info's
# vllm.general_plugins entry point): it records what load_model did to the
# device and gives the worker a ``wcbench_figures`` method for collective_rpc.

_PROBE: dict = {}
_DEPTH = [0]


def probe_plugin() -> None:
    """vLLM's plugin hook: wrap the loaders' load_model, add the figures method."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.v1.worker.worker_base import WorkerBase

    classes: list[type] = [BaseModelLoader]
    try:
        from weightcache.integrations.vllm.loader import WeightcacheModelLoader
    except ImportError as exc:  # recorded: the cold arm runs without it
        _PROBE["weightcache_import_error"] = repr(exc)
    else:
        classes.append(WeightcacheModelLoader)
    for cls in classes:
        for name, wrap in (("load_model", _recording), ("get_external_weight_memory", _budget)):
            original = cls.__dict__.get(name)
            if original is not None and not getattr(original, "wcbench", False):
                setattr(cls, name, wrap(original))
    WorkerBase.wcbench_figures = _worker_figures


def _budget(original: Callable) -> Callable:
    """Record what the worker's budget call did to the device: with weightcache it attaches
    (maps the layout: its page tables) and, on a daemon's first engine, has it build the
    layout; the device's free memory shows the daemon's allocations too."""

    def get_external_weight_memory(self, vllm_config):  # noqa: ANN001, ANN202 - vLLM's
        import torch

        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        started = time.perf_counter()
        external = original(self, vllm_config)
        torch.cuda.synchronize()
        _PROBE.setdefault("budget", {
            "seconds": time.perf_counter() - started,
            "device_bytes": free_before - torch.cuda.mem_get_info()[0],
            "external_bytes": external,
        })  # fmt: skip
        return external

    get_external_weight_memory.wcbench = True
    return get_external_weight_memory


def _recording(original: Callable) -> Callable:
    def load_model(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - vLLM's
        import torch

        _DEPTH[0] += 1
        outer = _DEPTH[0] == 1
        try:
            if outer:
                torch.cuda.synchronize()
                free_before = torch.cuda.mem_get_info()[0]
                allocated_before = torch.cuda.memory_allocated()
                started = time.perf_counter()
            model = original(self, *args, **kwargs)
            if outer:
                torch.cuda.synchronize()
                seconds = time.perf_counter() - started
                free_after = torch.cuda.mem_get_info()[0]
                _PROBE["load"] = {
                    "loader": type(self).__name__,
                    "seconds": seconds,
                    "device_bytes": free_before - free_after,
                    "torch_allocated_bytes": torch.cuda.memory_allocated() - allocated_before,
                    **_adapter_report(self, args, kwargs),
                }
            return model
        finally:
            _DEPTH[0] -= 1

    load_model.wcbench = True
    return load_model


def _adapter_report(loader: object, args: tuple, kwargs: dict) -> dict:
    """The weightcache loader's own storage report of this load (nothing for vLLM's)."""
    layout_load = getattr(loader, "layout_load", None)
    if layout_load is not None:
        report = {"path": "engine layout", "mapped": len(layout_load.mapped),
                  "mapped_bytes": layout_load.mapped_bytes, "copied": len(layout_load.copied),
                  "copied_bytes": layout_load.copied_bytes,
                  "copied_why": dict(list(layout_load.copied.items())[:10])}  # fmt: skip
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        try:
            decision = loader.layout(vllm_config)
        except Exception as exc:  # noqa: BLE001 - recorded, the load itself succeeded
            report["decision_error"] = repr(exc)
        else:
            attached = decision.attached
            report.update({
                "layout_bytes": decision.layout_bytes,
                "daemon_bytes_change": decision.daemon_bytes_change,
                "transport": getattr(attached, "transport", None),
                "daemon_pid": getattr(attached, "daemon_pid", None),
                "reason": decision.reason,
            })  # fmt: skip
        return report
    checkpoint = getattr(loader, "report", None)
    if checkpoint is not None:
        return {"path": "checkpoint layout", "mapped": len(checkpoint.mapped),
                "mapped_bytes": checkpoint.mapped_bytes, "copied": len(checkpoint.copied),
                "copied_bytes": checkpoint.copied_bytes}  # fmt: skip
    return {}


def _worker_figures(worker: object) -> dict:
    """The worker's memory figures after initialisation (runs in the worker process)."""
    import torch
    import vllm.envs as envs

    runner = worker.model_runner
    snapshot = worker.init_snapshot
    kv_config = runner.kv_cache_config
    per_block = sum(group.kv_cache_spec.page_size_bytes * len(group.layer_names)
                    for group in kv_config.kv_cache_groups)  # fmt: skip
    free, total = torch.cuda.mem_get_info()
    return {
        "runner": f"{type(runner).__module__}.{type(runner).__qualname__}",
        "gpu_memory_utilization": worker.cache_config.gpu_memory_utilization,
        "init_snapshot": {k: getattr(snapshot, k) for k in (
            "free_memory", "total_memory", "cuda_memory", "torch_memory", "non_torch_memory")},
        "requested_memory": worker.requested_memory,
        "model_memory_usage": runner.model_memory_usage,
        "total_consumed": worker.total_consumed,
        "peak_activation_memory": worker.peak_activation_memory,
        "cudagraph_memory_estimate": worker.cudagraph_memory_estimate,
        "cudagraph_estimate_applied": bool(envs.VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS),
        "available_kv_cache_memory_bytes": worker.available_kv_cache_memory_bytes,
        "num_gpu_blocks": kv_config.num_blocks,
        "bytes_per_block": per_block,
        "device_free_bytes": free,
        "device_used_bytes": total - free,
        "torch_reserved_bytes": torch.cuda.memory_reserved(),
        "torch_allocated_bytes": torch.cuda.memory_allocated(),
        "load": dict(_PROBE.get("load", {})),
        "budget": dict(_PROBE.get("budget", {})),
        "probe": {k: v for k, v in _PROBE.items() if k not in ("load", "budget")},
    }  # fmt: skip


# =========================================================================== the engine process


def engine_main(spec_path: Path) -> int:
    """One vLLM start (``_engine SPEC``): the timeline, the outputs, the worker's figures;
    with ``serve`` set, generate the prompt set in a loop until ``stop`` exists."""
    spec = json.loads(spec_path.read_text())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    times = {"imported": time.time()}
    kwargs = dict(model=spec["model"], dtype="bfloat16", tensor_parallel_size=1,
                  gpu_memory_utilization=spec["gpu_memory_utilization"],
                  skip_tokenizer_init=True, enable_prefix_caching=False, seed=0,
                  enforce_eager=spec["eager"])  # fmt: skip
    if spec["arm"] == "warm":
        kwargs["load_format"] = "weightcache"
        kwargs["model_loader_extra_config"] = {
            "socket": spec["socket"], "transports": ["vmm_fd"], "fallback": False,
        }  # fmt: skip
    llm = LLM(**kwargs)
    times["ready"] = time.time()
    greedy1 = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=[128000, 1, 2, 3])], greedy1, use_tqdm=False)
    times["first_token"] = time.time()
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True,
                            logprobs=spec["logprobs"], prompt_logprobs=spec["logprobs"],
                            detokenize=False)  # fmt: skip

    def generate() -> list[dict]:
        return [_output(r) for r in llm.generate(prompts, params, use_tqdm=False)]

    outputs = generate()
    (figures,) = llm.collective_rpc("wcbench_figures")
    figures["num_gpu_blocks_engine"] = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    figures["compute_apps_mib"] = parse_compute_apps(_nvidia_smi_apps())
    result = {"times": times, "outputs": outputs, "figures": figures, "pid": os.getpid()}
    if spec.get("serve"):
        result["batches"] = _serve(generate, outputs, Path(spec["events"]), Path(spec["stop"]))
    _write_json(Path(spec["result"]), result)
    return 0


def _output(request: object) -> dict:
    completion = request.outputs[0]
    # The prompt's first token has no logprob (nothing precedes it): None, left out.
    prompt = [p for p in (request.prompt_logprobs or []) if p is not None]
    return {"token_ids": list(completion.token_ids),
            "logprobs": [_top(position) for position in completion.logprobs],
            "prompt_logprobs": [_top(position) for position in prompt]}  # fmt: skip


def _top(position: Mapping) -> list[list]:
    return sorted(([int(t), float(lp.logprob)] for t, lp in position.items()),
                  key=lambda e: (-e[1], e[0]))  # fmt: skip


def _serve(generate: Callable[[], list[dict]], reference: list[dict], events: Path,
           stop: Path) -> dict:  # fmt: skip
    """Generate until ``stop`` appears, one event line per batch: when, and whether its
    outputs equal the first batch's."""
    served = equal = failed = 0
    with events.open("a") as log:
        while not stop.exists():
            started = time.time()
            try:
                ok = generate() == reference
                error = None
            except Exception as exc:  # noqa: BLE001 - a failed request is what is counted
                ok, error = False, repr(exc)
                failed += 1
            served += 1
            equal += ok
            log.write(json.dumps({"t": time.time(), "started": started, "equal": ok,
                                  "error": error}) + "\n")  # fmt: skip
            log.flush()
            time.sleep(0.2)
    return {"served": served, "equal": equal, "failed": failed}


def _nvidia_smi_apps() -> str:
    return _run_text(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                      "--format=csv,noheader,nounits"])  # fmt: skip


def _run_text(cmd: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 60) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=None if env is None else dict(env)).stdout.strip()  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _write_json(path: Path, data: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


# =========================================================================== the orchestrator


class Incomplete(Exception):
    """The deadline came before the phase's work was done: call again."""


class Bench:
    """The run's state under ``--work`` and the processes it starts."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work: Path = args.work
        self.model = self.work / "model"
        self.socket = self.work / "sock" / "gpu.sock"
        self.logs = self.work / "logs"
        self.outputs = self.work / "outputs"
        self.result_path = self.work / "result.json"
        self.deadline = time.monotonic() + args.deadline_s
        for d in (self.logs, self.outputs, self.work / "spec"):
            d.mkdir(parents=True, exist_ok=True)
        self.socket.parent.mkdir(mode=0o700, exist_ok=True)
        self.doc = json.loads(self.result_path.read_text()) if self.result_path.exists() \
            else new_result()
        self.logs_this_call: list[Path] = []
        self.kill_leftover_engine()

    # ---------------------------------------------------------------- environments

    def engine_env(self) -> dict[str, str]:
        site = str(self.args.site)
        env = dict(os.environ)
        env.update({
            "PYTHONPATH": os.pathsep.join([site, str(REPO / "sidecar"), str(self.plugin_dir())]),
            "LD_LIBRARY_PATH": os.pathsep.join(
                p for p in [f"{site}/nvidia/nccl/lib", os.environ.get("LD_LIBRARY_PATH")] if p),
            "PYTHONUNBUFFERED": "1",
            "VLLM_USE_FLASHINFER_SAMPLER": "0",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CACHE_ROOT": str(self.work / "cache" / "vllm"),
            "TRITON_CACHE_DIR": str(self.work / "cache" / "triton"),
            "XDG_CACHE_HOME": str(self.work / "cache"),
        })  # fmt: skip
        return env

    def daemon_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(self.daemon_site()), str(REPO / "sidecar")])
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def plugin_dir(self) -> Path:
        """Stub distributions whose entry points vLLM loads: weightcache's (as pyproject.toml
        registers it) and this file's probe, importable as ``wcbench_probe``."""
        plugin = self.work / "plugin"
        stubs = {
            "weightcache-0.1.0.dist-info": "weightcache = weightcache.integrations.vllm:register",
            "wcbench_probe-0.dist-info": f"wcbench = {PROBE_MODULE}:probe_plugin",
        }
        for name, entry in stubs.items():
            dist = plugin / name
            dist.mkdir(parents=True, exist_ok=True)
            project, version = name.removesuffix(".dist-info").split("-")
            (dist / "METADATA").write_text(
                f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n")
            (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{entry}\n")
        link = plugin / f"{PROBE_MODULE}.py"
        if not link.exists():
            link.symlink_to(Path(__file__).resolve())
        return plugin

    def daemon_site(self) -> Path:
        """The one package the daemon needs that the image lacks (msgspec), from --site."""
        site = self.work / "daemon-site"
        site.mkdir(exist_ok=True)
        for entry in self.args.site.glob("msgspec*"):
            link = site / entry.name
            if not link.exists():
                link.symlink_to(entry)
        return site

    # ---------------------------------------------------------------- bookkeeping

    def save(self) -> None:
        out = self.args.out
        self.doc["report"] = build_report(self.doc)
        self.doc["result_problems"] = check_result(self.doc)
        _write_json(self.result_path, self.doc)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.result_path, out)
        digest = out.with_name(LOG_DIGEST_NAME)
        with digest.open("w") as f:
            for path in [*self.logs_this_call, *sorted(self.logs.glob("daemon-*.log"))[-2:]]:
                lines = path.read_text(errors="replace").splitlines()
                f.write(f"==== {path.name} (last 80 of {len(lines)} lines)\n")
                f.write("\n".join(lines[-80:]) + "\n")

    def run_logged(self, name: str, *args: str, env: dict[str, str]) -> tuple[int, str]:
        """This file's ``args`` subcommand in ``env``, its output in ``logs/<name>.log``."""
        log = self.logs / f"{name}.log"
        self.logs_this_call.append(log)
        with log.open("w") as out:
            code = subprocess.run([sys.executable, str(Path(__file__).resolve()), *args],
                                  env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=600).returncode  # fmt: skip
        return code, log.read_text(errors="replace")

    def done(self, phase: str) -> None:
        if phase not in self.doc["phases_done"]:
            self.doc["phases_done"].append(phase)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    # ---------------------------------------------------------------- the daemon

    def kill_leftover_engine(self) -> None:
        """An engine of an earlier call cut off by the device tool's limit runs on in its own
        session, holding the GPU: end it before anything else."""
        path = self.work / "engine.pid"
        if path.exists():
            pid = int(path.read_text())
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                _say(f"killed the engine process group {pid} an earlier call left running")
            path.unlink()

    def daemon_pid(self) -> int | None:
        path = self.work / "daemon.json"
        if not path.exists():
            return None
        pid = json.loads(path.read_text())["pid"]
        return pid if _alive(pid) else None

    def start_daemon(self, why: str) -> dict:
        """A daemon on the checkpoint over vmm_fd, in a session of its own (it outlives this
        call), waited for until ready; returns its record."""
        n = len(self.doc["daemons"])
        log = self.logs / f"daemon-{n}.log"
        started = time.time()
        proc = subprocess.Popen(
            [sys.executable, "-m", "weightcache.daemon.cli", "serve", "--model", str(self.model),
             "--device", "cuda:0", "--transport", "vmm_fd", "--socket", str(self.socket),
             "--http-address", ":".join(map(str, DAEMON_HTTP))],
            env=self.daemon_env(), stdout=log.open("w"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        _write_json(self.work / "daemon.json", {"pid": proc.pid, "log": str(log)})
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the daemon exited ({proc.returncode}): {_tail(log)}")
            if _http(DAEMON_HTTP, "/readyz")[0] == 200:
                break
            if time.time() - started > 600:
                raise RuntimeError(f"the daemon was not ready after 600 s: {_tail(log)}")
            time.sleep(0.1)
        ready = time.time()
        record = {"n": n, "why": why, "pid": proc.pid, "spawn_to_ready_s": ready - started,
                  "status": self.daemon_status()}  # fmt: skip
        self.doc["daemons"].append(record)
        _say(f"daemon {n} (pid {proc.pid}) ready in {record['spawn_to_ready_s']:.1f} s: "
             f"{record['status'].get('load_source')}, {record['status'].get('load_reason')}")
        return record

    def daemon_status(self) -> dict:
        """The daemon's full status (load_reason included: the socket's, not HTTP's)."""
        text = _run_text([sys.executable, "-m", "weightcache.daemon.cli", "status", "--socket",
                          str(self.socket)], env=self.daemon_env(), timeout=120)  # fmt: skip
        try:
            return json.loads(text)
        except ValueError:
            return {"unreadable": text[-2000:]}

    def stop_daemon(self) -> None:
        pid = self.daemon_pid()
        if pid is None:
            return
        os.kill(pid, signal.SIGTERM)
        if not _wait(lambda: not _alive(pid), 60):
            os.kill(pid, signal.SIGKILL)
            _wait(lambda: not _alive(pid), 30)
        _say(f"daemon pid {pid} stopped")

    def ensure_daemon(self) -> int:
        pid = self.daemon_pid()
        if pid is None:
            pid = self.start_daemon("warm phase")["pid"]
        return pid

    # ---------------------------------------------------------------- engine starts

    def start_engine(
        self, plan: StartPlan,
        while_serving: Callable[[Path, subprocess.Popen], None] | None = None,
    ) -> dict:  # fmt: skip
        """One engine process for ``plan``; its record (also on failure). With
        ``while_serving``, the engine generates in a loop while that runs (given the engine's
        event file and process), then stops."""
        self.wait_gpu_idle()
        spec_path = self.work / "spec" / f"{plan.run}.json"
        result_path = self.outputs / f"{plan.run}.json"
        result_path.unlink(missing_ok=True)
        log = self.logs / f"{plan.run}.log"
        self.logs_this_call.append(log)
        spec = {
            "model": str(self.model), "arm": plan.arm, "eager": plan.eager,
            "socket": str(self.socket), "result": str(result_path),
            "gpu_memory_utilization": self.args.tight_utilization if plan.tight
            else self.args.gpu_memory_utilization,
            "prompts": prompt_set(self.args.prompts, LLAMA3_8B["vocab_size"]),
            "max_tokens": self.args.max_tokens, "logprobs": self.args.logprobs,
            "serve": while_serving is not None,
            "events": str(self.work / f"{plan.run}.events"),
            "stop": str(self.work / f"{plan.run}.stop"),
        }  # fmt: skip
        for key in ("events", "stop"):
            Path(spec[key]).unlink(missing_ok=True)
        _write_json(spec_path, spec)
        free_before = _gpu_free_bytes()
        _say(f"{plan.run}: starting ({plan.arm}, {plan.mode}, utilization "
             f"{spec['gpu_memory_utilization']}{', deterministic' if plan.deterministic else ''})")
        env = self.engine_env()
        if plan.deterministic:
            env["VLLM_BATCH_INVARIANT"] = "1"
        t0 = time.time()
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "_engine", str(spec_path)],
            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        (self.work / "engine.pid").write_text(str(proc.pid))
        serving_error = None
        try:
            if while_serving is not None:
                try:
                    while_serving(Path(spec["events"]), proc)
                except Exception as exc:  # noqa: BLE001 - recorded with the engine's log
                    serving_error = repr(exc)
                Path(spec["stop"]).touch()
            # Done when it exits, or once its result is written: vLLM's own shutdown is
            # given EXIT_GRACE_S, then the group is killed (a hung teardown costs no more).
            # Never past the deadline's slack: a start cut off by the device tool would leave
            # no result behind.
            limit = min(START_TIMEOUT_S, max(60.0, self.left() + DEADLINE_SLACK_S))
            _wait(lambda: proc.poll() is not None or result_path.exists(), limit)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(EXIT_GRACE_S)
            code = proc.poll()
        finally:
            # The engine core is the driver's child, in its session: nothing outlives it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            (self.work / "engine.pid").unlink(missing_ok=True)
        wall = time.time() - t0
        text = log.read_text(errors="replace")
        record: dict = {"run": plan.run, "arm": plan.arm, "eager": plan.eager,
                        "counted": plan.counted, "tight": plan.tight,
                        "deterministic": plan.deterministic,
                        "gpu_memory_utilization": spec["gpu_memory_utilization"],
                        "wall_s": wall, "exit_code": code,
                        "device_free_before_bytes": free_before,
                        "log": parse_engine_log(text)}  # fmt: skip
        if serving_error is not None or not result_path.exists():
            record["status"] = "timed out" if code is None else "failed"
            record["error"] = serving_error
            record["log_tail"] = text.splitlines()[-60:]
            return record
        result = json.loads(result_path.read_text())
        times = result["times"]
        record.update({
            "status": "ok",
            "timing": {"import_s": times["imported"] - t0, "ready_s": times["ready"] - t0,
                       "first_token_s": times["first_token"] - t0},
            "figures": result["figures"],
            "outputs_digest": outputs_digest(result["outputs"]),
        })  # fmt: skip
        if "batches" in result:
            record["batches"] = result["batches"]
        record["comparison"] = self.compare(plan, result["outputs"])
        return record

    def compare(self, plan: StartPlan, outputs: list[dict]) -> dict | None:
        """Against the first ok start of the same kernels (graphs, eager, deterministic or
        not; the utilization changes no output): that start's outputs are the reference
        (None for the reference itself)."""
        for start in self.doc["starts"]:
            if (start.get("status") == "ok" and start["eager"] == plan.eager
                    and start.get("deterministic", False) == plan.deterministic):
                reference = json.loads((self.outputs / f"{start['run']}.json").read_text())
                return {"reference": start["run"],
                        **compare_outputs(reference["outputs"], outputs)}
        return None

    def record(self, start: dict) -> None:
        """Keep a start's record (replacing an earlier try); a failed start stops the phase:
        the next would most likely fail alike, at device time's cost."""
        self.doc["starts"] = [s for s in self.doc["starts"] if s["run"] != start["run"]]
        self.doc["starts"].append(start)
        self.save()  # a call cut off later still leaves this start's record in --out
        if start["status"] != "ok":
            _say(f"{start['run']}: {start['status']} (exit {start['exit_code']}, "
                 f"{start.get('error')}); log tail in the result")  # fmt: skip
            raise RuntimeError(f"start {start['run']} {start['status']}")
        comparison = start.get("comparison") or {"equal": "reference"}
        _say(f"{start['run']}: first token at {start['timing']['first_token_s']:.1f} s, "
             f"{start['figures']['num_gpu_blocks']} KV blocks, outputs equal: "
             f"{comparison['equal']}")  # fmt: skip

    def wait_gpu_idle(self) -> None:
        """No engine process of ours left on the GPU (the daemon may stay): the next start
        must find the memory a fresh GPU has."""
        daemon = str(self.daemon_pid())

        def others() -> list[str]:
            return [pid for pid in parse_compute_apps(_nvidia_smi_apps()) if pid != daemon]

        if _wait(lambda: not others(), 60):
            return
        # Pids nvidia-smi shows that this machine's /proc does not know belong to another
        # PID namespace: say so and go on (each start records the free memory it found).
        local = [pid for pid in others() if _alive(int(pid))]
        if local:
            raise RuntimeError(f"the GPU still runs processes {local}: {_nvidia_smi_apps()}")
        _say(f"nvidia-smi lists processes not in this /proc: {others()}; going on")

    def run_schedule(self, plans: list[StartPlan]) -> None:
        done = {s["run"] for s in self.doc["starts"] if s.get("status") == "ok"}
        for plan in plans:
            if plan.run in done:
                continue
            guess = self.duration_guess(plan)
            if self.left() < guess:
                raise Incomplete(f"{plan.run} needs about {guess:.0f} s, {self.left():.0f} s left")
            self.record(self.start_engine(plan))

    def duration_guess(self, plan: StartPlan) -> float:
        walls = [s["wall_s"] for s in self.doc["starts"]
                 if s.get("status") == "ok" and s["eager"] == plan.eager
                 and s["counted"]]  # fmt: skip
        if plan.run.endswith("-first") or not walls:
            walls += [FIRST_START_GUESS_S if plan.run == "cold-first" else START_GUESS_S]
        return max(walls) * 1.2

    # ---------------------------------------------------------------- phases

    def phase_env(self) -> None:
        from tools.offline_env import INSTALLED_MARKER

        precompile_s = self.precompile()
        code, text = self.run_logged("envcheck", "_envcheck", env=self.engine_env())
        engine = _json_of(text)
        image = _json_of(_run_text([sys.executable, "-c",
                                    "import json, torch; print(json.dumps({'torch': "
                                    "torch.__version__, 'cuda': torch.version.cuda}))"],
                                   env=self.daemon_env()))  # fmt: skip
        smi = _run_text(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                         "--format=csv,noheader"])  # fmt: skip
        self.doc["machine"] = {
            "gpu": smi, "engine": engine, "daemon": image,
            "python": platform.python_version(), "kernel": platform.release(),
            "cpu": _cpu_model(), "cpu_cores": os.cpu_count(),
            "site": str(self.args.site),
            "offline_env_pack": _json_of(_read(self.args.site / INSTALLED_MARKER)).get("pack_id"),
            "precompile_s": precompile_s,
        }  # fmt: skip
        _say(f"env: {json.dumps(self.doc['machine'])[:1500]}")
        if code != 0 or engine.get("import_failures") or not engine.get("weightcache_supports"):
            raise RuntimeError(f"the engine environment is not usable: {engine or text[-3000:]}")
        wanted = {"weightcache.integrations.vllm:register", f"{PROBE_MODULE}:probe_plugin"}
        if not wanted <= set(engine.get("plugins", [])):
            raise RuntimeError(f"vLLM does not see the plugins: {engine.get('plugins')}")
        if engine.get("optimize"):
            raise RuntimeError("Python runs with its assert statements removed (PYTHONOPTIMIZE): "
                               "vLLM's memory profiler checks with one; unset it")  # fmt: skip
        self.doc["settings"] = {
            "gpu_memory_utilization": self.args.gpu_memory_utilization,
            "tight_utilization": self.args.tight_utilization,
            "restarts": self.args.restarts, "prompts": self.args.prompts,
            "max_tokens": self.args.max_tokens, "logprobs": self.args.logprobs,
            "tensor_parallel_size": 1, "enable_prefix_caching": False,
            "skip_tokenizer_init": True, "transport": "vmm_fd",
            "engine_env": {k: v for k, v in self.engine_env().items()
                           if k.startswith(("VLLM_", "PYTHONPATH", "LD_LIBRARY_PATH"))},
        }  # fmt: skip

    def precompile(self) -> float | None:
        """Byte-compile the offline site once (``install`` runs pip with --no-compile, and
        an engine's imports would otherwise compile vLLM's sources at every start when
        bytecode cannot be written); seconds it took, None when done earlier."""
        marker = self.args.site / ".wcbench-compiled"
        if marker.exists():
            return None
        started = time.time()
        subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0",
                        str(self.args.site)], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=300)  # fmt: skip
        marker.touch()
        return time.time() - started

    def phase_checkpoint(self) -> None:
        marker = self.model / "wcbench.json"
        if marker.exists():
            self.doc["checkpoint"] = json.loads(marker.read_text())
            return
        self.stop_daemon()  # nothing may hold the old checkpoint's bytes
        started = time.time()
        code, text = self.run_logged("checkpoint", "_checkpoint", str(self.model),
                                     env=self.daemon_env())  # fmt: skip
        if code != 0 or not marker.exists():
            raise RuntimeError(f"writing the checkpoint failed ({code}): {text[-3000:]}")
        self.doc["checkpoint"] = {**json.loads(marker.read_text()),
                                  "wall_s": time.time() - started}  # fmt: skip
        _say(f"checkpoint: {self.doc['checkpoint']}")

    def phase_cold(self) -> None:
        self.stop_daemon()  # a cold start has the GPU to itself
        self.run_schedule(schedule("cold", self.args.restarts))

    def phase_warm(self) -> None:
        self.ensure_daemon()
        self.run_schedule(schedule("warm", self.args.restarts))
        self.doc["daemon_after_warm"] = {
            "status": self.daemon_status(),
            "compute_apps_mib": parse_compute_apps(_nvidia_smi_apps()),
        }  # fmt: skip

    def phase_kill9(self) -> None:
        if self.left() < KILL9_GUESS_S:
            raise Incomplete(f"kill9 needs about {KILL9_GUESS_S} s, {self.left():.0f} s left")
        old = self.ensure_daemon()
        kill: dict = {"old_daemon_pid": old}

        def while_serving(events: Path, proc: subprocess.Popen) -> None:
            def served_since(t: float) -> int:
                if proc.poll() is not None:
                    raise RuntimeError(f"the serving engine exited ({proc.returncode})")
                return sum(1 for e in _events(events) if e["started"] > t)

            if not _wait(lambda: served_since(0) >= 2, START_TIMEOUT_S):
                raise RuntimeError("the serving engine never served two batches")
            kill["killed_at"] = time.time()
            os.kill(old, signal.SIGKILL)
            kill["old_daemon_gone"] = _wait(lambda: not _alive(old), 30)
            if not _wait(lambda: served_since(kill["killed_at"]) >= 3, 120):
                raise RuntimeError("the engine served no three batches without its daemon")
            kill["restarted_at"] = time.time()
            kill["new_daemon"] = self.start_daemon("after kill -9 of the previous one")
            kill["new_daemon_ready_at"] = time.time()
            if not _wait(lambda: served_since(kill["new_daemon_ready_at"]) >= 3, 120):
                raise RuntimeError("the engine served no three batches after the new daemon")

        # Deterministic, so every batch must equal the first: a wrong answer is one that
        # differs, not kernel noise.
        serving = self.start_engine(
            StartPlan("kill9-serving", "warm", True, False, deterministic=True),
            while_serving=while_serving)  # fmt: skip
        self.record(serving)
        events = _events(self.work / "kill9-serving.events")
        killed, restarted = kill["killed_at"], kill["restarted_at"]
        kill["batches"] = {
            "before_kill": sum(1 for e in events if e["started"] < killed),
            "without_a_daemon": sum(1 for e in events if killed <= e["started"] < restarted),
            "after_the_restart": sum(1 for e in events if e["started"] >= restarted),
            "failed": sum(1 for e in events if e["error"]),
            "not_equal_to_the_first": sum(1 for e in events if not e["equal"]),
        }  # fmt: skip
        kill["readopted"] = kill["new_daemon"]["status"].get("load_source") == "readopted"
        fresh = self.start_engine(
            StartPlan("kill9-fresh", "warm", True, False, deterministic=True))
        self.record(fresh)
        kill["fresh_engine_equal"] = (fresh.get("comparison") or {}).get("equal")
        self.doc["kill9"] = kill
        _say(f"kill9: {json.dumps(kill)[:1500]}")


def _events(path: Path) -> list[dict]:
    """The engine's event lines so far; a last line it is still writing is not one yet."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line.strip()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _wait(condition: Callable[[], bool], seconds: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


def _http(address: tuple[str, int], path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{address[0]}:{address[1]}{path}", timeout=2) as r:
            return r.status, r.read().decode()
    except OSError as exc:
        return getattr(exc, "code", 0) or 0, ""


def _gpu_free_bytes() -> int | None:
    text = _run_text(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"])
    return int(text.splitlines()[0]) * MiB if text[:1].isdigit() else None


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _json_of(text: str) -> dict:
    for line in reversed(text.splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return {}


def _cpu_model() -> str:
    for line in _read(Path("/proc/cpuinfo")).splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _say(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)


def envcheck_main() -> int:
    """Versions and vLLM's run path in the engine's environment (``_envcheck``), as JSON."""
    import importlib
    import importlib.metadata as md

    import torch
    import vllm

    from weightcache.integrations.versions import detect

    failed = {}
    for module in ("vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.worker.gpu_worker",
                   "vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu_model_runner",
                   "vllm.model_executor.models.llama", "vllm.v1.attention.backends.flash_attn",
                   "weightcache.integrations.vllm.loader"):  # fmt: skip
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - each failure is reported
            failed[module] = repr(exc)
    print(json.dumps({
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(), "gpu": torch.cuda.get_device_name(0),
        "capability": list(torch.cuda.get_device_capability(0)),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())), "vllm": vllm.__version__,
        "transformers": md.version("transformers"), "triton": md.version("triton"),
        "import_failures": failed,
        "plugins": sorted(e.value for e in md.entry_points(group="vllm.general_plugins")),
        "weightcache_supports": detect("vllm").ok,
        # 0: Python's assert statements run (vLLM's memory profiler checks with one).
        "optimize": sys.flags.optimize,
        "dont_write_bytecode": sys.flags.dont_write_bytecode,
    }), flush=True)  # fmt: skip
    return 0


def checkpoint_main(model: Path) -> int:
    """Write the random Llama-3-8B checkpoint (``_checkpoint DIR``, the image's torch)."""
    import torch
    from safetensors.torch import save_file

    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(LLAMA3_8B, indent=1))
    generator = torch.Generator(device="cuda").manual_seed(35)
    shards = shard_tensors(llama_tensors(LLAMA3_8B), itemsize=2)
    weight_map, total = {}, 0
    started = time.time()
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for tensor, shape in shard:
            if tensor.endswith("norm.weight"):
                value = torch.ones(shape, dtype=torch.bfloat16)
            else:
                value = (torch.randn(shape, generator=generator, device="cuda") * 0.02).to(
                    torch.bfloat16).cpu()  # fmt: skip
            tensors[tensor] = value
            weight_map[tensor] = name
            total += value.numel() * value.element_size()
        save_file(tensors, str(model / name), metadata={"format": "pt"})
        _say(f"wrote {name}")
        del tensors
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    _write_json(model / "wcbench.json", {"bytes": total, "tensors": len(weight_map),
                                         "shards": len(shards), "write_s": time.time() - started,
                                         "torch": torch.__version__})  # fmt: skip
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_engine"]:
        return engine_main(Path(argv[1]))
    if argv[:1] == ["_envcheck"]:
        return envcheck_main()
    if argv[:1] == ["_checkpoint"]:
        return checkpoint_main(Path(argv[1]))
    if str(REPO) not in sys.path:  # run as a file: benchmarks.stats for the report
        sys.path.insert(0, str(REPO))
    args = parse_args(argv, os.environ)
    bench = Bench(args)
    code, phase = 0, args.phases[0]
    try:
        for phase in args.phases:
            if phase in bench.doc["phases_done"] and phase != "report":
                _say(f"{phase}: done earlier")
                continue
            _say(f"{phase}: starting, {bench.left():.0f} s left before the deadline")
            if phase != "report":
                getattr(bench, f"phase_{phase}")()
            bench.done(phase)
            bench.save()
    except Incomplete as exc:
        _say(f"not finished, call again: {exc}")
        code = 3
    except Exception as exc:
        bench.doc["errors"].append({"phase": phase, "error": repr(exc), "at": time.time()})
        _say(f"{phase} failed: {exc!r}")
        code = 1
    bench.save()
    report = bench.doc["report"]
    _say(f"result in {args.out}: phases done {bench.doc['phases_done']}; "
         f"outputs {json.dumps(report.get('outputs'))}; "
         f"kv {json.dumps(report.get('kv', {}).get('graphs', {}).get('num_gpu_blocks'))}")
    return code


if __name__ == "__main__":
    sys.exit(main())
