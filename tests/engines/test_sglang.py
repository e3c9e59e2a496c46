"""weightcache.integrations.sglang against the real, pinned SGLang (its own venv, CPU).

SGLang's plugin loader, ``get_model_loader``, ``LoadConfig``, ``ModelConfig``,
``ServerArgs`` and ``ModelRunner``'s preloaded-bytes accounting are the
package's own; the daemons are real (memfd, MiniLM). SGLang's scheduler and
CUDA model runner cannot start without a GPU: their two accounting methods
run here on a ``ModelRunner`` made without its (GPU) constructor.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.engines.enginekit import GiB, require_engine

require_engine("sglang")

from sglang.srt.configs.device_config import DeviceConfig  # noqa: E402
from sglang.srt.configs.load_config import LoadConfig  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sglang.srt.model_loader.loader import get_model_loader  # noqa: E402
from sglang.srt.plugins import (  # noqa: E402
    GENERAL_PLUGINS_GROUP,
    load_plugins,
    load_plugins_by_group,
)

import weightcache.integrations.sglang as adapter  # noqa: E402
from weightcache.client import ConfigMismatch  # noqa: E402
from weightcache.integrations.sglang.launch import configure, split_argv  # noqa: E402
from weightcache.integrations.sglang.loader import WeightcacheModelLoader  # noqa: E402

CPU = DeviceConfig("cpu")


@pytest.fixture(scope="module")
def model_config(minilm_dir: Path) -> ModelConfig:
    return ModelConfig(model_path=str(minilm_dir), dtype="float32")


def loader_for(settings: dict) -> WeightcacheModelLoader:
    """What SGLang's lookup gives for the launcher's route: the class as load_format."""
    return get_model_loader(
        LoadConfig(
            load_format=WeightcacheModelLoader, model_loader_extra_config={"weightcache": settings}
        )
    )


def runner_with(loader) -> ModelRunner:
    """SGLang's ModelRunner without its GPU constructor: its accounting methods are real."""
    runner = object.__new__(ModelRunner)
    runner.loader = loader
    return runner


def test_the_entry_point_is_discovered_by_sglangs_plugin_loader() -> None:
    plugins = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    func, dist = plugins["weightcache"]
    assert func is adapter.register and dist == "weightcache"


def test_sglangs_loader_lookup_returns_ours(minilm_dir) -> None:
    load_plugins()  # every SGLang process does this; applies our get_model_loader hook
    extra = {"weightcache": {"socket": "/tmp/d.sock", "wait_ready_s": "5"}}
    by_extra_config = get_model_loader(LoadConfig(model_loader_extra_config=json.dumps(extra)))
    assert type(by_extra_config) is WeightcacheModelLoader
    assert by_extra_config.settings.wait_ready_s == 5.0
    assert type(loader_for({"socket": "/tmp/d.sock"})) is WeightcacheModelLoader
    # Without our key SGLang's own choice stands.
    assert type(get_model_loader(LoadConfig())).__name__ == "DefaultModelLoader"


def test_an_unsupported_sglang_keeps_its_own_loaders_and_refuses_ours(monkeypatch, caplog):
    """As if the installed SGLang were outside the tested range: register() (run by
    SGLang's load_plugins for every installed plugin) raises nothing and warns once;
    without our config key SGLang's own loader is chosen; with it, a loader that refuses
    naming the supported releases."""
    import logging

    from weightcache.integrations import versions
    from weightcache.integrations.versions import UnsupportedEngineVersion

    monkeypatch.setitem(versions.SUPPORTED, "sglang", ("0.5.20", "0.5.21"))
    monkeypatch.setattr(adapter, "_registered", False)
    monkeypatch.setattr(adapter, "_unsupported", None)
    with caplog.at_level(logging.WARNING):
        adapter.register()
        adapter.register()
    warnings = {r.getMessage() for r in caplog.records if r.name.startswith("weightcache")}
    assert len(warnings) == 1  # once, however often SGLang calls register()
    assert "0.5.20.x and 0.5.21.x" in warnings.pop()
    load_plugins()
    assert type(get_model_loader(LoadConfig())).__name__ == "DefaultModelLoader"
    extra = json.dumps({"weightcache": {"socket": "/tmp/d.sock"}})
    with pytest.raises(UnsupportedEngineVersion, match=r"SGLang 0\.5\.20\.x and 0\.5\.21"):
        get_model_loader(LoadConfig(model_loader_extra_config=extra))


