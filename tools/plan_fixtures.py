"""Load plans recorded from the pinned engines, committed as fixtures (tests/fixtures/plans/).

Run by the engine's own venv interpreter, with this checkout's sources first on the path
(the venv's editable install may be another checkout's)::

    PYTHONPATH=sidecar:. "$(.venv/bin/python -m tools.engine_venvs path vllm)/bin/python" \
        -m tools.plan_fixtures --engine vllm [MODEL...]
    PYTHONPATH=sidecar:. "$(.venv/bin/python -m tools.engine_venvs path sglang)/bin/python" \
        -m tools.plan_fixtures --engine sglang [MODEL...]

For each model below (default: all) it builds the engine's own model class
on ``meta``, runs the engine's own weight loading and post-processing under
the tracer (:mod:`weightcache.integrations.trace`) against the checkpoint's
tensor table (names, dtypes, shapes as the published checkpoint stores
them), and writes ``<engine>-<model>.json``: the model's config, the
checkpoint table, the canonical plan, its hash and everything the tracer
reported (parameters not planned and why, post-processing's writes and
errors, parameters or checkpoint tensors nothing touched). Nothing is read
or allocated: a 16 GB model traces in seconds on a CPU.

- vLLM: ``initialize_model``, ``load_weights`` and
  ``process_weights_after_loading`` on its CPU platform, one rank of its
  groups over gloo.
- SGLang: the adapter's own trace,
  :func:`weightcache.integrations.sglang.loader.trace_sglang_load`
  (``_initialize_model``, ``DefaultModelLoader.load_weights_only`` and
  ``postprocess_weights``: what the loader asks its daemon for), in a
  process set up as the engine-layout tests set up one SGLang rank on CPU
  (``tests.engines.sglang_layout_kit``: server arguments published, SGLang's
  groups over gloo, a stand-in for vLLM's rotary kernel, which SGLang imports
  when it builds the model on CPU and calls only in forward). SGLang's
  process-wide configuration is one model's, so each model is recorded in a
  process of its own.

The fixtures let code without the engine installed (the GPU machine, where the
engines' wheels cannot be carried) execute exactly the layouts the engines ask
for: :func:`read_fixture` needs only ``weightcache.plan``. Fixtures whose plans
hash alike are one layout (:func:`fixtures_by_plan`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from weightcache.plan import LoadPlan, SourceTensor, canonical, plan_hash

if TYPE_CHECKING:
    from weightcache.integrations.trace import TraceReport

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "plans"

# Published configurations (the fields the engines read), bf16 checkpoints.
LLAMA_3_8B = {
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
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
QWEN1_5_MOE_A2_7B = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "vocab_size": 151936,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "sliding_window": 32768,
    "max_window_layers": 21,
    "qkv_bias": True,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
}


@dataclass(frozen=True)
class Model:
    name: str  # the fixture's name and what it is shaped like
    config: dict

    def checkpoint(self) -> dict[str, SourceTensor]:
        """The checkpoint's tensors as the published safetensors files name and shape them."""
        c = self.config
        table = dict(_decoder(c))
        if c["model_type"] == "llama":
            for i in range(c["num_hidden_layers"]):
                table.update(_dense_mlp(f"model.layers.{i}.mlp", c["hidden_size"],
                                        c["intermediate_size"]))  # fmt: skip
        else:  # qwen2_moe: routed experts, one shared expert behind a gate
            h, e = c["hidden_size"], c["num_experts"]
            for i in range(c["num_hidden_layers"]):
                mlp = f"model.layers.{i}.mlp"
                table[f"{mlp}.gate.weight"] = _bf16(e, h)
                for j in range(e):
                    table.update(_dense_mlp(f"{mlp}.experts.{j}", h, c["moe_intermediate_size"]))
                table.update(
                    _dense_mlp(f"{mlp}.shared_expert", h, c["shared_expert_intermediate_size"])
                )
                table[f"{mlp}.shared_expert_gate.weight"] = _bf16(1, h)
        return table


MODELS = [Model("llama-3-8b", LLAMA_3_8B), Model("qwen1.5-moe-a2.7b", QWEN1_5_MOE_A2_7B)]


def _bf16(*shape: int) -> SourceTensor:
    return SourceTensor("bfloat16", tuple(shape))


