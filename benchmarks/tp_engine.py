"""One rank of a tensor-parallel engine, and the means to drive a group of them.

``python -m benchmarks.tp_engine --rank R --world-size N --init-method tcp://... ...``
is one engine process: it joins the process group (NCCL on GPUs, gloo on CPU),
samples its KV baseline, gets its shard of a Llama either from its GPU's rank
daemon (``--socket-dir``/``--cache`` or ``--socket``) or cold from disk, builds
:class:`~benchmarks.tp_llama.TPLlamaForCausalLM` on ``meta``, ``load_into``,
runs a forward pass and prints one JSON line of figures. Then it obeys one
command per stdin line, answering each with one JSON line:

- ``forward TAG``: run the forward again with the weights it holds;
- ``reattach TAG``: attach again (a new daemon may serve now), build a fresh
  module on it and run the forward;
- ``exit``.

Logits go to ``<--out>/<TAG>-rank<R>.safetensors``. Every rank must get the
same commands, since the forward all-reduces. :class:`EngineRanks` starts the
processes of one engine and sends them commands.

An extra runner (``--extra-socket``/``--extra-model``: a whole, unsharded
model on this rank only, like a draft model) makes ranks hold different
amounts, which is when the order of the KV correction and the MIN matters.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.tp_llama import LlamaShape, TPGroup, TPLlamaForCausalLM
from weightcache.checkpoint import cache_config, checkpoint_files, read_checkpoint
from weightcache.client import AttachedWeights, attach, load_into
from weightcache.devices import gpu_uuid
from weightcache.kv import (
    KVBaseline,
    cuda_free_bytes,
    kv_budget_bytes,
    kv_tokens,
    min_across_ranks,
    total_preloaded_bytes,
)
from weightcache.protocol import ShardSpec, socket_path
from weightcache.shard import split_dim

PLAN = "llama"
# NVLink multicast off in every process we start (the shared machines' rule).
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# Each engine process answers a command within this (a hang guard, not a timing check).
REPLY_WITHIN_SECONDS = 600.0


# --------------------------------------------------------------------------- loading


def prompt_ids(vocab_size: int, batch: int = 2, length: int = 64) -> torch.Tensor:
    """A fixed batch of token ids spread over the whole vocabulary (every rank's block)."""
    ids = torch.arange(batch * length, dtype=torch.int64).reshape(batch, length)
    return (ids * 7919 + 13) % vocab_size


def read_shard_from_disk(
    model_dir: Path, spec: ShardSpec, device: torch.device
) -> dict[str, torch.Tensor]:
    """The rank's shard as a cold engine reads it: safetensors slices, not weightcache's loader.

    ``torch.chunk(t, tp, dim)[rank]`` of each split tensor, the whole of the others, so
    the cold path shares no code with the daemon's reading of the same bytes.
    """
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                dim = split_dim(spec.plan, name) if spec.tp_size > 1 else None
                if dim is None:
                    tensors[name] = f.get_tensor(name)
                    continue
                piece = f.get_slice(name)
                size = piece.get_shape()[dim] // spec.tp_size
                index = [slice(None)] * (dim + 1)
                index[dim] = slice(spec.tp_rank * size, (spec.tp_rank + 1) * size)
                # CPU slices along dim 1 come back as strided views of the whole tensor.
                tensors[name] = piece[tuple(index)].to(device).contiguous()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return tensors


def build(shape: LlamaShape, tp: TPGroup, weights, dtype: torch.dtype) -> TPLlamaForCausalLM:
    """The rank's module, parameters on meta, then pointed at ``weights`` (no copies)."""
    model = TPLlamaForCausalLM(shape, tp, dtype)
    unused = load_into(model, weights)
    if unused:
        raise RuntimeError(f"the rank's weights hold tensors the model has no place for: {unused}")
    return model.eval()


def shares_storage(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether every parameter is the very memory of the attached tensor of its name."""
    return all(p.data_ptr() == tensors[n].data_ptr() for n, p in model.named_parameters())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> int | None:
    return cuda_free_bytes(device) if device.type == "cuda" else None


# --------------------------------------------------------------------------- the rank


class Rank:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.out = Path(args.out)
        self.shape = LlamaShape.from_checkpoint(args.model)
        self.spec = ShardSpec(tp_size=args.world_size, tp_rank=args.rank, plan=PLAN)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.transport = "vmm_fd" if self.device.type == "cuda" else "memfd"
        self.attached: list[AttachedWeights] = []
        self.cold: dict[str, torch.Tensor] = {}
        self.cold_extra: dict[str, torch.Tensor] = {}  # held, like a runner's weights
        self.model: TPLlamaForCausalLM | None = None

    def socket(self) -> str | None:
        """The rank daemon's socket: given, or found by this GPU's UUID under the socket dir."""
        a = self.args
        if a.socket or not a.socket_dir:
            return a.socket
        namespace, name = a.cache.split(".", 1)
        uuid = gpu_uuid(self.device.index) if self.device.type == "cuda" else None
        return socket_path(a.socket_dir, namespace, name, uuid)

    def _attach(self) -> tuple[list[AttachedWeights], float]:
        a = self.args
        checkpoint = read_checkpoint(a.model)
        started = time.perf_counter()
        target = attach(
            self.socket(), cache_config(checkpoint, self.device, shard=self.spec),
            transports=[self.transport],
        )  # fmt: skip
        seconds = time.perf_counter() - started
        attached = [target]
        if a.extra_socket:
            extra_config = cache_config(read_checkpoint(a.extra_model), self.device)
            attached.append(attach(a.extra_socket, extra_config, transports=[self.transport]))
        return attached, seconds

    def start(self) -> dict:
        a = self.args
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(
            a.backend,
            init_method=a.init_method,
            rank=a.rank,
            world_size=a.world_size,
            timeout=timedelta(seconds=a.timeout),
            device_id=self.device if self.device.type == "cuda" else None,
        )
        self.tp = TPGroup(a.world_size, a.rank, None)
        # The communicator and its buffers exist before the sample, in either mode, as in
        # engines that size KV after distributed init.
        warm = torch.ones(1, device=self.device)
        dist.all_reduce(warm)
        _sync(self.device)

        report: dict = {"rank": a.rank, "mode": "attach" if self.socket() else "cold",
                        "device": str(self.device), "pid": os.getpid()}  # fmt: skip
        if self.device.type == "cuda":
            report["gpu_uuid"] = gpu_uuid(self.device.index)
            baseline = KVBaseline.sample(self.device)
        started = time.perf_counter()
        if self.socket():
            self.attached, report["attach_s"] = self._attach()
            report["weights_s"] = time.perf_counter() - started
            weights = self.attached[0]
            preloaded = [w.preloaded_weights_bytes for w in self.attached]
            report.update(
                socket=weights.socket_path,
                transport=weights.transport,
                daemon_pid=weights.daemon_pid,
                fingerprint=weights.fingerprint,
                held_bytes=sum(t.nbytes for t in weights.tensors.values()),
            )
        else:
            self.cold = read_shard_from_disk(Path(a.model), self.spec, self.device)
            if a.extra_model:  # a cold engine loads its extra runner itself, whole
                extra = read_shard_from_disk(Path(a.extra_model), ShardSpec(), self.device)
                report["extra_held_bytes"] = sum(t.nbytes for t in extra.values())
                self.cold_extra = extra
            report["weights_s"] = time.perf_counter() - started
            report["held_bytes"] = sum(t.nbytes for t in self.cold.values())
            weights, preloaded = self.cold, [0]
        started = time.perf_counter()
        self.model = build(self.shape, self.tp, weights, self.dtype)
        report["build_and_load_into_s"] = time.perf_counter() - started
        if self.attached:
            report["zero_copy"] = shares_storage(self.model, self.attached[0].tensors)
        if self.device.type == "cuda":
            report["kv"] = self._kv(baseline, preloaded)
        report.update(self.forward(a.tag))
        return report

    def _kv(self, baseline: KVBaseline, preloaded: list[int]) -> dict:
        """Both orders of correction and MIN, with this rank's real free memory."""
        a = self.args
        own = total_preloaded_bytes(*preloaded)
        raw = baseline.raw_bytes
        # The wrong order, for comparison: the MIN over raw samples, then this rank's bytes.
        after_min = min_across_ranks(raw) + own
        baseline.account_preloaded_weights(own)
        before_min = baseline.min_across_ranks()
        post = cuda_free_bytes(self.device)

        def tokens(pre: int) -> int | None:
            try:
                budget = kv_budget_bytes(post, pre, a.mem_fraction)
            except ValueError:
                return None
            return kv_tokens(budget, a.bytes_per_token, a.page_size)

        return {
            "pre_load_free_raw": raw,
            "preloaded_bytes": preloaded,
            "corrected": baseline.corrected_bytes,
            "correct_then_min": before_min,
            "min_then_correct": after_min,
            "post_load_free": post,
            "weights_cost_bytes": raw - post,
            "tokens_correct_then_min": tokens(before_min),
            "tokens_min_then_correct": tokens(after_min),
            "mem_fraction_static": a.mem_fraction,
            "bytes_per_token": a.bytes_per_token,
            "page_size": a.page_size,
        }

    def forward(self, tag: str) -> dict:
        assert self.model is not None
        ids = prompt_ids(self.shape.vocab_size).to(self.device)
        _sync(self.device)
        started = time.perf_counter()
        with torch.inference_mode():
            logits = self.model(ids)
        _sync(self.device)
        seconds = time.perf_counter() - started
        from safetensors.torch import save_file

        path = self.out / f"{tag}-rank{self.args.rank}.safetensors"
        save_file({"logits": logits.cpu().contiguous()}, str(path))
        return {
            "tag": tag,
            "logits": str(path),
            "finite": bool(torch.isfinite(logits).all()),
            "forward_s": seconds,
            "daemon_alive": [w.daemon_alive() for w in self.attached],
        }

    def reattach(self, tag: str) -> dict:
        old = self.attached
        self.attached, attach_s = self._attach()
        self.model = build(self.shape, self.tp, self.attached[0], self.dtype)
        for weights in old:
            weights.close()
        report = {"attach_s": attach_s, "daemon_pid": self.attached[0].daemon_pid,
                  "zero_copy": shares_storage(self.model, self.attached[0].tensors)}  # fmt: skip
        report.update(self.forward(tag))
        return report

    def close(self) -> None:
        self.model = None
        for weights in self.attached:
            weights.close()
        dist.destroy_process_group()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--init-method", required=True, help="tcp://127.0.0.1:PORT or file://PATH")
    p.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    p.add_argument("--device", required=True, help="cuda:N or cpu")
    p.add_argument("--model", required=True, type=Path, help="the checkpoint (config.json too)")
    p.add_argument("--socket", help="this rank's daemon socket (else derived, or a cold load)")
    p.add_argument("--socket-dir", help="find the daemon as <dir>/<cache>/gpu-<UUID>.sock")
    p.add_argument("--cache", default="default.llama", help="NAMESPACE.NAME, with --socket-dir")
    p.add_argument("--extra-socket", help="an extra runner's daemon on this rank (whole model)")
    p.add_argument("--extra-model", type=Path, help="the extra runner's checkpoint")
    p.add_argument("--out", required=True, type=Path, help="where logits are written")
    p.add_argument("--tag", default="start", help="the first forward's tag")
    p.add_argument("--mem-fraction", type=float, default=0.85)
    p.add_argument("--bytes-per-token", type=int, default=65536)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout, seconds")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.extra_socket and not args.extra_model:
        _parser().error("--extra-socket needs --extra-model (the config it expects)")
    rank = Rank(args)
    print(json.dumps(rank.start()), flush=True)
    for line in sys.stdin:
        verb, _, tag = line.strip().partition(" ")
        if verb == "exit":
            break
        if verb == "forward":
            reply = rank.forward(tag)
        elif verb == "reattach":
            reply = rank.reattach(tag)
        else:
            reply = {"error": f"unknown command {line.strip()!r}"}
        print(json.dumps({"rank": args.rank, **reply}), flush=True)
    rank.close()
    return 0


# --------------------------------------------------------------------------- the driver


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineRanks:
    """The processes of one TP engine (one per rank), each answering a JSON line per command.

    ``rank_args[r]`` are rank ``r``'s arguments beyond the rank, world size and rendezvous.
    Logs go to ``<log_dir>/<name>-rank<R>.log``.
    """

    def __init__(self, rank_args: list[list[str]], log_dir: Path, name: str = "engine") -> None:
        world = len(rank_args)
        init = f"tcp://127.0.0.1:{free_port()}"
        env = {**os.environ, **NO_MULTICAST, "PYTHONUNBUFFERED": "1"}
        self.logs = [log_dir / f"{name}-rank{r}.log" for r in range(world)]
        self.procs: list[subprocess.Popen] = []
        self._lines: list[queue.Queue[str | None]] = []
        for r, extra in enumerate(rank_args):
            command = [sys.executable, "-m", "benchmarks.tp_engine", "--rank", str(r),
                       "--world-size", str(world), "--init-method", init, *extra]  # fmt: skip
            with open(self.logs[r], "wb") as log:
                proc = subprocess.Popen(
                    command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                    text=True, env=env,
                )  # fmt: skip
            self.procs.append(proc)
            lines: queue.Queue[str | None] = queue.Queue()
            threading.Thread(target=self._pump, args=(proc, lines), daemon=True).start()
            self._lines.append(lines)

    @staticmethod
    def _pump(proc: subprocess.Popen, lines: queue.Queue) -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def replies(self, within: float = REPLY_WITHIN_SECONDS) -> list[dict]:
        """One JSON reply from every rank, in rank order."""
        deadline = time.monotonic() + within
        out = []
        for r, lines in enumerate(self._lines):
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                raise RuntimeError(
                    f"engine rank {r} gave no reply (exit code {self.procs[r].poll()}):\n"
                    + self.logs[r].read_text(errors="replace")[-4000:]
                )
            out.append(json.loads(line))
        return out

    def command(self, line: str) -> list[dict]:
        for proc in self.procs:
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
        return self.replies()

    def close(self, within: float = 60.0) -> None:
        for proc in self.procs:
            with contextlib.suppress(OSError):
                proc.stdin.write("exit\n")
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(within)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> EngineRanks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    sys.exit(main())
