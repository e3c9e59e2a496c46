"""What the real-engine harnesses share (``vllm_real.py``, ``sglang_real.py``).

Each harness runs a real engine on the offline GPU machine through weightcache
and against the engine's own cold start, in phases (env, checkpoint, cold,
warm, kill9, report) spread over calls of at most 600 s while the machine
stays warm. This module holds what does not depend on the engine: the
arguments and the phases, the start schedule, the random Llama-3-8B
checkpoint, the prompts, the output comparison and its verdict, the result's
shape and the bookkeeping of a run under ``--work`` (:class:`Bench`: the
daemon, engine processes, deadlines, the kill -9 phase, log digests). An
engine's module subclasses :class:`Bench` with its environment, its plugin
stubs and its environment check, and writes its own engine process and KV
report.

Standard library only at import: the engine processes import this module
beside the engine's own packages (the offline site), the daemon's beside the
image's torch.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PHASES = ("env", "checkpoint", "cold", "warm", "kill9", "report")
MiB = 1 << 20
DAEMON_HTTP = ("127.0.0.1", 8470)  # rank r's daemon at TP > 1: port 8470 + r
# The WeightCache name the TP daemons and engines derive their sockets from
# (<socket_dir>/<namespace>.<name>/gpu-<UUID>.sock).
TP_CACHE = "wcbench.llama"
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
    arm: str  # "cold": the engine's default loader, no daemon; "warm": weightcache's
    eager: bool  # no CUDA graphs
    counted: bool  # a restart figure (not the first start of its arm)
    tight: bool = False  # at --tight-utilization instead of the main utilization
    # The engine's deterministic mode: two loads of the same bytes must give bit-equal
    # outputs. Eager starts run in it.
    deterministic: bool = False
    # Tensor parallel only: the last rank holds an extra buffer the others do not (the
    # uneven case of issue 45: the KV correction must come before the ranks' MIN).
    uneven: bool = False

    @property
    def mode(self) -> str:
        """Which starts compare with which: outputs and KV depend on it (not on the arm)."""
        return ("tight_" if self.tight else "") + ("eager" if self.eager else "graphs")


def schedule(arm: str, restarts: int) -> list[StartPlan]:
    """An arm's starts: a first one (cold: empty compile caches; warm: the daemon builds the
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


# Which cold and warm starts compare, per mode: same utilization, graphs or eager.
KV_PAIRS = (("graphs", "cold-1", "warm-1"), ("eager", "cold-eager", "warm-eager"),
            ("tight_graphs", "cold-tight", "warm-tight"),
            ("tight_eager", "cold-tight-eager", "warm-tight-eager"))  # fmt: skip


def resolve_phases(spec: str) -> list[str]:
    """``all`` or a comma list of :data:`PHASES`, returned in run order."""
    names = list(PHASES) if spec == "all" else [p.strip() for p in spec.split(",") if p.strip()]
    unknown = [p for p in names if p not in PHASES]
    if unknown or not names:
        raise ValueError(f"unknown phase(s) {unknown or spec!r}; expected 'all' or some of "
                         f"{', '.join(PHASES)}")  # fmt: skip
    return [p for p in PHASES if p in names]


def default_out(environ: Mapping[str, str], result_name: str) -> Path:
    """``$OUT/<result_name>`` where the device tool sets OUT, else the repository's."""
    if environ.get("OUT"):
        return Path(environ["OUT"]) / result_name
    return REPO / "benchmarks" / "results" / result_name


@dataclass(frozen=True)
class Cli:
    """What differs between the harnesses' command lines."""

    prog: str
    description: str
    result_name: str
    work: Path
    utilization_flag: str  # the engine's own name for the device fraction it may use
    utilization: float
    tight_utilization: float
    # The tensor-parallel sizes the harness runs (--tp); (1,): no --tp option at all.
    tp_sizes: tuple[int, ...] = (1,)
    # The extra buffer of the uneven TP case (--uneven-mib), MiB.
    uneven_mib: int = 2048


def tp_result_name(result_name: str, tp: int, gpu: str | None = None) -> str:
    """The result file of a run at ``tp`` ranks: ``result_name`` at TP 1 (the single-GPU
    harness's, unchanged); else ``<engine>-tp<N>-real.json``, named for the machine once its
    GPU is known (``h100x2-vllm-tp2-real.json``, as ``benchmarks/results`` keeps them)."""
    if tp == 1:
        return result_name
    stem, sep, rest = result_name.partition("-real")
    name = f"{stem}-tp{tp}{sep}{rest}" if sep else f"tp{tp}-{result_name}"
    return f"{gpu}x{tp}-{name}" if gpu else name


def gpu_slug(smi: str) -> str | None:
    """``h100``, ``h200``, ``a100``... from nvidia-smi's ``name, driver, memory`` line (the
    first GPU's), as result files are named; None when no NVIDIA model is named there."""
    first = smi.splitlines()[0] if smi else ""
    match = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", first.split(",")[0].upper())
    return match[1].lower() if match else None