def test_sglangs_own_weight_cache_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="--weight-cache-mode client selects SGLang's own"):
        get_model_loader(
            LoadConfig(
                load_format=WeightcacheModelLoader,
                model_loader_extra_config={"weightcache": {"socket": "/tmp/d.sock"}},
                weight_cache_mode="client",
            )
        )


def test_preloaded_weights_bytes_are_the_running_daemons(memfd_daemon, model_config) -> None:
    loader = loader_for({"socket": memfd_daemon.socket})
    assert loader.preloaded_weights_bytes == 0  # nothing decided before load_model
    decided = loader.attachment(model_config, CPU)
    assert decided.attached.transport == "memfd"
    expected = memfd_daemon.status().preloaded_weights_bytes
    assert loader.preloaded_weights_bytes == expected > 0
    assert runner_with(loader).preloaded_weights_bytes == expected  # SGLang's own property


def test_preloaded_weights_bytes_are_zero_when_falling_back(model_config) -> None:
    loader = loader_for({"socket": "/tmp/wc-no-daemon-here/cpu.sock", "wait_ready_s": 0})
    assert loader.attachment(model_config, CPU).attached is None
    assert runner_with(loader).preloaded_weights_bytes == 0


def test_a_quantized_model_goes_to_sglangs_own_loader_never_stopping_it(
    memfd_daemon, model_config, caplog
) -> None:
    """Its post-processing re-lays the weights into SGLang's own memory: SGLang's default
    loader loads it from disk (0 preloaded bytes), one WARNING says why, the daemon is
    never asked; with ``fallback`` off the start fails saying why (issue 33, item 5)."""
    import copy

    from weightcache.integrations.layouts import NotServable

    quantized = copy.copy(model_config)
    quantized.quantization = "fp8"
    before = memfd_daemon.status()
    with caplog.at_level("WARNING", logger="weightcache"):
        loader = loader_for({"socket": memfd_daemon.socket})
        assert loader.layout(quantized, CPU).disk is not None
        assert loader.attachment(quantized, CPU).attached is None
        assert runner_with(loader).preloaded_weights_bytes == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        "weightcache: the engine's default loader loads the model from disk: quantization "
        "'fp8': its post-processing re-lays the weights into SGLang's own memory"
    ]
    assert memfd_daemon.status().fingerprint == before.fingerprint  # never asked
    with pytest.raises(NotServable, match="quantization 'fp8'.*fallback is off"):
        loader_for({"socket": memfd_daemon.socket, "fallback": False}).layout(quantized, CPU)


def test_account_preloaded_weights_gives_the_cold_start_baseline(memfd_daemon, model_config):
    loader = loader_for({"socket": memfd_daemon.socket})
    loader.attachment(model_config, CPU)
    runner = runner_with(loader)
    weights = runner.preloaded_weights_bytes
    cold_free = 70 * GiB  # what a cold start samples before loading
    runner.pre_model_load_memory = (cold_free - weights) / GiB  # sampled with weights resident
    runner.account_preloaded_weights(weights)
    assert runner.pre_model_load_memory == cold_free / GiB

    fallback = runner_with(loader_for({"socket": "/tmp/wc-absent.sock", "wait_ready_s": 0}))
    fallback.loader.attachment(model_config, CPU)
    fallback.pre_model_load_memory = cold_free / GiB
    fallback.account_preloaded_weights(fallback.preloaded_weights_bytes)
    assert fallback.pre_model_load_memory == cold_free / GiB


def test_a_mismatched_daemon_is_refused_naming_the_field(float16_daemon, model_config) -> None:
    with pytest.raises(ConfigMismatch) as caught:
        loader_for({"socket": float16_daemon.socket, "fallback": False}).attachment(
            model_config, CPU
        )
    assert caught.value.fields == ["dtype"]
    assert "dtype (engine expects 'float32')" in str(caught.value)
    allowed = loader_for({"socket": float16_daemon.socket})  # fallback: the default
    assert allowed.attachment(model_config, CPU).attached is None
    assert allowed.preloaded_weights_bytes == 0