def _decoder(c: dict) -> Iterator[tuple[str, SourceTensor]]:
    """Embeddings, attention, norms and head: what Llama and Qwen2-MoE checkpoints share."""
    h, v = c["hidden_size"], c["vocab_size"]
    d = h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    yield "model.embed_tokens.weight", _bf16(v, h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", _bf16(h)
        yield f"{p}.post_attention_layernorm.weight", _bf16(h)
        for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            yield f"{p}.self_attn.{proj}.weight", _bf16(rows, h)
            if c.get("qkv_bias"):
                yield f"{p}.self_attn.{proj}.bias", _bf16(rows)
        yield f"{p}.self_attn.o_proj.weight", _bf16(h, q)
    yield "model.norm.weight", _bf16(h)
    yield "lm_head.weight", _bf16(v, h)


def _dense_mlp(prefix: str, h: int, inter: int) -> dict[str, SourceTensor]:
    return {
        f"{prefix}.gate_proj.weight": _bf16(inter, h),
        f"{prefix}.up_proj.weight": _bf16(inter, h),
        f"{prefix}.down_proj.weight": _bf16(h, inter),
    }


# --------------------------------------------------------------------------- reading


class Fixture(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One recorded plan: who recorded it, from what, and what the tracer reported."""

    engine: str  # "vllm 0.33.0", "sglang 0.5.23"
    model: str
    config: dict
    dtype: str
    # The checkpoint: [name, dtype, shape] in file order.
    checkpoint: list[tuple[str, str, list[int]]]
    plan_hash: str
    planned_bytes: int
    # What the tracer reported (weightcache.integrations.trace.TraceReport):
    copied: dict[str, str]  # parameters it could not plan, and why
    post_processed: dict[str, tuple[str, str]]  # planned; post-processing writes/replaces them
    post_error: str | None  # post-processing could not run on meta
    unwritten: list[str]  # parameters nothing in loading wrote (so not in the plan)
    incomplete: list[str]  # planned parameters some elements of which nothing writes
    unread: list[str]  # checkpoint tensors no planned copy reads
    created: list[str]  # tensors post-processing added
    plan: LoadPlan

    def sources(self) -> dict[str, SourceTensor]:
        return {name: SourceTensor(dtype, tuple(shape)) for name, dtype, shape in self.checkpoint}


def fixture_paths() -> list[Path]:
    return sorted(FIXTURES.glob("*.json"))


class _RecordedHash(msgspec.Struct):
    plan_hash: str


def fixtures_by_plan(paths: list[Path] | None = None) -> list[list[Path]]:
    """The fixtures (default: all) grouped by recorded plan hash, in path order. Fixtures of
    one hash are one layout (SGLang's and vLLM's Llama-3-8B are), which the GPU replay
    builds once for all of them. Reads only the hash: :func:`read_fixture` verifies it."""
    groups: dict[str, list[Path]] = {}
    for path in fixture_paths() if paths is None else paths:
        recorded = msgspec.json.decode(path.read_bytes(), type=_RecordedHash).plan_hash
        groups.setdefault(recorded, []).append(path)
    return list(groups.values())


def read_fixture(path: Path) -> Fixture:
    """A fixture, refused if its plan no longer hashes to what was recorded."""
    fixture = msgspec.json.decode(path.read_bytes(), type=Fixture)
    if plan_hash(fixture.plan) != fixture.plan_hash:
        raise ValueError(f"{path.name}: the plan hashes to {plan_hash(fixture.plan)}, "
                         f"not the recorded {fixture.plan_hash}")  # fmt: skip
    return fixture


# --------------------------------------------------------------------------- recording


def record_vllm(model: Model, work: Path) -> Fixture:
    """vLLM's own model class for ``model``, traced on meta (CPU platform, one rank)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import torch
    import vllm
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import (
        initialize_model,
        process_weights_after_loading,
    )
    from vllm.utils.torch_utils import set_default_torch_dtype

    from weightcache.client import meta_parameters
    from weightcache.integrations.trace import trace_load

    args = EngineArgs(model=str(_model_dir(model, work)), dtype="bfloat16",
                      skip_tokenizer_init=True, load_format="dummy")  # fmt: skip
    config = args.create_engine_config()
    sources = model.checkpoint()
    cpu = torch.device("cpu")
    with set_current_vllm_config(config):
        _vllm_groups()
        with set_default_torch_dtype(torch.bfloat16), cpu, meta_parameters():
            engine_model = initialize_model(vllm_config=config, model_config=config.model_config)
        report = trace_load(
            engine_model, sources, engine_model.load_weights,
            post_process=lambda: process_weights_after_loading(
                engine_model, config.model_config, cpu
            ),
        )  # fmt: skip
    return _fixture(f"vllm {vllm.__version__}", model, sources, report)


_groups_ready = False


def _vllm_groups() -> None:
    """vLLM's model classes read their rank from its process groups: one rank, gloo."""
    global _groups_ready
    if _groups_ready:
        return
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    init_method = f"tcp://127.0.0.1:{_free_port()}"
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=init_method)  # fmt: skip
    ensure_model_parallel_initialized(1, 1)
    _groups_ready = True


def record_sglang(model: Model, work: Path) -> Fixture:
    """SGLang's own model class for ``model``, traced by the adapter's own trace (CPU, one
    rank); once per process (SGLang's published configuration is this model's)."""
    import sglang
    import torch
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig

    from tests.engines.sglang_layout_kit import publish_rank, rotary_kernel_stand_in

    model_dir = str(_model_dir(model, work))
    rotary_kernel_stand_in()
    publish_rank(model_dir, world=1, rank=0, port=_free_port(), dtype="bfloat16")
    from weightcache.integrations.sglang.loader import trace_sglang_load

    sources = model.checkpoint()
    report = trace_sglang_load(
        ModelConfig(model_path=model_dir, dtype="bfloat16"), LoadConfig(), torch.device("cpu"),
        sources,
    )  # fmt: skip
    return _fixture(f"sglang {sglang.__version__}", model, sources, report)


RECORDERS = {"vllm": record_vllm, "sglang": record_sglang}


def _model_dir(model: Model, work: Path) -> Path:
    """A model directory holding the config alone: the engines build the model from it."""
    model_dir = work / model.name
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(model.config))
    return model_dir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fixture(
    engine: str, model: Model, sources: dict[str, SourceTensor], report: TraceReport
) -> Fixture:
    if report.plan is None:
        raise RuntimeError(f"{engine}, {model.name}: the loading gave nothing to plan: "
                           f"{report.copied}")  # fmt: skip
    plan = canonical(report.plan)
    return Fixture(
        engine=engine,
        model=model.name,
        config=model.config,
        dtype="bfloat16",
        checkpoint=[(n, s.dtype, list(s.shape)) for n, s in sources.items()],
        plan_hash=plan_hash(plan),
        planned_bytes=report.planned_bytes,
        copied=report.copied,
        post_processed=report.post_processed,
        post_error=report.post_error,
        unwritten=report.unwritten,
        incomplete=sorted(report.incomplete),
        unread=report.unread,
        created=report.created,
        plan=plan,
    )