def parse_args(cli: Cli, argv: Sequence[str] | None,
               environ: Mapping[str, str]) -> argparse.Namespace:  # fmt: skip
    """The harness's arguments; the device fraction lands in ``args.utilization``."""
    parser = argparse.ArgumentParser(
        prog=cli.prog, description=cli.description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--phase", default="all",
                        help=f"'all' (what is not done yet) or some of {', '.join(PHASES)}")
    parser.add_argument("--site", type=Path, default=Path("/tmp/site"),
                        help="the offline-installed engine environment (tools/offline_env.py)")
    parser.add_argument("--work", type=Path, default=None,
                        help=f"state folder (default: {cli.work}, with -tpN at TP > 1)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"result file (default: $OUT/{cli.result_name}, else "
                             "benchmarks/results)")
    parser.add_argument(cli.utilization_flag, dest="utilization", type=float,
                        default=cli.utilization)
    parser.add_argument("--tight-utilization", type=float, default=cli.tight_utilization,
                        help=f"the {cli.utilization_flag} of the tight starts")
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--logprobs", type=int, default=5)
    parser.add_argument("--deadline-s", type=float, default=540.0,
                        help="start no engine that would not finish within this many seconds")
    if len(cli.tp_sizes) > 1:
        parser.add_argument("--tp", type=int, choices=cli.tp_sizes, default=cli.tp_sizes[0],
                            help="tensor-parallel ranks: one GPU and one daemon each")
        parser.add_argument("--uneven-mib", type=int, default=cli.uneven_mib,
                            help="TP > 1: the extra buffer the last rank holds in the "
                                 "uneven case (MiB, a multiple of 2: the allocator's segments)")
    args = parser.parse_args(argv)  # fmt: skip
    args.tp = getattr(args, "tp", 1)
    try:
        args.phases = resolve_phases(args.phase)
    except ValueError as exc:
        parser.error(str(exc))
    for name, flag in (("utilization", cli.utilization_flag),
                       ("tight_utilization", "--tight-utilization")):  # fmt: skip
        if not 0.0 < getattr(args, name) < 1.0:
            parser.error(f"{flag} must lie between 0 and 1")
    for name in ("restarts", "prompts", "max_tokens", "logprobs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.tp > 1 and (args.uneven_mib < 2 or args.uneven_mib % 2):
        parser.error("--uneven-mib must be a positive multiple of 2")
    if args.work is None:
        args.work = cli.work if args.tp == 1 else cli.work.with_name(f"{cli.work.name}-tp{args.tp}")
    # At TP > 1 the default file is renamed for the GPU once the env phase has named it.
    args.out_auto = args.out is None and args.tp > 1
    if args.out is None:
        args.out = default_out(environ, tp_result_name(cli.result_name, args.tp))
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


def parse_compute_apps(text: str) -> dict[str, int]:
    """``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits``:
    pid (a string: it is a JSON key) -> MiB."""
    apps = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            apps[parts[0]] = int(parts[1])
    return apps


def new_result(schema: str) -> dict:
    return {"schema": schema, "issue": 35, "phases_done": [], "machine": {}, "settings": {},
            "checkpoint": None, "daemons": [], "starts": [], "kill9": None, "report": None,
            "errors": []}  # fmt: skip


REQUIRED_START_KEYS = ("run", "arm", "eager", "counted", "status")


def check_result(doc: Mapping, schema: str) -> list[str]:
    """What is wrong with a result document's shape (empty: nothing)."""
    problems = []
    if doc.get("schema") != schema:
        problems.append(f"schema is {doc.get('schema')!r}, not {schema!r}")
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


def timeline(t0: float, times: Mapping[str, float], stamps: Mapping[str, Sequence[float]],
             order: Sequence[str]) -> dict[str, float]:
    """Where a start's seconds went, in order, from the harness's spawn (``t0``) to the first
    token. ``times``: the driver process's own clock readings (``imported``, ``ready``,
    ``first_token``); ``stamps``: the engine's phases as ``[start, end]`` wall-clock pairs
    (another process of the same machine: the same clock), ``order`` their order, plus
    ``process_started`` / ``plugin_loaded`` (the engine process's creation and its plugin
    hook, where its imports are done) when the engine runs in a process of its own. Time
    between two phases is named for the gap (``before_<phase>``), so the parts add up to
    the first token's time exactly."""
    parts: dict[str, float] = {"driver_imports": times["imported"] - t0}
    last = times["imported"]
    spawned = stamps.get("process_started")
    loaded = stamps.get("plugin_loaded")
    if spawned is not None and loaded is not None:
        parts["engine_process_spawn"] = spawned[0] - last
        parts["engine_process_imports"] = loaded[0] - spawned[0]
        last = loaded[0]
    for phase in order:
        if phase not in stamps:
            continue
        start, end = stamps[phase]
        parts[f"before_{phase}"] = start - last
        parts[phase] = end - start
        last = end
    parts["until_ready"] = times["ready"] - last
    parts["first_token"] = times["first_token"] - times["ready"]
    return {name: round(seconds, 3) for name, seconds in parts.items()}


def start_mode(start: Mapping) -> str:
    """A recorded start's :attr:`StartPlan.mode`."""
    return ("tight_" if start.get("tight") else "") + ("eager" if start["eager"] else "graphs")


def base_report(doc: Mapping, deterministic_method: str, graphs_method: str) -> dict:
    """What every harness reports from the starts recorded so far: starts that ran, the
    outputs' verdict, restart figures per arm and mode, whether asserts were on. The
    engine's module adds its KV explanation."""
    from benchmarks.stats import summary

    def seconds(samples: list[float]) -> dict | None:
        return summary(samples, "s") if samples else None

    ok = [s for s in doc["starts"] if s.get("status") == "ok"]
    report: dict = {"starts_ok": len(ok),
                    "starts_failed": sum(1 for s in doc["starts"] if s.get("status") != "ok")}
    report["outputs_equal"] = {
        s["run"]: s["comparison"]["equal"] for s in ok if s.get("comparison") is not None
    }
    report["outputs"] = outputs_verdict(ok, deterministic_method, graphs_method)
    restarts: dict = {}
    for arm in ("cold", "warm"):
        for mode, _, _ in KV_PAIRS:
            counted = [s for s in ok if s["arm"] == arm and s["counted"] and start_mode(s) == mode]
            restarts[f"{arm}_{mode}"] = {
                "first_token_s": seconds([s["timing"]["first_token_s"] for s in counted]),
                "ready_s": seconds([s["timing"]["ready_s"] for s in counted]),
                "load_s": seconds([s["figures"]["load"]["seconds"] for s in counted]),
            }
    report["restarts"] = restarts
    report["where_the_time_goes"] = {
        f"{arm}_{mode}": _median_parts([s["timeline"] for s in ok if s["arm"] == arm
                                        and s["counted"] and start_mode(s) == mode
                                        and s.get("timeline")])
        for arm in ("cold", "warm") for mode, _, _ in KV_PAIRS
    }  # fmt: skip
    report["asserts_on"] = (doc.get("machine") or {}).get("engine", {}).get("optimize") == 0
    return report


def _median_parts(timelines: Sequence[Mapping[str, float]]) -> dict[str, float] | None:
    """Each part's median over ``timelines`` (the parts every one of them has)."""
    if not timelines:
        return None
    names = [n for n in timelines[0] if all(n in t for t in timelines)]
    return {n: round(statistics.median(t[n] for t in timelines), 3) for n in names}


def daemon_mib_after_warm(doc: Mapping) -> int | None:
    """The daemon's device memory (nvidia-smi, MiB) after the warm phase: its CUDA context
    and the layout it holds."""
    daemon = doc.get("daemon_after_warm") or {}
    pid = (daemon.get("status") or {}).get("pid")
    return daemon["compute_apps_mib"].get(str(pid)) if pid is not None else None


def outputs_verdict(ok: Sequence[Mapping], deterministic_method: str,
                    graphs_method: str) -> dict:  # fmt: skip
    """What the outputs say about weightcache, per mode. Deterministic starts: every cold
    one bit-equal to the first shows the mode holds on this GPU, and then warm must be
    bit-equal too. Graphs (the engine's defaults, not deterministic): the noise floor is
    the largest logprob difference between cold starts; warm must lie within it."""
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
                "method": deterministic_method,
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
            "method": graphs_method,
            "cold_vs_cold_floor": floor,
            "warm_max_difference": worst,
            "warm_within_floor": floor is not None and worst <= floor,
            "bit_equal": all(c["equal"] for c in warm),
        }
    return verdict


# The adapters' own words where both engines' loaders share them (integrations/loading.py):
# the checkpoint layout's line and the disk fallback's WARNING.
ADAPTER_LOG_PATTERNS: dict[str, tuple[str, Callable[[re.Match], object]]] = {
    "weightcache_checkpoint_layout": (
        r"weightcache: (\d+) tensor\(s\) \((\d+) bytes\) mapped zero-copy over (\w+) from "
        r"daemon pid (\d+); (\d+) tensor\(s\) \((\d+) bytes\) copied",
        lambda m: {"mapped": int(m[1]), "mapped_bytes": int(m[2]), "transport": m[3],
                   "daemon_pid": int(m[4]), "copied": int(m[5]), "copied_bytes": int(m[6])}),
    "weightcache_disk_fallback": (r"weightcache: loading from disk instead of the daemon: (.*)",
                                  lambda m: m[1].strip()),
}  # fmt: skip


def parse_log(text: str, patterns: Mapping[str, tuple[str, Callable[[re.Match], object]]]) -> dict:
    """What an engine and the adapter logged about a start: the first match of each pattern
    (absent keys: not logged), and how many tracebacks."""
    found = {}
    for key, (pattern, convert) in patterns.items():
        match = re.search(pattern, text)
        if match is not None:
            found[key] = convert(match)
    found["tracebacks"] = text.count("Traceback (most recent call last)")
    return found


def engine_report(doc: Mapping, methods: tuple[str, str],
                  explain: Callable[[Mapping, Mapping], dict],
                  device_use: Callable[[Mapping, Mapping, Any], dict]) -> dict:  # fmt: skip
    """:func:`base_report` (``methods``: the deterministic and the graphs verdicts' words)
    and, per mode with both a cold and a warm start, the engine's KV explanation and its
    device use against the daemon's (``daemon_device_mib``: its context and the layout)."""
    report = base_report(doc, *methods)
    by_run = {s["run"]: s for s in doc["starts"] if s.get("status") == "ok"}
    daemon_mib = daemon_mib_after_warm(doc)
    kv = {}
    for mode, cold_run, warm_run in KV_PAIRS:
        if cold_run in by_run and warm_run in by_run:
            cold, warm = by_run[cold_run]["figures"], by_run[warm_run]["figures"]
            try:
                kv[mode] = {**explain(cold, warm), **device_use(cold, warm, daemon_mib)}
            except (KeyError, TypeError, ValueError) as exc:  # another release's figures
                kv[mode] = {"error": repr(exc)}
    report["kv"] = kv
    if daemon_mib is not None:
        report["daemon_device_mib"] = daemon_mib
    return report


# =========================================================================== engine processes


def serve(generate: Callable[[], list[dict]], reference: list[dict], events: Path,
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


def finish_start(spec: Mapping, times: dict, outputs: list[dict], figures: dict,
                 generate: Callable[[], list[dict]]) -> None:  # fmt: skip
    """The end of an engine process's start: nvidia-smi's per-process memory beside the
    figures; with ``serve`` set, generate in a loop until ``stop`` exists; the result."""
    figures["compute_apps_mib"] = parse_compute_apps(nvidia_smi_apps())
    result = {"times": times, "outputs": outputs, "figures": figures, "pid": os.getpid()}
    if spec.get("serve"):
        result["batches"] = serve(generate, outputs, Path(spec["events"]), Path(spec["stop"]))
    write_json(Path(spec["result"]), result)


def envcheck(engine: str, plugin_group: str, modules: Sequence[str]) -> dict:
    """What the ``_envcheck`` subcommand of every harness reports (the engine's own fields
    added): torch and the GPU, ``modules`` (the engine's run path) imported, the plugins
    the engine sees, weightcache's support, Python's flags."""
    import importlib
    import importlib.metadata as md

    import torch

    from weightcache.integrations.versions import detect

    failed = {}
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - each failure is reported
            failed[module] = repr(exc)
    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": cuda,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "transformers": md.version("transformers"), "triton": md.version("triton"),
        "import_failures": failed,
        "plugins": sorted(e.value for e in md.entry_points(group=plugin_group)),
        "weightcache_supports": detect(engine).ok,
        # 0: Python's assert statements run (the engines' memory checks use them).
        "optimize": sys.flags.optimize,
        "dont_write_bytecode": sys.flags.dont_write_bytecode,
    }  # fmt: skip


def parse_compute_apps_by_gpu(text: str) -> dict[str, dict[str, int]]:
    """``nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory --format=csv,noheader,
    nounits``: GPU UUID -> pid -> MiB (a process on two GPUs is listed on each)."""
    gpus: dict[str, dict[str, int]] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            gpus.setdefault(parts[0], {})[parts[1]] = int(parts[2])
    return gpus


def nvidia_smi_apps_by_gpu() -> str:
    return run_text(["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,used_memory",
                     "--format=csv,noheader,nounits"])  # fmt: skip


def nvidia_smi_apps() -> str:
    return run_text(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                     "--format=csv,noheader,nounits"])  # fmt: skip