def test_the_launcher_points_sglangs_server_args_at_our_loader(minilm_dir) -> None:
    from sglang.srt.server_args import prepare_server_args

    settings, rest = split_argv(
        ["--model-path", str(minilm_dir), "--weightcache-socket-dir", "/run/wc",
         "--weightcache-cache", "ns.minilm", "--weightcache-fallback",
         "--model-loader-extra-config", '{"weightcache": {"wait_ready_s": 9}}']
    )  # fmt: skip
    assert settings == {"socket_dir": "/run/wc", "cache": "ns.minilm", "fallback": True}
    server_args = prepare_server_args(rest)
    configure(server_args, settings, {})
    assert server_args.load_format is WeightcacheModelLoader
    loader = get_model_loader(
        LoadConfig(
            load_format=server_args.load_format,
            model_loader_extra_config=server_args.model_loader_extra_config,
        )
    )
    assert loader.settings.socket_dir == "/run/wc" and loader.settings.cache == "ns.minilm"
    assert loader.settings.fallback is True and loader.settings.wait_ready_s == 9.0


def test_the_launcher_refuses_sglangs_weight_cache_mode(minilm_dir) -> None:
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(
        ["--model-path", str(minilm_dir), "--weight-cache-mode", "client"]
    )
    with pytest.raises(SystemExit, match="--weight-cache-mode client"):
        configure(server_args, {"socket": "/tmp/d.sock"}, {})


RANK_SCRIPT = r"""
import json, sys
import torch.distributed as dist

rank, port = int(sys.argv[1]), sys.argv[2]
free_gib, preloaded = float(sys.argv[3]), int(sys.argv[4])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.plugins import load_plugins

from weightcache.integrations.sglang import kv
from weightcache.integrations.sglang.loader import WeightcacheModelLoader

load_plugins()  # what every SGLang process does: registers and applies our hooks
# SGLang's own pre-load sample, MIN'd over the ranks, as measure_pre_model_load_memory
# returns it; our hook keeps this rank's own sample beside it.
import torch
mins = torch.tensor([free_gib]); dist.all_reduce(mins, op=dist.ReduceOp.MIN)
kv.record_sample(kv.LocalSample(free_gib, dist.group.WORLD))
runner = object.__new__(ModelRunner)  # its accounting method is SGLang's (hooked)
runner.loader = object.__new__(WeightcacheModelLoader)
runner.pre_model_load_memory = float(mins.item())
runner.account_preloaded_weights(preloaded)  # what SGLang's scheduler calls
print(json.dumps(runner.pre_model_load_memory))
"""


def test_preloaded_bytes_go_in_rank_local_before_the_min() -> None:
    """Two real ranks (gloo) holding different bytes: each must size its KV pool from
    MIN(own sample + own bytes). SGLang's own order (bytes added after the MIN) gives
    rank 0 12 GiB and rank 1 10.5 GiB, so this fails without the adapter's hook."""
    import subprocess
    import sys

    from tests.unit.wc_harness import free_port

    port = str(free_port())
    ranks = [(10.0, 2 * GiB), (11.0, GiB // 2)]  # rank 0 holds a draft, rank 1 does not
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(rank), port, str(free), str(held)],
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for rank, (free, held) in enumerate(ranks)
    ]
    baselines = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert baselines == [11.5, 11.5]  # min(10 + 2, 11 + 0.5) on both ranks


