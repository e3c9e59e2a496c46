"""Issue 24 on a GPU, an engine-free replay: the engines' own layouts executed by the daemon.

The engines' wheels cannot be carried to the GPU machine, so no engine runs
here. What runs instead: load plans that the pinned vLLM and SGLang recorded
on a CPU from their own model classes and weight loaders
(``tools.plan_fixtures``, committed under tests/fixtures/plans/: Llama-3-8B
and Qwen1.5-MoE-A2.7B shapes, bf16) are executed by a real daemon over ``vmm_fd`` from a
checkpoint of random bytes written with safetensors at the recorded names
and shapes. A fresh engine-like process (``tests.gpu.replay_engine``) maps
every parameter by name; attaching allocates nothing (torch's allocator
unchanged, the device's free memory unchanged but for the driver's page
tables of the new mapping); every mapped parameter equals, bit for bit, a reference
that process builds in its own memory by executing the same plan with plain
torch ops.

Fixtures whose plans hash alike are one layout: it is replayed once, the
test's id and its figures naming every fixture it stands for
(``tools.plan_fixtures.fixtures_by_plan``; SGLang's and vLLM's Llama-3-8B
plans are byte-identical), rather than writing and building the same 16 GB
twice. Replays of one checkpoint table in a row (SGLang's and vLLM's
Qwen1.5-MoE plans write the same bytes to the same places and differ only in
names) write its random checkpoint once (``Checkpoints``).

The build is repeated on fresh daemons (``BUILDS``) for the time the daemon
takes to build the layout from its checkpoint layout (its own
``LayoutStatus.seconds``: allocation, device copies, export), written with the
machine to ``$WEIGHTCACHE_RESULTS_DIR/engine_free_replay_<fixtures>.json``
(``<fixtures>``: the fixtures' names joined by ``+``, e.g.
``sglang-llama-3-8b_and_vllm-llama-3-8b``); nothing here asserts on time.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.gpu.conftest import start_daemon
from tests.gpu.random_checkpoint import write_random_checkpoint
from tests.unit.wc_harness import wait_until
from tools.plan_fixtures import Fixture, fixtures_by_plan, read_fixture
from weightcache.checkpoint import cache_config, read_checkpoint
from weightcache.client import attach_layout, daemon_status
from weightcache.daemon.manifest import manifest_path

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]
BUILDS = 3
PAGE_TABLE_PIECE = 2 << 20
REPO = Path(__file__).resolve().parents[2]


def build_once(model_dir: Path, fixture: Fixture, run: Path) -> tuple[dict, object]:
    """A fresh daemon on ``model_dir``; a first engine asks for the fixture's layout (the daemon
    builds it); returns the layout's status once the daemon has settled, and the daemon."""
    daemon = start_daemon(run, model_dir, "--transport", "vmm_fd", socket_path=str(run / "d.sock"))
    config = cache_config(read_checkpoint(model_dir), torch.device("cuda", 0))
    first = attach_layout(daemon.socket_path, config, fixture.plan, ["vmm_fd"], wait_ready=600)
    first.close()
    del first
    gc.collect()
    # Settled: the checkpoint layout dropped, only the engine layout held, and its manifest
    # written (the digest's GPU temporaries returned), so nothing moves the device's free
    # memory while the engine measures it.
    manifest = Path(manifest_path(daemon.socket_path, fixture.plan_hash))

    def settled():
        status = daemon_status(daemon.socket_path)
        held = [lay.plan for lay in status.layouts] == [fixture.plan_hash]
        return status if held and manifest.exists() else None

    status = wait_until(settled, "the daemon to hold only the engine layout, its manifest written",
                        within=120, interval=0.1)  # fmt: skip
    (layout,) = status.layouts
    assert layout.state == "ready" and layout.source == "resident"
    return {"seconds": layout.seconds, "bytes": layout.bytes,
            "expected_bytes": layout.expected_bytes, "source": layout.source,
            "preloaded_weights_bytes": status.preloaded_weights_bytes,
            "checkpoint_load_seconds": status.load_seconds}, daemon  # fmt: skip


class Checkpoints:
    """The random checkpoint of the last replay, kept for the next replay of the same table:
    SGLang's and vLLM's Qwen1.5-MoE plans differ (in names only), their checkpoint is one,
    written once (28.6 GB). One checkpoint on disk at a time."""

    def __init__(self, data: Path) -> None:
        self.data = data
        self.held: tuple[list, Path, int] | None = None

    def get(self, fixture: Fixture) -> tuple[Path, int, float | None]:
        """The checkpoint's directory, its bytes, and the seconds writing it took (None:
        the last replay's, reused)."""
        if self.held is not None and self.held[0] == fixture.checkpoint:
            return self.held[1], self.held[2], None
        self.drop()
        model_dir = self.data / f"ckpt-{fixture.model}"
        started = time.perf_counter()
        written = write_random_checkpoint(fixture, model_dir)
        self.held = (fixture.checkpoint, model_dir, written)
        return model_dir, written, time.perf_counter() - started

    def drop(self) -> None:
        if self.held is not None:
            shutil.rmtree(self.held[1], ignore_errors=True)
            self.held = None