def run_text(cmd: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 60) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=None if env is None else dict(env)).stdout.strip()  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return ""


def write_json(path: Path, data: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


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
        say(f"wrote {name}")
        del tensors
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    write_json(model / "wcbench.json", {"bytes": total, "tensors": len(weight_map),
                                        "shards": len(shards), "write_s": time.time() - started,
                                        "torch": torch.__version__})  # fmt: skip
    return 0


# =========================================================================== the orchestrator


class Incomplete(Exception):
    """The deadline came before the phase's work was done: call again."""


class Bench:
    """The run's state under ``--work`` and the processes it starts. An engine's harness
    subclasses it: :attr:`script` (its own file, run for each engine process),
    :attr:`schema`, :meth:`engine_env`, :meth:`plugin_stubs`, :meth:`check_engine`,
    :meth:`settings`, :meth:`capacity` and :meth:`report`."""

    script: Path
    schema: str
    log_digest_name: str
    engine: str  # its adapter: weightcache.integrations.<engine>
    # The stub distributions' entry-point group through which the engine finds plugins.
    plugin_group: str
    log_patterns: Mapping[str, tuple[str, Callable[[re.Match], object]]] = ADAPTER_LOG_PATTERNS

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work: Path = args.work
        self.model = self.work / "model"
        # Tensor parallel: one daemon per rank, rank r on GPU r, each finding its socket by
        # its GPU's UUID under socket_dir/cache as the adapter derives it (TP 1: one socket
        # path, as before).
        self.tp: int = getattr(args, "tp", 1)
        self.socket = self.work / "sock" / "gpu.sock"
        self.socket_dir = self.work / "sock"
        self.cache = TP_CACHE
        # The rank whose daemon the kill9 phase kills: the last (TP 1: the only one).
        self.kill_rank = self.tp - 1
        # Daemons launched and not yet ready: (record number, why, rank).
        self._launching: list[tuple[int, str, int]] = []
        self.logs = self.work / "logs"
        self.outputs = self.work / "outputs"
        self.result_path = self.work / "result.json"
        self.deadline = time.monotonic() + args.deadline_s
        for d in (self.logs, self.outputs, self.work / "spec"):
            d.mkdir(parents=True, exist_ok=True)
        self.socket.parent.mkdir(mode=0o700, exist_ok=True)
        self.doc = json.loads(self.result_path.read_text()) if self.result_path.exists() \
            else new_result(self.schema)
        self.logs_this_call: list[Path] = []
        self.kill_leftover_engine()

    # ---------------------------------------------------------------- what engines define

    def engine_env(self) -> dict[str, str]:
        """The environment of every engine process: ``--site`` first on the path, its NCCL
        (torch 2.14 needs ncclCommResume, which the image's lacks) first on the library
        path, no network, caches under ``--work`` (kept for the next start)."""
        site = str(self.args.site)
        env = dict(os.environ)
        env.update({
            "PYTHONPATH": self.engine_pythonpath(),
            "LD_LIBRARY_PATH": os.pathsep.join(
                p for p in [f"{site}/nvidia/nccl/lib", os.environ.get("LD_LIBRARY_PATH")] if p),
            "PYTHONUNBUFFERED": "1", "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TRITON_CACHE_DIR": str(self.work / "cache" / "triton"),
            "XDG_CACHE_HOME": str(self.work / "cache"),
        })  # fmt: skip
        return env

    def plugin_stubs(self) -> dict[str, str]:
        """dist-info folder name -> entry point (``name = module:function``) in
        :attr:`plugin_group`: the adapter's (as pyproject.toml registers it) and the probe's."""
        return {
            "weightcache-0.1.0.dist-info":
                f"weightcache = weightcache.integrations.{self.engine}:register",
            "wcbench_probe-0.dist-info": f"wcbench = {PROBE_MODULE}:probe_plugin",
        }  # fmt: skip

    def check_engine(self, engine: Mapping) -> None:
        """Refuse an engine environment the run cannot use (the envcheck's JSON): one
        weightcache does not support, or whose engine does not see both plugins."""
        if not engine.get("weightcache_supports"):
            raise RuntimeError(f"weightcache does not support this engine: {engine}")
        wanted = {f"weightcache.integrations.{self.engine}:register",
                  f"{PROBE_MODULE}:probe_plugin"}  # fmt: skip
        if not wanted <= set(engine.get("plugins", [])):
            raise RuntimeError(f"the engine does not see the plugins: {engine.get('plugins')}")

    def settings(self) -> dict:
        """The run's settings as the result records them."""
        raise NotImplementedError

    def capacity(self, start: Mapping) -> str:
        """A start's KV capacity as one line says it."""
        raise NotImplementedError

    def report(self) -> dict:
        """The report of the starts recorded so far."""
        raise NotImplementedError

    def deterministic_env(self) -> dict[str, str]:
        """Variables that put an engine process in its deterministic mode (none where the
        engine takes an argument instead)."""
        return {}

    def start_spec(self, plan: StartPlan) -> dict:
        """What an engine start needs beyond the common spec (engine-specific keys)."""
        return {}

    def uneven_spec(self, plan: StartPlan) -> dict | None:
        """TP > 1: the uneven case's extra buffer for ``plan`` (None: every rank even)."""
        if not plan.uneven:
            return None
        return {"rank": self.tp - 1, "bytes": self.args.uneven_mib * MiB, "arm": plan.arm}

    # ---------------------------------------------------------------- environments

    def engine_pythonpath(self) -> str:
        """``--site`` first, then the adapter and the plugin stubs; the repository last, for
        this module in the engine process."""
        return os.pathsep.join([str(self.args.site), str(REPO / "sidecar"),
                                str(self.plugin_dir()), str(REPO)])  # fmt: skip

    def daemon_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(self.daemon_site()), str(REPO / "sidecar")])
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def plugin_dir(self) -> Path:
        """Stub distributions whose entry points the engine loads: weightcache's (as
        pyproject.toml registers it) and the harness's probe, importable as
        ``wcbench_probe`` (the harness's own file by another name)."""
        plugin = self.work / "plugin"
        for name, entry in self.plugin_stubs().items():
            dist = plugin / name
            dist.mkdir(parents=True, exist_ok=True)
            project, version = name.removesuffix(".dist-info").split("-")
            (dist / "METADATA").write_text(
                f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n")
            (dist / "entry_points.txt").write_text(f"[{self.plugin_group}]\n{entry}\n")
        link = plugin / f"{PROBE_MODULE}.py"
        if not link.exists():
            link.symlink_to(self.script.resolve())
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
        self.doc["report"] = self.report()
        self.doc["result_problems"] = check_result(self.doc, self.schema)
        write_json(self.result_path, self.doc)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.result_path, out)
        digest = out.with_name(self.log_digest_name)
        with digest.open("w") as f:
            for path in [*self.logs_this_call, *sorted(self.logs.glob("daemon-*.log"))[-2:]]:
                lines = path.read_text(errors="replace").splitlines()
                f.write(f"==== {path.name} (last 80 of {len(lines)} lines)\n")
                f.write("\n".join(lines[-80:]) + "\n")

    def run_logged(self, name: str, *args: str, env: dict[str, str]) -> tuple[int, str]:
        """The harness's ``args`` subcommand in ``env``, its output in ``logs/<name>.log``."""
        log = self.logs / f"{name}.log"
        self.logs_this_call.append(log)
        with log.open("w") as out:
            code = subprocess.run([sys.executable, str(self.script.resolve()), *args],
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
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                say(f"killed the engine process group {pid} an earlier call left running")
            path.unlink()

    def daemon_file(self, rank: int) -> Path:
        """Where rank ``rank``'s daemon's pid is kept (TP 1: ``daemon.json``, as before)."""
        return self.work / ("daemon.json" if self.tp == 1 else f"daemon-r{rank}.json")

    def daemon_pid(self, rank: int = 0) -> int | None:
        path = self.daemon_file(rank)
        if not path.exists():
            return None
        pid = json.loads(path.read_text())["pid"]
        return pid if alive(pid) else None

    def daemon_pids(self) -> list[int]:
        """Every rank's daemon that is running."""
        return [pid for pid in map(self.daemon_pid, range(self.tp)) if pid is not None]

    def daemon_http(self, rank: int) -> tuple[str, int]:
        """Rank ``rank``'s daemon's HTTP address: one port each (they share the host)."""
        return DAEMON_HTTP[0], DAEMON_HTTP[1] + rank

    def rank_socket(self, rank: int) -> Path:
        """Rank ``rank``'s daemon socket: TP 1 the fixed path; else the path its daemon
        derived from its GPU's UUID and wrote to its ``--socket-path-file``."""
        if self.tp == 1:
            return self.socket
        return Path(read(self.work / f"daemon-r{rank}.socket").strip() or "/nonexistent")

    def daemon_command(self, rank: int) -> list[str]:
        """The daemon's command line for ``rank``: TP 1 as ever; else pinned to GPU ``rank``,
        holding that rank's shards, its socket named by the GPU's UUID (as the adapter's
        ranks look for it) under socket_dir/cache."""
        common = [sys.executable, "-m", "weightcache.daemon.cli", "serve", "--model",
                  str(self.model), "--device", f"cuda:{rank}", "--transport", "vmm_fd",
                  "--http-address", ":".join(map(str, self.daemon_http(rank)))]  # fmt: skip
        if self.tp == 1:
            return [*common, "--socket", str(self.socket)]
        return [*common, "--socket-dir", str(self.socket_dir), "--cache", self.cache,
                "--tp-size", str(self.tp), "--tp-rank", str(rank), "--shard-plan", "llama",
                "--socket-path-file", str(self.work / f"daemon-r{rank}.socket")]  # fmt: skip

    def launch_daemon(self, why: str, rank: int = 0) -> tuple[subprocess.Popen, Path, float]:
        """Rank ``rank``'s daemon in a session of its own (it outlives this call), not yet
        waited for."""
        n = len(self.doc["daemons"]) + len(self._launching)
        log = self.logs / f"daemon-{n}.log"
        (self.work / f"daemon-r{rank}.socket").unlink(missing_ok=True)
        started = time.time()
        proc = subprocess.Popen(self.daemon_command(rank), env=self.daemon_env(),
                                stdout=log.open("w"), stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        write_json(self.daemon_file(rank), {"pid": proc.pid, "log": str(log)})
        self._launching.append((n, why, rank))
        return proc, log, started

    def wait_daemon(self, proc: subprocess.Popen, log: Path, started: float,
                    rank: int = 0) -> dict:  # fmt: skip
        """Wait for a launched daemon to be ready; its record (in the result's daemons)."""
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the daemon exited ({proc.returncode}): {tail(log)}")
            if http_get(self.daemon_http(rank), "/readyz")[0] == 200:
                break
            if time.time() - started > 600:
                raise RuntimeError(f"the daemon was not ready after 600 s: {tail(log)}")
            time.sleep(0.1)
        ready = time.time()
        n, why = next((n, w) for n, w, r in self._launching if r == rank)
        self._launching = [e for e in self._launching if e[2] != rank]
        record = {"n": n, "why": why, "pid": proc.pid, "spawn_to_ready_s": ready - started,
                  "status": self.daemon_status(rank)}  # fmt: skip
        if self.tp > 1:
            record["rank"] = rank
        self.doc["daemons"].append(record)
        say(f"daemon {n} (pid {proc.pid}{f', rank {rank}' if self.tp > 1 else ''}) ready in "
            f"{record['spawn_to_ready_s']:.1f} s: {record['status'].get('load_source')}, "
            f"{record['status'].get('load_reason')}")  # fmt: skip
        return record

    def start_daemon(self, why: str, rank: int = 0) -> dict:
        """Rank ``rank``'s daemon on the checkpoint over vmm_fd, in a session of its own (it
        outlives this call), waited for until ready; returns its record."""
        return self.wait_daemon(*self.launch_daemon(why, rank), rank=rank)

    def daemon_status(self, rank: int = 0) -> dict:
        """The daemon's full status (load_reason included: the socket's, not HTTP's)."""
        text = run_text([sys.executable, "-m", "weightcache.daemon.cli", "status", "--socket",
                         str(self.rank_socket(rank))], env=self.daemon_env(),
                        timeout=120)  # fmt: skip
        try:
            return json.loads(text)
        except ValueError:
            return {"unreadable": text[-2000:]}

    def stop_daemon(self) -> None:
        """Every rank's daemon."""
        for pid in self.daemon_pids():
            os.kill(pid, signal.SIGTERM)
            if not wait(lambda pid=pid: not alive(pid), 60):
                os.kill(pid, signal.SIGKILL)
                wait(lambda pid=pid: not alive(pid), 30)
            say(f"daemon pid {pid} stopped")

    def ensure_daemon(self) -> int:
        """Every rank's daemon running (those missing started together, as a node's
        daemons start: each reads its own shards); rank 0's pid."""
        launched = [(rank, self.launch_daemon("warm phase", rank)) for rank in range(self.tp)
                    if self.daemon_pid(rank) is None]  # fmt: skip
        for rank, (proc, log, started) in launched:
            self.wait_daemon(proc, log, started, rank=rank)
        pid = self.daemon_pid(0)
        if pid is None:
            raise RuntimeError("rank 0's daemon is not running")
        return pid

    # ---------------------------------------------------------------- engine starts

    def utilization(self, plan: StartPlan) -> float:
        return self.args.tight_utilization if plan.tight else self.args.utilization

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
            "deterministic": plan.deterministic,
            "socket": str(self.socket), "result": str(result_path),
            "utilization": self.utilization(plan),
            "prompts": prompt_set(self.args.prompts, LLAMA3_8B["vocab_size"]),
            "max_tokens": self.args.max_tokens, "logprobs": self.args.logprobs,
            "serve": while_serving is not None,
            "events": str(self.work / f"{plan.run}.events"),
            "stop": str(self.work / f"{plan.run}.stop"),
            "figures": str(self.work / f"{plan.run}.figures.json"),
            **self.start_spec(plan),
        }  # fmt: skip
        if self.tp > 1:
            spec.update({"tp": self.tp, "socket_dir": str(self.socket_dir), "cache": self.cache,
                         "uneven": self.uneven_spec(plan)})  # fmt: skip
        for key in ("events", "stop", "figures"):
            Path(spec[key]).unlink(missing_ok=True)
        write_json(spec_path, spec)
        free_before = gpu_free_bytes()
        free_before_by_gpu = gpus_free_bytes() if self.tp > 1 else None
        say(f"{plan.run}: starting ({plan.arm}, {plan.mode}, utilization "
            f"{spec['utilization']}{', deterministic' if plan.deterministic else ''})")
        env = self.engine_env()
        if plan.deterministic:
            env.update(self.deterministic_env())
        t0 = time.time()
        proc = subprocess.Popen(
            [sys.executable, str(self.script.resolve()), "_engine", str(spec_path)],
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
            # Done when it exits, or once its result is written: the engine's own shutdown
            # is given EXIT_GRACE_S, then the group is killed (a hung teardown costs no
            # more). Never past the deadline's slack: a start cut off by the device tool
            # would leave no result behind.
            limit = min(START_TIMEOUT_S, max(60.0, self.left() + DEADLINE_SLACK_S))
            wait(lambda: proc.poll() is not None or result_path.exists(), limit)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(EXIT_GRACE_S)
            code = proc.poll()
        finally:
            # The engine's own processes are the driver's children, in its session:
            # nothing outlives it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            (self.work / "engine.pid").unlink(missing_ok=True)
        wall = time.time() - t0
        text = log.read_text(errors="replace")
        record: dict = {"run": plan.run, "arm": plan.arm, "eager": plan.eager,
                        "counted": plan.counted, "tight": plan.tight,
                        "deterministic": plan.deterministic,
                        self.utilization_key: spec["utilization"],
                        "wall_s": wall, "exit_code": code,
                        "device_free_before_bytes": free_before,
                        "log": self.parse_log(text)}  # fmt: skip
        if self.tp > 1:
            record["device_free_before_bytes_by_gpu"] = free_before_by_gpu
        if plan.uneven:
            record["uneven"] = True
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
            "timeline": timeline(t0, times, result["figures"].get("stamps", {}),
                                 self.phase_order),
            "figures": result["figures"],
            "outputs_digest": outputs_digest(result["outputs"]),
        })  # fmt: skip
        if "batches" in result:
            record["batches"] = result["batches"]
        record["comparison"] = self.compare(plan, result["outputs"])
        return record

    # The engine's phases a start's timeline names, in order (its probe stamps them).
    phase_order: Sequence[str] = ()
    # The key under which a start records its utilization (the engine's own name).
    utilization_key = "utilization"

    def parse_log(self, text: str) -> dict:
        """What the engine and the adapter logged about a start."""
        return parse_log(text, self.log_patterns)

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
            say(f"{start['run']}: {start['status']} (exit {start['exit_code']}, "
                f"{start.get('error')}); log tail in the result")  # fmt: skip
            raise RuntimeError(f"start {start['run']} {start['status']}")
        comparison = start.get("comparison") or {"equal": "reference"}
        say(f"{start['run']}: first token at {start['timing']['first_token_s']:.1f} s, "
            f"{self.capacity(start)}, outputs equal: {comparison['equal']}")  # fmt: skip

    def wait_gpu_idle(self) -> None:
        """No engine process of ours left on the GPU (the daemon may stay): the next start
        must find the memory a fresh GPU has."""
        daemons = {str(pid) for pid in self.daemon_pids()}

        def others() -> list[str]:
            return [pid for pid in parse_compute_apps(nvidia_smi_apps()) if pid not in daemons]

        if wait(lambda: not others(), 60):
            return
        # Pids nvidia-smi shows that this machine's /proc does not know belong to another
        # PID namespace: say so and go on (each start records the free memory it found).
        local = [pid for pid in others() if alive(int(pid))]
        if local:
            raise RuntimeError(f"the GPU still runs processes {local}: {nvidia_smi_apps()}")
        say(f"nvidia-smi lists processes not in this /proc: {others()}; going on")

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
        engine = json_of(text)
        image = json_of(run_text([sys.executable, "-c",
                                  "import json, torch; print(json.dumps({'torch': "
                                  "torch.__version__, 'cuda': torch.version.cuda}))"],
                                 env=self.daemon_env()))  # fmt: skip
        smi = run_text(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                        "--format=csv,noheader"])  # fmt: skip
        self.doc["machine"] = {
            "gpu": smi, "engine": engine, "daemon": image,
            "python": platform.python_version(), "kernel": platform.release(),
            "cpu": cpu_model(), "cpu_cores": os.cpu_count(),
            "site": str(self.args.site),
            "offline_env_pack": json_of(read(self.args.site / INSTALLED_MARKER)).get("pack_id"),
            "precompile_s": precompile_s,
        }  # fmt: skip
        say(f"env: {json.dumps(self.doc['machine'])[:1500]}")
        if code != 0 or engine.get("import_failures"):
            raise RuntimeError(f"the engine environment is not usable: {engine or text[-3000:]}")
        self.check_engine(engine)
        if engine.get("optimize"):
            raise RuntimeError("Python runs with its assert statements removed (PYTHONOPTIMIZE): "
                               "the engines check with them; unset it")  # fmt: skip
        self.doc["settings"] = self.settings()

    def precompile(self) -> float | None:
        """Byte-compile the offline site once (``install`` runs pip with --no-compile, and
        an engine's imports would otherwise compile its sources at every start when
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
        say(f"checkpoint: {self.doc['checkpoint']}")

    def schedule(self, arm: str) -> list[StartPlan]:
        """An arm's starts (an engine's harness may add its own)."""
        return schedule(arm, self.args.restarts)

    def phase_cold(self) -> None:
        self.stop_daemon()  # a cold start has the GPU to itself
        self.run_schedule(self.schedule("cold"))

    def phase_warm(self) -> None:
        self.ensure_daemon()
        self.run_schedule(self.schedule("warm"))
        self.doc["daemon_after_warm"] = {
            "status": self.daemon_status(),
            "compute_apps_mib": parse_compute_apps(nvidia_smi_apps()),
        }  # fmt: skip
        if self.tp > 1:
            # Per rank: its daemon's status and each GPU's processes (a pid's MiB on each).
            self.doc["daemon_after_warm"]["ranks"] = [self.daemon_status(r)
                                                      for r in range(self.tp)]
            self.doc["daemon_after_warm"]["compute_apps_by_gpu"] = parse_compute_apps_by_gpu(
                nvidia_smi_apps_by_gpu())

    def phase_kill9(self) -> None:
        if self.left() < KILL9_GUESS_S:
            raise Incomplete(f"kill9 needs about {KILL9_GUESS_S} s, {self.left():.0f} s left")
        self.ensure_daemon()
        old = self.daemon_pid(self.kill_rank)
        if old is None:
            raise RuntimeError(f"rank {self.kill_rank}'s daemon is not running")
        kill: dict = {"old_daemon_pid": old}
        if self.tp > 1:
            kill["rank"] = self.kill_rank

        def while_serving(events: Path, proc: subprocess.Popen) -> None:
            def served_since(t: float) -> int:
                if proc.poll() is not None:
                    raise RuntimeError(f"the serving engine exited ({proc.returncode})")
                return sum(1 for e in read_events(events) if e["started"] > t)

            if not wait(lambda: served_since(0) >= 2, START_TIMEOUT_S):
                raise RuntimeError("the serving engine never served two batches")
            kill["killed_at"] = time.time()
            os.kill(old, signal.SIGKILL)
            kill["old_daemon_gone"] = wait(lambda: not alive(old), 30)
            if not wait(lambda: served_since(kill["killed_at"]) >= 3, 120):
                raise RuntimeError("the engine served no three batches without its daemon")
            kill["restarted_at"] = time.time()
            kill["new_daemon"] = self.start_daemon("after kill -9 of the previous one",
                                                   rank=self.kill_rank)
            kill["new_daemon_ready_at"] = time.time()
            if not wait(lambda: served_since(kill["new_daemon_ready_at"]) >= 3, 120):
                raise RuntimeError("the engine served no three batches after the new daemon")

        # Deterministic, so every batch must equal the first: a wrong answer is one that
        # differs, not kernel noise.
        serving = self.start_engine(
            StartPlan("kill9-serving", "warm", True, False, deterministic=True),
            while_serving=while_serving)  # fmt: skip
        self.record(serving)
        events = read_events(self.work / "kill9-serving.events")
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
        say(f"kill9: {json.dumps(kill)[:1500]}")


def read_events(path: Path) -> list[dict]:
    """The engine's event lines so far; a last line it is still writing is not one yet."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line.strip()]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait(condition: Callable[[], bool], seconds: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