def test_weight_mutating_apis_are_refused_at_sglangs_tokenizer_manager() -> None:
    """SGLang's own hook registry wraps every weight-mutating API of its tokenizer manager
    (the HTTP server's and sgl.Engine's way in); with weightcache selected each is answered
    with the refusal before SGLang sees it, without it SGLang's own method runs.
    tests/engines/test_sglang_server.py calls each over HTTP on a real server."""
    import asyncio
    from types import SimpleNamespace

    from sglang.srt.managers.tokenizer_control_mixin import TokenizerControlMixin
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    from weightcache.integrations.sglang import mutations

    load_plugins()
    selected = SimpleNamespace(
        server_args=SimpleNamespace(model_loader_extra_config='{"weightcache": {}}')
    )
    unselected = SimpleNamespace(server_args=SimpleNamespace(model_loader_extra_config="{}"))
    for target in mutations.UPDATE_APIS:
        cls = TokenizerManager if ".TokenizerManager." in target else TokenizerControlMixin
        api = target.rsplit(".", 1)[1]
        method = getattr(cls, api)
        assert hasattr(method, "__wrapped__"), target  # hooked by SGLang's registry
        answer = asyncio.run(method(selected, SimpleNamespace(tags=None), None))
        assert answer[0] is False and answer[1] == mutations.refusal(api), target
        with pytest.raises(AttributeError):  # SGLang's own method, on a stand-in manager
            asyncio.run(method(unselected, SimpleNamespace(), None))
    for target in mutations.MEMORY_APIS:
        method = getattr(TokenizerControlMixin, target.rsplit(".", 1)[1])
        with pytest.raises(mutations.WeightMutationRefused):
            asyncio.run(method(selected, SimpleNamespace(tags=["weights"]), None))
    check = TokenizerControlMixin.check_weights
    answer = asyncio.run(check(selected, SimpleNamespace(action="reset_tensors"), None))
    assert answer[0] is False and "reset_tensors is refused" in answer[1]
    with pytest.raises(AttributeError):  # a reading action reaches SGLang's own method
        asyncio.run(check(selected, SimpleNamespace(action="checksum"), None))


def test_a_draft_model_loads_from_disk_unless_it_has_a_cache_of_its_own(
    memfd_daemon, minilm_dir, caplog
) -> None:
    """A speculative draft is not the cache's model: without draft_socket/draft_cache it
    loads from disk with a log line, even with fallback off and no target daemon; with
    one it attaches there; a configured one that is unusable fails."""
    import logging

    from weightcache.integrations.loading import DaemonUnavailable

    draft = ModelConfig(model_path=str(minilm_dir), dtype="float32", is_draft_model=True)
    absent = "/tmp/wc-no-daemon-here/cpu.sock"
    with caplog.at_level(logging.INFO, logger="weightcache"):
        loader = loader_for({"socket": absent, "fallback": False, "wait_ready_s": 0})
        assert loader.attachment(draft, CPU).attached is None
        assert loader.preloaded_weights_bytes == 0
    assert f"the draft model {minilm_dir} loads from disk" in caplog.text

    own = loader_for({"socket": absent, "draft_socket": memfd_daemon.socket})
    assert own.attachment(draft, CPU).attached.transport == "memfd"
    assert own.preloaded_weights_bytes == memfd_daemon.status().preloaded_weights_bytes

    unusable = loader_for({"socket": absent, "draft_socket": absent, "wait_ready_s": 0})
    with pytest.raises(DaemonUnavailable, match="fallback is off"):
        unusable.attachment(draft, CPU)


# --------------------------------------------------------------------------- SGLang's own layout


def assert_mapped_whole(result: dict) -> None:
    """One rank's load (sglang_layout_kit.outcome): bit-equal to SGLang's own, and every
    parameter the daemon's memory, read from its own storage."""
    assert result["layout"] is not None, result["reason"]
    assert result["names"] == result["cold_names"] and result["names"]
    assert result["differ"] == []
    assert result["outside"] == [] and result["reported"] == {}
    assert result["mapped_bytes"] == result["reported_mapped_bytes"] == result["total_bytes"]
    assert result["reported_copied_bytes"] == 0
    # SGLang's scheduler adds back what its pre-load sample missed: the layout's bytes,
    # less what the daemon's build and checkpoint-layout drop changed after the sample
    # (on this, the layout's first start: the checkpoint layout's bytes instead).
    assert result["layout_bytes"] >= result["total_bytes"]
    assert result["preloaded"] == result["layout_bytes"] - result["daemon_bytes_change"] > 0


def own_layout_daemons(session_daemons, model_dirs: dict, tp: int) -> dict:
    """One daemon per (model, rank), each serving <its workdir>/tests.tiny/cpu.sock."""
    from tests.engines.sglang_layout_kit import CACHE

    shard = ("--tp-size", str(tp), "--shard-plan", "llama") if tp > 1 else ()
    return {
        (kind, rank): session_daemons(
            model_dir, "--transport", "memfd", *shard,
            *(("--tp-rank", str(rank)) if tp > 1 else ()), socket_name=f"{CACHE}/cpu.sock",
        )  # fmt: skip
        for kind, model_dir in model_dirs.items()
        for rank in range(tp)
    }