@pytest.fixture(scope="module")
def checkpoints() -> Iterator[Checkpoints]:
    override = os.environ.get("WEIGHTCACHE_REPLAY_DIR")
    data = Path(override or tempfile.mkdtemp(prefix="wcc", dir="/tmp"))
    held = Checkpoints(data)
    try:
        yield held
    finally:
        held.drop()
        if not override:
            shutil.rmtree(data, ignore_errors=True)


def _replay_name(paths: list[Path]) -> str:
    return "_and_".join(p.stem for p in paths)


def _replays() -> list:
    """One replay per recorded plan; Llama-3-8B's (a 16 GB layout over vmm_fd) is in the
    smoke tier."""
    return [pytest.param(paths, marks=[pytest.mark.smoke] if "llama" in _replay_name(paths) else [])
            for paths in fixtures_by_plan()]  # fmt: skip


@pytest.mark.parametrize("paths", _replays(), ids=_replay_name)
def test_engine_free_replay_maps_every_parameter_bit_equal_with_no_extra_memory(
    paths: list[Path], checkpoints: Checkpoints
):
    fixtures = [read_fixture(p) for p in paths]
    fixture = fixtures[0]
    # One plan and one checkpoint table for all of them: one replay stands for each.
    assert all(
        f.plan_hash == fixture.plan_hash and f.checkpoint == fixture.checkpoint for f in fixtures
    )
    if len(paths) > 1:
        print(f"one replay for {_replay_name(paths)}: the same plan {fixture.plan_hash[:12]}")
    path = paths[0]
    # Short paths: a socket address has 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="wcr", dir="/tmp"))
    try:
        model_dir, written, write_s = checkpoints.get(fixture)
        builds = []
        for i in range(BUILDS):
            run = root / f"r{i}"
            run.mkdir()
            build, daemon = build_once(model_dir, fixture, run)
            builds.append(build)
            if i < BUILDS - 1:
                daemon.stop()
        try:
            out = root / "engine.json"
            engine = subprocess.run(
                [sys.executable, "-m", "tests.gpu.replay_engine", str(path), str(model_dir),
                 daemon.socket_path, str(out)],
                cwd=REPO, capture_output=True, text=True, timeout=900,
            )  # fmt: skip
            assert engine.returncode == 0, engine.stdout[-3000:] + engine.stderr[-3000:]
            seen = json.loads(out.read_text())
        finally:
            daemon.stop()
        figures = {
            "what": "engine-free replay: a plan recorded from the pinned engine on CPU, "
            "executed by the daemon over vmm_fd on this GPU; no engine ran here",
            "engines_that_recorded_the_plan": [f.engine for f in fixtures],
            "fixtures": [p.name for p in paths],
            "model": fixture.model,
            "plan_hash": fixture.plan_hash,
            "params": len(fixture.plan.params),
            "copies": len(fixture.plan.copies),
            "checkpoint_bytes": written,
            "checkpoint_write_seconds": write_s,  # None: the previous replay's checkpoint
            "layout_builds": builds,
            "engine": seen,
        }
        _record(_replay_name(paths), figures)
        # Every parameter of the engine's table, mapped by name (and by each of its other
        # names: vLLM registers a shared expert twice) from the daemon's memory.
        names = sum(1 + len(p.aliases) for p in fixture.plan.params)
        assert seen["names_mapped"] == names and seen["params"] == len(fixture.plan.params)
        assert seen["params_in_daemon_memory"] == seen["params"]
        assert seen["mapped_bytes"] == fixture.planned_bytes == builds[-1]["expected_bytes"]
        assert seen["transport"] == "vmm_fd" and seen["plan_hash"] == fixture.plan_hash
        # Attaching allocates nothing: the engine's weights are the daemon's memory. torch's
        # allocator holds what it held; the device's free memory moves only by the driver's
        # page tables for the new mapping, taken in 2 MiB pieces (on the H200: none for
        # Llama-3-8B's 16 GB, one piece for Qwen1.5-MoE's 28.6 GB; a second mapping of the
        # same layout costs the same and gives it back when closed: benchmarks/results).
        assert seen["torch_reserved_after"] == seen["torch_reserved_before"]
        assert 0 <= seen["free_before"] - seen["free_after"] <= PAGE_TABLE_PIECE
        # And they are the bytes the plan says, executed independently with plain torch ops.
        assert seen["differ"] == []
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _record(name: str, figures: dict) -> None:
    out = os.environ.get("WEIGHTCACHE_RESULTS_DIR")
    if not out:
        print(json.dumps(figures, indent=1))
        return
    from benchmarks.machine import describe

    figures = {"machine": describe(out), "date": time.strftime("%Y-%m-%d"), **figures}
    Path(out, f"engine_free_replay_{name}.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures, indent=1))