def write_fixture(fixture: Fixture, out: Path) -> Path:
    path = out / f"{fixture.engine.split()[0]}-{fixture.model}.json"
    path.write_bytes(msgspec.json.encode(fixture, order="sorted") + b"\n")
    return path


def main(argv: list[str] | None = None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(
        prog="python -m tools.plan_fixtures", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--engine", required=True, choices=list(RECORDERS),
                        help="the engine whose venv runs this")  # fmt: skip
    parser.add_argument("--out", type=Path, default=FIXTURES)
    names = [m.name for m in MODELS]
    parser.add_argument("models", nargs="*", metavar="MODEL", help=f"default: all of {names}")
    args = parser.parse_args(argv)
    unknown = [name for name in args.models if name not in names]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; expected some of {names}")
    chosen = [m for m in MODELS if not args.models or m.name in args.models]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.engine == "sglang" and len(chosen) > 1:
        for model in chosen:  # a process per model (record_sglang)
            argv = ["--engine", "sglang", "--out", str(args.out), model.name]
            code = subprocess.run([sys.executable, "-m", "tools.plan_fixtures", *argv]).returncode
            if code:
                return code
        return 0
    with tempfile.TemporaryDirectory() as work:
        for model in chosen:
            fixture = RECORDERS[args.engine](model, Path(work))
            path = write_fixture(fixture, args.out)
            print(f"{path}: {len(fixture.plan.params)} parameters, {len(fixture.plan.copies)} "
                  f"copies, {fixture.planned_bytes} bytes planned, {len(fixture.copied)} "
                  f"not planned, {len(fixture.post_processed)} post-processed, post_error "
                  f"{fixture.post_error!r}, plan {fixture.plan_hash}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