def load_in_ranks(session_daemons, model_dirs: dict, dtype: str, tp: int, workdir: Path):
    """Each model through our loader and SGLang's own, in ``tp`` rank processes joined by
    SGLang's own process groups (gloo)."""
    from tests.engines.enginekit import run_ranks

    daemons = own_layout_daemons(session_daemons, model_dirs, tp)
    jobs = [
        [f"{kind}={model_dir}={dtype}={daemons[kind, rank].workdir}"
         for kind, model_dir in model_dirs.items()]
        for rank in range(tp)
    ]  # fmt: skip
    try:
        return run_ranks("tests.engines.sglang_layout_kit", jobs, workdir)
    finally:
        for daemon in daemons.values():
            daemon.terminate()


def test_load_model_maps_sglangs_own_layout_of_bert_bit_equal_to_a_cold_load(
    session_daemons, minilm_dir, tmp_path
) -> None:
    """SGLang's BertModel (MiniLM) through our loader: SGLang's load_weights and
    post-processing traced on meta become a plan, the daemon builds that layout (fused
    qkv_proj, padded vocabulary), and every parameter is the daemon's memory, none
    copied (the checkpoint layout copied 64 % of the bytes), bit-equal to SGLang's
    DefaultModelLoader."""
    ((result,),) = load_in_ranks(session_daemons, {"bert": minilm_dir}, "float32", 1, tmp_path)
    assert_mapped_whole(result)
    fused = [n for n in result["names"] if n.endswith("qkv_proj.weight")]
    assert len(fused) == 6
    (words,) = [n for n in result["shapes"] if n.endswith("embeddings.word_embeddings.weight")]
    assert result["shapes"][words][0] > 30522  # padded


def test_a_fused_parameter_the_checkpoint_fills_in_part_is_loaded_by_sglangs_own_loader(
    session_daemons, tiny_dirs, tmp_path
) -> None:
    """A checkpoint without layer 1's up_proj (issue 41, item 7): SGLang's loading writes
    the gate half of that layer's gate_up_proj only, and the daemon's layout would hold
    zeros in the other. The trace counts the bytes nothing writes, so SGLang's own loader
    loads the model from disk as on a cold start (0 preloaded bytes, the daemon never
    asked), with one WARNING naming gate_up_proj and those bytes."""
    from tests.engines.enginekit import (
        HALF_FILLED,
        HALF_FILLED_WHY,
        fetches,
        run_ranks,
        without_up_proj,
    )

    fused, why = HALF_FILLED, HALF_FILLED_WHY
    model_dir = without_up_proj(tiny_dirs["llama"], tmp_path / "no-up")
    daemon = own_layout_daemons(session_daemons, {"llama": model_dir}, 1)["llama", 0]
    try:
        ((result,),) = run_ranks("tests.engines.sglang_layout_kit",
                                 [[f"llama={model_dir}=bfloat16={daemon.workdir}"]], tmp_path)
        fetched = fetches(daemon, "fetch_layout"), fetches(daemon, "fetch_state")
    finally:
        daemon.terminate()
    assert result["layout"] is None and result["reason"] == why
    assert result["preloaded"] == 0
    assert fetched == (0, 0)  # the daemon was never asked
    assert result["warnings"] == [
        f"weightcache: the engine's default loader loads the model from disk: {why}"
    ]
    # SGLang's own model: the half nothing writes is whatever SGLang allocated, on both
    # sides; all else equals its cold load.
    assert result["names"] == result["cold_names"] and fused in result["names"]
    assert set(result["differ"]) <= {fused}


@pytest.fixture(scope="module")
def tiny_loads(session_daemons, tiny_dirs, tmp_path_factory):
    """The tiny models loaded both ways in rank processes, once per TP size for the module
    (``sglang_layout_kit``: at TP 1 with SGLang's KV sizing of each, ``kv_outcome``)."""
    loads: dict[int, list] = {}

    def at(tp: int) -> list:
        if tp not in loads:
            workdir = tmp_path_factory.mktemp(f"tp{tp}")
            loads[tp] = load_in_ranks(session_daemons, tiny_dirs, "bfloat16", tp, workdir)
        return loads[tp]

    return at


