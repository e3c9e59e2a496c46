"""benchmarks/sglang_real.py's engine process, run for real on CPU (the GPU run's dry run).

The harness's own ``_engine`` entry, in this venv's SGLang 0.5.23, in the
environment its ``Bench`` builds (the plugin stubs through which SGLang finds
weightcache and the probe), against a real daemon (the project venv's torch)
holding the tiny Llama over memfd. What differs from the GPU run is only what
a CPU needs: the spec's ``engine_args`` (device ``cpu``, SGLang's
``torch_native`` attention, a 2,048-token pool), the memfd transport, and a
stand-in for vLLM's rotary kernel, which SGLang imports on a CPU that is not
its CPU engine and never calls there (tests/engines/sglang_layout_kit.py).
Not run here: CUDA (graphs, FA3, the JIT kernels, the deterministic mode,
device-memory figures) and the orchestrator's phases.

Three starts, as the GPU run's arms: cold (SGLang's own loader), warm
(SGLang's own layout from the daemon, bit-equal to cold, every parameter
mapped, none copied, the probe's sizing figures read in the scheduler), and a
warm engine generating in a loop while the daemon is killed with SIGKILL and
started again (it re-adopts the layout from the engine): no batch fails, every
batch equals the first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.engines.enginekit import require_engine

require_engine("sglang")

from benchmarks import sglang_real  # noqa: E402
from benchmarks.engine_real import compare_outputs, read_events, wait  # noqa: E402
from weightcache.client import daemon_status  # noqa: E402

START_WITHIN_S = 600  # a loaded 2-core machine; a quiet one starts SGLang in about a minute
PROMPTS = [[5, 17, 33, 61, 99], list(range(3, 43))]  # below the tiny vocabulary (250)
# Installed in every process of an engine start (the scheduler's too): sitecustomize.
ROTARY_STAND_IN = '''
import sys, types


def rotary_embedding(*args, **kwargs):
    raise RuntimeError("vLLM's rotary kernel is not installed; SGLang's CPU path never calls it")


stand_in = types.ModuleType("vllm._custom_ops")
stand_in.rotary_embedding = rotary_embedding
sys.modules.setdefault("vllm._custom_ops", stand_in)  # not `vllm`: find_spec stays None
'''


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> sglang_real.Bench:
    """The harness's Bench for a work folder of its own (its plugin stubs, its env)."""
    root = tmp_path_factory.mktemp("sglang-real")
    (root / "site").mkdir()  # this venv holds SGLang: the offline site is empty
    args = sglang_real.parse_args(["--work", str(root / "work"), "--site", str(root / "site")],
                                  {"OUT": str(root)})  # fmt: skip
    return sglang_real.Bench(args)


@pytest.fixture(scope="module")
def daemon(session_daemons, tiny_dirs):
    return session_daemons(tiny_dirs["llama"], "--transport", "memfd",
                           socket_name="sglang-real/cpu.sock")  # fmt: skip


def engine_env(harness: sglang_real.Bench) -> dict[str, str]:
    shim = harness.work / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(ROTARY_STAND_IN)
    env = harness.engine_env()
    env.update({
        "PYTHONPATH": os.pathsep.join([str(shim), env["PYTHONPATH"]]),
        # The venv's CUDA wheels carry NCCL: without a GPU, gloo alone (sglang_layout_kit).
        "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so.2",
        "SGLANG_CPU_OMP_THREADS_BIND": "0",
    })  # fmt: skip
    return env