def http_get(address: tuple[str, int], path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{address[0]}:{address[1]}{path}", timeout=2) as r:
            return r.status, r.read().decode()
    except OSError as exc:
        return getattr(exc, "code", 0) or 0, ""


def gpus_free_bytes() -> list[int | None]:
    """Each GPU's free memory, in nvidia-smi's index order."""
    text = run_text(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"])
    return [int(line) * MiB if line.strip().isdigit() else None for line in text.splitlines()]


def gpu_free_bytes() -> int | None:
    text = run_text(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"])
    return int(text.splitlines()[0]) * MiB if text[:1].isdigit() else None


def tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def json_of(text: str) -> dict:
    for line in reversed(text.splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return {}


def cpu_model() -> str:
    for line in read(Path("/proc/cpuinfo")).splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def say(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)


def main(
    argv: Sequence[str] | None,
    parse: Callable[[Sequence[str], Mapping[str, str]], argparse.Namespace],
    bench_class: type[Bench],
    engine_main: Callable[[Path], int],
    envcheck_main: Callable[[], int],
) -> int:
    """A harness's command line: its subcommands (one engine start, the environment check,
    the checkpoint), else the phases asked for."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_engine"]:
        return engine_main(Path(argv[1]))
    if argv[:1] == ["_envcheck"]:
        return envcheck_main()
    if argv[:1] == ["_checkpoint"]:
        return checkpoint_main(Path(argv[1]))
    args = parse(argv, os.environ)
    bench = bench_class(args)
    code, phase = 0, args.phases[0]
    try:
        for phase in args.phases:
            if phase in bench.doc["phases_done"] and phase != "report":
                say(f"{phase}: done earlier")
                continue
            say(f"{phase}: starting, {bench.left():.0f} s left before the deadline")
            if phase != "report":
                getattr(bench, f"phase_{phase}")()
            bench.done(phase)
            bench.save()
    except Incomplete as exc:
        say(f"not finished, call again: {exc}")
        code = 3
    except Exception as exc:
        bench.doc["errors"].append({"phase": phase, "error": repr(exc), "at": time.time()})
        say(f"{phase} failed: {exc!r}")
        code = 1
    bench.save()
    report = bench.doc["report"]
    say(f"result in {args.out}: phases done {bench.doc['phases_done']}; "
        f"outputs {json.dumps(report.get('outputs'))}; "
        f"kv {json.dumps(report.get('kv', {}).get('graphs', {}))[:400]}")
    return code
