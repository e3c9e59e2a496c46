"""Real vLLM at tensor parallel 2 through weightcache (issue 45): the pure parts.

``benchmarks/vllm_real.py --tp 2`` runs the single-GPU harness's phases with one daemon
per GPU (rank r's shards on GPU r, its socket named by the GPU's UUID under
``socket_dir``/``cache``, where the adapter's rank r looks for it) and vLLM at
``tensor_parallel_size=2``. This module holds what it computes from the recorded
figures, with no GPU and no vLLM: the schedule's TP starts, each rank's KV reading,
the order of the KV correction and the ranks' MIN, and the report's TP section.

vLLM 0.33 sizes each worker's KV cache as ``requested - total_consumed -
peak_activation_memory`` (``Worker.determine_available_memory``), where ``requested``
is ``ceil(total * utilization)`` less the bytes the loader says it holds outside the
engine (``get_external_weight_memory``: weightcache's layout bytes); the engine core
then gives every worker the smallest block count of them all
(``get_kv_cache_configs``: ``available // bytes_per_block`` per worker, then the
MIN). So each rank subtracts its own external bytes before the MIN: correct, then
MIN. The other order takes the MIN of the uncorrected readings (each rank's
``available + external``) and only then lets each rank subtract its own bytes; both
orders agree when every rank holds the same bytes, and differ when they do not: the
uneven case (:func:`tp_schedule`), where the last rank holds an extra buffer.

Standard library only (the engine processes import ``vllm_real``, which imports this).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from benchmarks.engine_real import KV_PAIRS, StartPlan, schedule

MiB = 1 << 20
UNEVEN_RUNS = ("cold-uneven", "warm-uneven")


def tp_schedule(arm: str, restarts: int, tp: int) -> list[StartPlan]:
    """An arm's starts at ``tp`` ranks: the single-GPU schedule, and at TP > 1 one uneven
    start last (eager and deterministic, like the KV pair it is read against: the last
    rank holds the extra buffer; not a restart figure)."""
    plans = schedule(arm, restarts)
    if tp > 1:
        plans.append(StartPlan(f"{arm}-uneven", arm, True, False, deterministic=True,
                               uneven=True))  # fmt: skip
    return plans


def rank_figures(figures: Mapping) -> list[Mapping]:
    """Each rank's worker figures of a start (TP 1: the start's own)."""
    return list(figures.get("ranks") or [figures])


def rank_kv(f: Mapping) -> dict:
    """One worker's KV reading in vLLM's own terms: the external bytes it took off its
    budget (the correction), its KV bytes with them taken off (``corrected``, vLLM's
    ``available_kv_cache_memory_bytes``) and without (``uncorrected``: what the rank
    would size had its weights' bytes not been corrected for), its block count alone
    (before the engine's MIN), and the residual of vLLM's formula (0 when the figures
    obey it)."""
    budget = math.ceil(f["init_snapshot"]["total_memory"] * f["gpu_memory_utilization"])
    external = budget - f["requested_memory"]
    available = f["available_kv_cache_memory_bytes"]
    per_block = f["bytes_per_block"]
    formula = f["requested_memory"] - f["total_consumed"] - f["peak_activation_memory"]
    return {
        "rank": f.get("tp_rank"),
        "external_bytes": external,
        "corrected_kv_bytes": available,
        "uncorrected_kv_bytes": available + external,
        "bytes_per_block": per_block,
        "blocks_alone": available // per_block,
        "formula_residual_bytes": available - formula,
        "uneven_extra_bytes": (f.get("uneven") or {}).get("bytes", 0),
    }


def min_order(ranks: Sequence[Mapping], vllm_blocks: int | None,
              cold_blocks: int | None = None) -> dict:  # fmt: skip
    """The block count each order of correction and MIN gives, from the ranks' readings
    (:func:`rank_kv`), against vLLM's own ``num_gpu_blocks`` and a cold start's.

    Correct then MIN: ``min(corrected) // per_block``, what vLLM does. MIN then correct:
    ``(min(uncorrected) - external_r) // per_block`` on each rank r, each correcting by its
    own bytes after the collective; the ranks then disagree wherever the external bytes
    differ, and a rank holding less than the smallest reading's rank sizes a cache the
    other cannot hold."""
    if not ranks:
        raise ValueError("no rank readings")
    per_block = ranks[0]["bytes_per_block"]
    if any(r["bytes_per_block"] != per_block for r in ranks):
        raise ValueError(f"ranks' blocks differ in size: {[r['bytes_per_block'] for r in ranks]}")
    correct_then_min = min(r["corrected_kv_bytes"] for r in ranks) // per_block
    smallest_reading = min(r["uncorrected_kv_bytes"] for r in ranks)
    min_then_correct = [(smallest_reading - r["external_bytes"]) // per_block for r in ranks]
    externals = [r["external_bytes"] for r in ranks]
    out: dict = {
        "bytes_per_block": per_block,
        "external_bytes_by_rank": externals,
        "external_spread_bytes": max(externals) - min(externals),
        "external_spread_mib": round((max(externals) - min(externals)) / MiB, 3),
        "blocks_alone_by_rank": [r["blocks_alone"] for r in ranks],
        "correct_then_min_blocks": correct_then_min,
        "min_then_correct_blocks_by_rank": min_then_correct,
        "min_then_correct_ranks_agree": len(set(min_then_correct)) == 1,
        "orders_agree": all(b == correct_then_min for b in min_then_correct),
        "vllm_num_gpu_blocks": vllm_blocks,
        "correct_then_min_is_vllms": vllm_blocks == correct_then_min,
    }
    if cold_blocks is not None:
        out.update({
            "cold_num_gpu_blocks": cold_blocks,
            "correct_then_min_minus_cold_blocks": correct_then_min - cold_blocks,
            "min_then_correct_minus_cold_blocks_by_rank": [b - cold_blocks
                                                           for b in min_then_correct],
            "correct_then_min_equals_cold": correct_then_min == cold_blocks,
            "min_then_correct_equals_cold_on_every_rank": all(
                b == cold_blocks for b in min_then_correct),
        })  # fmt: skip
    return out


def per_rank_pair(cold: Mapping, warm: Mapping, explain: Callable[[Mapping, Mapping], dict],
                  device_use: Callable[[Mapping, Mapping, float | None], dict],
                  daemon_mib: Sequence[float | None]) -> list[dict]:  # fmt: skip
    """Warm against cold, rank by rank: the engine's KV explanation (``explain``, the
    single-GPU harness's, on each rank's own figures) and its device use against rank r's
    daemon (``daemon_mib[r]``: its process's MiB on its GPU)."""
    colds, warms = rank_figures(cold), rank_figures(warm)
    if len(colds) != len(warms):
        raise ValueError(f"{len(colds)} cold ranks against {len(warms)} warm")
    out = []
    for rank, (c, w) in enumerate(zip(colds, warms, strict=True)):
        mib = daemon_mib[rank] if rank < len(daemon_mib) else None
        # The uneven case's buffer counts with the warm rank's external bytes but lives in
        # its engine, not its daemon: the daemon's context is what stays beside the two.
        uneven = w.get("uneven") or {}
        if mib is not None and uneven.get("arm") == "warm":
            mib += uneven["bytes"] / MiB
        out.append({"rank": rank, **explain(c, w), **device_use(c, w, mib)})
    return out


def daemon_mib_by_rank(doc: Mapping, tp: int) -> list[float | None]:
    """Each rank's daemon's device memory after the warm phase (nvidia-smi, MiB, on its own
    GPU: its CUDA context and the rank's layout)."""
    after = doc.get("daemon_after_warm") or {}
    statuses = after.get("ranks") or []
    by_gpu = after.get("compute_apps_by_gpu") or {}
    out: list[float | None] = []
    for rank in range(tp):
        status = statuses[rank] if rank < len(statuses) else {}
        apps = by_gpu.get(status.get("gpu"), {})
        out.append(apps.get(str(status.get("pid"))))
    return out


def weights_by_rank(start: Mapping) -> list[dict]:
    """What each rank's load did: parameters mapped zero-copy and bytes copied into engine
    memory (the adapter's storage report), and the device bytes the load took."""
    return [{"rank": f.get("tp_rank", rank), "mapped": f["load"].get("mapped"),
             "mapped_bytes": f["load"].get("mapped_bytes"), "copied": f["load"].get("copied"),
             "copied_bytes": f["load"].get("copied_bytes"),
             "load_device_bytes": f["load"].get("device_bytes")}
            for rank, f in enumerate(rank_figures(start["figures"]))]  # fmt: skip


def tp_report(doc: Mapping, tp: int, explain: Callable[[Mapping, Mapping], dict],
              device_use: Callable[[Mapping, Mapping, float | None], dict]) -> dict:  # fmt: skip
    """The report's ``tp`` section: per KV pair and rank, warm against cold to the MiB; the
    MIN order on every pair (the ranks even: both orders agree) and on the uneven pair
    (they must not: correct then MIN must give the cold start's blocks); zero copies per
    rank; the kill -9 of one rank's daemon."""
    by_run = {s["run"]: s for s in doc["starts"] if s.get("status") == "ok"}
    daemon_mib = daemon_mib_by_rank(doc, tp)
    pairs = [*KV_PAIRS, ("uneven", *UNEVEN_RUNS)]
    kv: dict = {}
    order: dict = {}
    for mode, cold_run, warm_run in pairs:
        if warm_run in by_run:
            warm = by_run[warm_run]["figures"]
            cold = by_run.get(cold_run, {}).get("figures")
            try:
                order[mode] = min_order([rank_kv(f) for f in rank_figures(warm)],
                                        warm.get("num_gpu_blocks"),
                                        None if cold is None else cold.get("num_gpu_blocks"))
                if cold is not None:
                    kv[mode] = per_rank_pair(cold, warm, explain, device_use, daemon_mib)
            except (KeyError, TypeError, ValueError) as exc:  # another release's figures
                order.setdefault(mode, {"error": repr(exc)})
                kv.setdefault(mode, {"error": repr(exc)})
    weights = {run: weights_by_rank(s) for run, s in by_run.items() if s["arm"] == "warm"}
    copied = [w.get("copied_bytes") for ranks in weights.values() for w in ranks]
    report: dict = {
        "tensor_parallel_size": tp,
        "kv_per_rank": kv,
        "min_order": order,
        "weights_per_rank": weights,
        "zero_bytes_copied_every_rank": bool(copied) and all(c == 0 for c in copied),
        "daemon_device_mib_by_rank": daemon_mib,
    }
    uneven = order.get("uneven")
    if uneven is not None and "error" not in uneven:
        report["uneven_verdict"] = uneven_verdict(uneven)
    kill = doc.get("kill9")
    if kill:
        report["kill9"] = {"rank": kill.get("rank"), "batches": kill.get("batches"),
                           "readopted": kill.get("readopted"),
                           "fresh_engine_equal": kill.get("fresh_engine_equal")}  # fmt: skip
    return report


def uneven_verdict(order: Mapping) -> dict:
    """What the uneven pair shows, in words a table can carry: correct then MIN gives the
    cold start's blocks and is what vLLM did; MIN then correct gives another count on the
    rank(s) holding less, by about the extra buffer's blocks."""
    spread_blocks = order["external_spread_bytes"] / order["bytes_per_block"]
    return {
        "extra_buffer_mib": order["external_spread_mib"],
        "extra_buffer_blocks": round(spread_blocks, 3),
        "correct_then_min_equals_cold": order.get("correct_then_min_equals_cold"),
        "correct_then_min_is_vllms": order["correct_then_min_is_vllms"],
        "min_then_correct_equals_cold_on_every_rank":
            order.get("min_then_correct_equals_cold_on_every_rank"),
        "min_then_correct_excess_blocks_by_rank": [
            b - order["correct_then_min_blocks"]
            for b in order["min_then_correct_blocks_by_rank"]],
        "shown": bool(order.get("correct_then_min_equals_cold"))
        and order["correct_then_min_is_vllms"]
        and order.get("min_then_correct_equals_cold_on_every_rank") is False,
    }  # fmt: skip