def run_engine(harness: sglang_real.Bench, name: str, arm: str, socket: str,
               while_serving=None) -> dict:  # noqa: ANN001 - a callable of the events path
    """One ``sglang_real.py _engine`` process; its result (the log on failure)."""
    work = harness.work
    spec = {"model": str(harness.model), "arm": arm, "eager": True, "deterministic": False,
            "socket": socket, "result": str(work / f"{name}.json"), "utilization": 0.85,
            "prompts": PROMPTS, "max_tokens": 8, "logprobs": 5,
            "serve": while_serving is not None, "events": str(work / f"{name}.events"),
            "stop": str(work / f"{name}.stop"), "figures": str(work / f"{name}.figures.json"),
            "transports": ["memfd"],
            "engine_args": {"device": "cpu", "attention_backend": "torch_native",
                            "max_total_tokens": 2048}}  # fmt: skip
    spec_path = work / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    log = work / f"{name}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, sglang_real.__file__, "_engine", str(spec_path)],
            env=engine_env(harness), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        if while_serving is not None:
            while_serving(Path(spec["events"]), proc)
            Path(spec["stop"]).touch()
        proc.wait(START_WITHIN_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert proc.returncode == 0, log.read_text(errors="replace")[-6000:]
    return json.loads(Path(spec["result"]).read_text())


@pytest.fixture(scope="module")
def cold(harness, tiny_dirs) -> dict:
    harness.model.parent.mkdir(parents=True, exist_ok=True)
    if not harness.model.exists():
        harness.model.symlink_to(tiny_dirs["llama"])
    return run_engine(harness, "cold", "cold", str(harness.work / "no-daemon.sock"))


@pytest.fixture(scope="module")
def warm(harness, cold, daemon) -> dict:
    return run_engine(harness, "warm", "warm", daemon.socket)


def test_cold_is_sglangs_own_loader_with_nothing_preloaded(cold) -> None:
    figures = cold["figures"]
    assert figures["load"]["loader"] == "DefaultModelLoader"
    assert figures["account"]["preloaded_bytes"] == 0
    assert figures["max_total_num_tokens"] == 2048
    assert [len(o["token_ids"]) for o in cold["outputs"]] == [8, 8]
    # The prompt's logprobs from its second position on, each a top-5.
    assert [len(o["prompt_logprobs"]) for o in cold["outputs"]] == [4, 39]
    assert {len(position) for o in cold["outputs"] for position in o["logprobs"]} == {5}


def test_warm_maps_sglangs_own_layout_and_answers_bit_equal_to_cold(warm, cold) -> None:
    assert compare_outputs(cold["outputs"], warm["outputs"])["equal"]
    load = warm["figures"]["load"]
    assert load["loader"] == "WeightcacheModelLoader" and load["path"] == "engine layout"
    assert load["copied"] == 0 and load["copied_bytes"] == 0 and load["mapped"] > 0
    assert load["transport"] == "memfd" and load["disk"] is None
    # What SGLang added back to its pre-load sample is what the loader reported.
    account = warm["figures"]["account"]
    assert account["preloaded_bytes"] == load["loader_preloaded_weights_bytes"] > 0
    profile, pool = warm["figures"]["profile"], warm["figures"]["pool"]
    assert profile["pre_model_load_gib"] == account["baseline_gib"]
    assert profile["rest_bytes"] == pool["available_bytes"] and pool["cell_size"] > 0
    assert warm["figures"]["max_total_num_tokens"] == cold["figures"]["max_total_num_tokens"]


def test_a_warm_engine_serves_through_kill_9_of_its_daemon(harness, warm, daemon) -> None:
    marks: dict = {}

    def while_serving(events: Path, proc: subprocess.Popen) -> None:
        def served_since(t: float) -> int:
            assert proc.poll() is None, "the serving engine exited"
            return sum(1 for e in read_events(events) if e["started"] > t)

        assert wait(lambda: served_since(0) >= 2, START_WITHIN_S)
        marks["killed"] = time.time()
        daemon.kill()
        assert wait(lambda: served_since(marks["killed"]) >= 3, 120)
        marks["restarted"] = time.time()
        daemon.start()  # waits until ready: it re-adopts the layout from the engine
        marks["source"] = daemon_status(daemon.socket).load_source
        ready = time.time()
        assert wait(lambda: served_since(ready) >= 3, 120)

    served = run_engine(harness, "serving", "warm", daemon.socket, while_serving)
    events = read_events(harness.work / "serving.events")
    assert served["batches"]["failed"] == 0
    assert served["batches"]["equal"] == served["batches"]["served"] == len(events)
    assert sum(1 for e in events if marks["killed"] <= e["started"] < marks["restarted"]) >= 3
    assert marks["source"] == "readopted"
    assert compare_outputs(warm["outputs"], served["outputs"])["equal"]