@pytest.mark.parametrize("tp", [1, 2])
def test_llama_qwen2_and_moe_classes_map_sglangs_own_layout_at_tp(
    tp, tiny_dirs, tiny_loads
) -> None:
    """SGLang's own LlamaForCausalLM, Qwen2ForCausalLM (q/k/v biases, tied embeddings),
    MixtralForCausalLM and Qwen2MoeForCausalLM (experts stacked into w13/w2), tiny bf16
    configs with random weights: at TP 1 and at TP 2 (two rank processes, a daemon per
    rank holding its shard, SGLang's loaders sharding fused and stacked parameters), every
    parameter of every rank is the daemon's memory and equals SGLang's own load."""
    from tests.engines.tiny_models import EXPERTS, VOCAB

    results = tiny_loads(tp)
    assert len(results) == tp
    for rank_results in results:
        assert [r["kind"] for r in rank_results] == list(tiny_dirs)
        for result in rank_results:
            assert_mapped_whole(result)
            shapes = result["shapes"]
            assert any(n.endswith("qkv_proj.weight") for n in shapes)
            assert shapes["model.embed_tokens.weight"][0] * tp >= VOCAB
            if result["kind"] in ("mixtral", "qwen2_moe"):
                stacked = [n for n in shapes if n.endswith(("w13_weight", "w2_weight"))]
                assert len(stacked) == 4 and all(shapes[n][0] == EXPERTS for n in stacked)
            if result["kind"] in ("qwen2", "qwen2_moe"):
                assert any(n.endswith("qkv_proj.bias") for n in shapes)
    if tp == 2:  # each rank its own shard: its own plan
        assert all(a["layout"] != b["layout"] for a, b in zip(*results, strict=True))


