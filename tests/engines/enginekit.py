"""Helpers for the engine adapter tests, which run inside each engine's own venv.

``make test-engines`` builds the pinned venvs (tools/engine_venvs) and runs
each engine's test module with that venv's interpreter and
``WEIGHTCACHE_ENGINE_TESTS=<engine>``. Anywhere else the engine is absent;
the module then skips, naming that absence. Under ``make test-engines`` an
absent engine is a broken venv, and fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest


def require_engine(engine: str) -> None:
    if importlib.util.find_spec(engine) is not None:
        return
    if os.environ.get("WEIGHTCACHE_ENGINE_TESTS") == engine:
        raise RuntimeError(f"{engine} is not importable in its own test venv; rebuild it")
    pytest.skip(
        f"{engine} is not installed in this interpreter (each engine pins its own torch, so "
        f"none is in the project venv); `make test-engines` runs these tests in {engine}'s venvs",
        allow_module_level=True,
    )


GiB = 1 << 30


class EngineServer:
    """A real engine server process (its own process group), its log, its HTTP API."""

    def __init__(self, argv: list[str], port: int, log_path: Path, env: dict[str, str]) -> None:
        self.argv, self.port, self.log_path = argv, port, log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, within_s: float) -> EngineServer:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"{self.argv[:4]} exited with {self.proc.returncode}:\n{self.log()[-6000:]}"
                )
            if self.healthy():
                return self
            time.sleep(1)
        self.stop()
        # A bound on waiting (callers give ten times a quiet start), not a speed check.
        raise TimeoutError(f"not healthy within {within_s:g} s:\n{self.log()[-6000:]}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                return response.status == 200
        except (OSError, urllib.error.URLError):
            return False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def post(self, path: str, body: dict, timeout: float = 120) -> tuple[int, object]:
        """(status, the answer's JSON, or its text where it is not JSON)."""
        request = urllib.request.Request(
            f"{self.url}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status, text = response.status, response.read()
        except urllib.error.HTTPError as exc:
            status, text = exc.code, exc.read()
        try:
            return status, json.loads(text or b"null")
        except ValueError:
            return status, text.decode(errors="replace")

    def stop(self) -> None:
        """SIGTERM the whole process group (the engine's workers too), then SIGKILL."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers of the group
        except ProcessLookupError:
            pass
        self.proc.wait(10)


def outside_the_range(engine: str, series: tuple[str, ...], where: Path) -> dict[str, str]:
    """The environment of an engine server whose weightcache supports only ``series`` of
    ``engine``: the installed engine, untouched, is then a release weightcache does not
    support, as beside a weightcache built for other releases.

    A ``sitecustomize`` module on the server's ``PYTHONPATH`` (run by every interpreter of
    the server: API server, scheduler or engine core, workers) sets the range in
    ``weightcache.integrations.versions.SUPPORTED`` before any plugin loads. What
    weightcache believes changes; the engine, its version metadata and its hooks do not.
    """
    where.mkdir(parents=True, exist_ok=True)
    (where / "sitecustomize.py").write_text(
        "# Written by tests/engines/enginekit.py: this weightcache supports other releases.\n"
        "from weightcache.integrations import versions\n\n"
        f"versions.SUPPORTED[{engine!r}] = {tuple(series)!r}\n"
    )
    path = [str(where), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def assert_refused_at_start(server: EngineServer, within_s: float, refusal: str) -> None:
    """``server`` must fail at start-up, never healthy, with a non-zero status and its log
    naming ``UnsupportedEngineVersion: <refusal>``."""
    deadline = time.monotonic() + within_s
    try:
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                assert server.proc.returncode != 0, server.log()[-6000:]
                assert f"UnsupportedEngineVersion: {refusal}" in server.log()
                return
            if server.healthy():
                raise AssertionError(f"{server.argv[:4]} started:\n{server.log()[-6000:]}")
            time.sleep(1)
        raise TimeoutError(  # a bound on waiting, not a speed check
            f"neither failed nor healthy in {within_s:g} s:\n{server.log()[-6000:]}"
        )
    finally:
        server.stop()  # its workers too


def write_lora(where: Path, model_dir: Path, targets: tuple[str, ...], seed: int = 0) -> Path:
    """A PEFT-format LoRA adapter of the checkpoint in ``model_dir`` (``adapter_config.json``
    and ``adapter_model.safetensors``, as ``peft``'s ``save_pretrained`` writes them): rank
    8 on every linear layer whose name ends in one of ``targets``, named as PEFT names the
    checkpoint's modules, shapes read from the checkpoint. A and B are random (B is not
    PEFT's zero start), so the adapter changes the outputs."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    rank, generator, tensors = 8, torch.Generator().manual_seed(seed), {}
    with safe_open(str(model_dir / "model.safetensors"), "pt") as checkpoint:
        for name in checkpoint.keys():  # noqa: SIM118 - safe_open is not a mapping
            module = name.removesuffix(".weight")
            if module == name or module.rsplit(".", 1)[-1] not in targets:
                continue
            out_features, in_features = checkpoint.get_slice(name).get_shape()
            peft = f"base_model.model.{module}"
            a = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            tensors[f"{peft}.lora_A.weight"] = a
            tensors[f"{peft}.lora_B.weight"] = torch.randn(
                out_features, rank, generator=generator
            ) / rank**0.5
    assert tensors, f"no module of {model_dir} ends in {targets}"
    where.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(where / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
              "bias": "none", "target_modules": list(targets), "fan_in_fan_out": False,
              "base_model_name_or_path": str(model_dir)}  # fmt: skip
    (where / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return where


def checkpoint_variant(base: Path, where: Path, edit) -> Path:
    """``base``'s checkpoint with its tensors (a dict) changed by ``edit``."""
    import shutil

    from safetensors.torch import load_file, save_file

    where.mkdir(parents=True)
    shutil.copy(base / "config.json", where)
    tensors = load_file(base / "model.safetensors")
    edit(tensors)
    save_file(tensors, where / "model.safetensors", metadata={"format": "pt"})
    return where


# The tiny Llama without layer 1's up_proj (issue 41, item 7): the fused gate_up_proj it
# feeds ([2 x 128, 64] bf16) is written in half, and the WARNING says how much.
MISSING_UP_PROJ = "model.layers.1.mlp.up_proj.weight"
HALF_FILLED = "model.layers.1.mlp.gate_up_proj.weight"
HALF_FILLED_WHY = (f"1 parameter(s) filled in part: {HALF_FILLED}: 16,384 of 32,768 bytes "
                   "written by no checkpoint tensor")  # fmt: skip


def without_up_proj(tiny_llama: Path, where: Path) -> Path:
    """The tiny Llama's checkpoint lacking :data:`MISSING_UP_PROJ`, under ``where``."""
    return checkpoint_variant(tiny_llama, where, lambda tensors: tensors.pop(MISSING_UP_PROJ))


def fetches(daemon, op: str = "fetch_state") -> int:
    """The daemon's own count of ``op`` requests answered (its /metrics): ``fetch_state``
    for its checkpoint layout, ``fetch_layout`` for an engine's own."""
    _, _, body = daemon.http("/metrics")
    pattern = rb'^weightcache_requests_total\{op="%s"\} ([0-9.e+]+)$' % op.encode()
    match = re.search(pattern, body, re.M)
    return int(float(match.group(1))) if match else 0


# The daemon names its memfd allocations so (transport/memfd.py); /proc/<pid>/maps shows a
# mapping of one as "/memfd:weightcache-<i> (deleted)".
MEMFD_PREFIX = "/memfd:weightcache-"


def memfd_spans(pid: int | str = "self") -> list[tuple[int, int]]:
    """The address ranges where ``pid`` maps a daemon's memfd memory, from the kernel's
    own account (``/proc/<pid>/maps``), not from anything weightcache keeps."""
    spans = []
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(MEMFD_PREFIX):
                low, high = (int(x, 16) for x in fields[0].split("-"))
                spans.append((low, high))
    return spans


def in_daemon_memory(attached):
    """The engine-storage check: whether a tensor's bytes lie in the daemon's memory,
    read from the tensor's own storage (where the engine's parameter actually is) against
    the process's memfd mappings in /proc/self/maps (over memfd; other transports: the
    mapped allocations). The adapter's own counters are checked against this."""
    if attached.transport == "memfd":
        spans = memfd_spans()
    else:
        spans = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in attached.allocations()]

    def inside(t) -> bool:
        end = t.data_ptr() + t.numel() * t.element_size()
        return t.numel() > 0 and any(lo <= t.data_ptr() and end <= hi for lo, hi in spans)

    return inside


def engine_memory(params: dict, in_daemon, views: dict) -> dict:
    """What the engine holds itself, read from the parameters' storages: the bytes of those
    outside the daemon's memory, and the placeholders among them (a parameter that
    post-processing emptied, keeping its own form of the weight elsewhere, as vLLM's CPU
    build does with its packed GEMM weights) with their bytes in the daemon's layout."""
    outside = {n: p for n, p in params.items() if not in_daemon(p)}
    return {
        "outside_bytes": sum(p.numel() * p.element_size() for p in outside.values()),
        "placeholders": {n: views[n].numel() * views[n].element_size()
                         for n, p in outside.items() if p.numel() == 0 and n in views},
    }  # fmt: skip


def run_ranks(module: str, jobs: list[list[str]], workdir: Path, timeout: float = 600) -> list:
    """``python -m module RANK WORLD PORT OUT JOB...`` once per rank (``jobs[rank]``), all at
    once (they join one process group); each rank's JSON from OUT, in rank order."""
    import sys

    from tests.unit.wc_harness import free_port

    port, world = free_port(), len(jobs)
    ranks = []
    for rank, rank_jobs in enumerate(jobs):
        out, log = workdir / f"rank{rank}.json", workdir / f"rank{rank}.log"
        argv = [sys.executable, "-m", module, str(rank), str(world), str(port), str(out),
                *rank_jobs]  # fmt: skip
        with open(log, "wb") as sink:
            proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
        ranks.append((out, log, proc))
    try:
        for _, _, proc in ranks:
            proc.wait(timeout=timeout)
    finally:
        for _, _, proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = []
    for out, log, proc in ranks:
        assert proc.returncode == 0, log.read_text(errors="replace")[-6000:]
        results.append(json.loads(out.read_text()))
    return results