def test_sglangs_default_loader_refuses_our_load_config_and_takes_the_lora_one() -> None:
    """SGLang reads a LoRA adapter's files with a DefaultModelLoader built from the model's
    load config, which with weightcache names our loader and our extra config:
    DefaultModelLoader refuses that by name, so without the plugin's hook (sglang/lora.py)
    no adapter loads. The config the hook gives the adapter is one it takes; the hook at
    work, through SGLang's registry, is the next test's adapter load."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    from weightcache.integrations.sglang.loader import default_load_config

    ours = LoadConfig(load_format=WeightcacheModelLoader,
                      model_loader_extra_config={"weightcache": {"socket": "/tmp/d.sock"}})
    with pytest.raises(ValueError, match="Unexpected extra config keys"):
        DefaultModelLoader(ours)
    assert type(DefaultModelLoader(default_load_config(ours))) is DefaultModelLoader
    assert ours.load_format is WeightcacheModelLoader  # the model's own config untouched


def test_lora_wraps_the_mapped_layers_and_writes_none_of_their_weights(
    session_daemons, tiny_dirs, tmp_path
) -> None:
    """SGLang's LoRA on the tiny Llama mapped from the daemon (sglang_lora_kit: a rank
    process with ``--lora-paths``, the ``torch_native`` backend): SGLang's LoRAManager
    wraps q/k/v (its fused ``qkv_proj``) of both layers around the very layers loaded,
    loads a PEFT adapter of q_proj and v_proj from disk (through weightcache's hook: SGLang
    reads it with the model's load config, sglang/lora.py) and moves it into its LoRA
    memory pool for a batch, and the wrapped layer runs forward with it. Every base
    parameter is still the daemon's memory, byte for byte; the adapter lives in the pool's
    own buffers."""
    from tests.engines.enginekit import run_ranks, write_lora
    from tests.engines.tiny_models import HEADS, KV_HEADS, H

    daemons = own_layout_daemons(session_daemons, {"llama": tiny_dirs["llama"]}, 1)
    adapter = write_lora(tmp_path / "adapter", tiny_dirs["llama"], ("q_proj", "v_proj"))
    job = f"{tiny_dirs['llama']}={daemons['llama', 0].workdir}={adapter}"
    try:
        (result,) = run_ranks("tests.engines.sglang_lora_kit", [[job]], tmp_path)
    finally:
        for daemon in daemons.values():
            daemon.terminate()
    assert result["backend"] == "torch_native" and len(result["adapters"]) == 1
    layers = [f"model.layers.{i}.self_attn.qkv_proj" for i in range(2)]
    assert result["wrapped"] == layers and result["same_base_layer"] == layers
    assert result["mapped_before"] == sorted(result["names"])  # all of them, as loaded
    assert result["mapped_after"] == result["mapped_before"]
    assert result["changed"] == [] and result["still_parameters"]
    assert result["adapter_buffers"] and result["empty_buffers"] == []
    assert result["buffers_in_daemon"] == []
    # Run forward by SGLang's torch_native LoRA backend: the adapter changes exactly the
    # q and v columns of qkv_proj's output (k is not a target), over the mapped weight.
    q, kv = H, KV_HEADS * H // HEADS
    assert result["out_size"] == q + 2 * kv
    assert result["forward_changed_columns"] == [*range(q), *range(q + kv, q + 2 * kv)]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mixtral", "qwen2_moe"])
def test_kv_pool_on_sglangs_own_layout_equals_a_cold_starts(kind, tiny_loads) -> None:
    """SGLang's own KV pool sizing, on the memory figures a GPU would report (synthetic:
    tests/engines/kv_kit.py patches them in at torch's CUDA memory queries; no GPU here),
    in its scheduler's order: the pre-load sample (``measure_pre_model_load_memory``), the
    load, ``account_preloaded_weights`` of the loader's bytes, the pool configurator
    (``_profile_available_bytes``, ``_resolve_memory_pool_config``: KV bytes and tokens).
    Cold: SGLang's DefaultModelLoader, the engine allocating its weights. With weightcache:
    our loader against a real daemon holding SGLang's own layout, on the layout's first
    start (built after the sample, the checkpoint layout dropped) and on a restart (a second
    start: the layout held). Both equal a cold start's but for allocation rounding."""
    from tests.engines.tiny_models import CONFIGS, HEADS, KV_HEADS, LAYERS, H

    ((result,),) = [[r for r in rank if r["kind"] == kind] for rank in tiny_loads(1)]
    kv = result["kv"]
    # The layout is the engine's weights: a cold load's parameters, allocated by the daemon
    # (256-byte steps, memfd), none by the engine.
    assert [tuple(p) for p in kv["planned"]] == [tuple(p) for p in kv["cold_params"]]
    assert kv["layout_bytes"] == kv["layout_bytes_of_cold"] == kv["daemon_before_restart"]
    assert kv["engine_own"] == 0

    cold, difference = kv["cold"], kv["rounding_difference"]
    assert 0 <= difference <= 256 * kv["parameters"]
    per_token = 2 * LAYERS * KV_HEADS * (H // HEADS) * 2  # K and V, bfloat16
    assert CONFIGS[kind]["torch_dtype"] == "bfloat16"
    for start in ("first_start", "restart"):
        warm = kv[start]
        # SGLang's baseline (GiB, a float) is a cold start's; its KV budget the cold one's
        # plus the rounding difference (to a byte: SGLang truncates GiB floats to bytes).
        assert warm["pre_model_load_gib"] == pytest.approx(cold["pre_model_load_gib"], abs=1e-12)
        assert abs(warm["available_bytes"] - cold["available_bytes"] - difference) <= 1, start
        tokens = warm["max_total_num_tokens"] - cold["max_total_num_tokens"]
        assert difference // per_token <= tokens <= -(-difference // per_token), start
    print(f"{kind}: cold {cold}, first start {kv['first_start']}, restart {kv['restart']}, "
          f"difference {difference} B, layout {kv['layout_bytes']} B, checkpoint layout "
          f"{kv['daemon_before_first']} B, sizing {kv['seconds']:.1f} s")  # fmt: skip
    # The daemon's checkpoint layout (fused, stacked and padded tensors apart) held other
    # bytes: what SGLang's sample saw on the first start, what the loader adds back then.
    assert kv["daemon_before_first"] != kv["layout_bytes"] == kv["daemon_after_first"]
    assert kv["preloaded_first"] == kv["daemon_before_first"]
    assert kv["preloaded_restart"] == kv["layout_bytes"]
    # Had the loader reported the checkpoint layout's bytes or nothing, SGLang would size
    # another pool.
    for wrong in ("reporting_checkpoint_layout", "reporting_nothing"):
        assert abs(kv[wrong]["available_bytes"] - cold["available_bytes"] - difference) > 1
