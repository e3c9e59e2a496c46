"""weightcache.integrations.trace: an engine's own loading, traced on meta, becomes a plan
whose plain execution equals that loading run for real, byte for byte.

The engine here is a toy of our own in vLLM's manner (fused qkv with biases and
gate_up, stacked MoE experts, a padded vocabulary tied to lm_head, tensor
parallel narrowing, dtype casts), plus Hugging Face transformers' own model
classes loaded by torch's ``load_state_dict``. The real engines' loaders are
traced in their own venvs (tests/engines/).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.unit.plankit import reference_params, same_bits
from tests.unit.toyengine import (
    EXPERTS,
    HEAD,
    HEADS_KV,
    HEADS_Q,
    INTER,
    VOCAB,
    H,
    ToyEngine,
    checkpoint,
    meta_model,
    real_load,
    sources,
)
from weightcache.client import meta_parameters
from weightcache.integrations.trace import trace_load
from weightcache.plan import check_plan


def assert_plan_equals_engine(report, tensors, engine_params) -> None:
    built = reference_params(report.plan, tensors)
    assert sorted(built) == sorted(engine_params)
    different = [n for n in built if not same_bits(built[n], engine_params[n])]
    assert different == []


@pytest.mark.parametrize("style", ["narrow", "cat", "cast"])
@pytest.mark.parametrize(("rank", "size"), [(0, 1), (0, 2), (1, 2)])
def test_the_plan_of_a_fused_loader_rebuilds_its_parameters_bit_for_bit(style, rank, size):
    tensors = checkpoint()
    kw = dict(tp_rank=rank, tp_size=size, style=style)
    traced = meta_model(**kw)
    report = trace_load(traced, sources(tensors), traced.load_weights)
    assert report.copied == {} and report.unwritten == [] and report.incomplete == {}
    assert report.unread == ["model.layers.0.self_attn.rotary_emb.inv_freq",
                             "model.layers.1.self_attn.rotary_emb.inv_freq"]  # fmt: skip
    assert report.planned_bytes == sum(report.param_bytes.values())
    check_plan(report.plan, sources(tensors))
    assert {p.name: p.aliases for p in report.plan.params}["embed"] == ["lm_head"]
    assert_plan_equals_engine(report, tensors, real_load(ToyEngine(**kw), tensors))
    if style == "cast":
        assert {tuple(c.casts) for c in report.plan.copies} == {(), ("float16",)}
    if (rank, size) == (1, 2):
        # Rank 1's vocabulary rows 16..29 and 2 padding rows: a fill, zeros in the plan.
        assert [(f.param, f.dst.offset, f.dst.shape) for f in report.plan.fills] == [
            ("embed", 14 * H, [2, H])
        ]


def test_a_fused_parameter_missing_a_piece_is_incomplete_by_the_bytes_nothing_writes() -> None:
    """A checkpoint without one expert's w3 (the up half of its slice of w13) and one
    layer's k_proj: those parameters are planned from the pieces there are, and reported
    with the bytes no copy writes; everything else is whole. Padding written by a fill is
    written (the padded vocabulary of rank 1 of 2); left unwritten, it is reported too."""
    tensors = checkpoint(layers=1)
    del tensors["model.layers.0.mlp.experts.1.w3.weight"]
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    traced = meta_model(layers=1)
    report = trace_load(traced, sources(tensors), traced.load_weights)
    assert report.copied == {} and report.unwritten == []
    assert report.incomplete == {
        "layers.0.w13": INTER * H * 2,  # one expert's up half, bf16
        "layers.0.qkv_weight": HEADS_KV * HEAD * H * 2,  # the k rows
    }
    assert report.param_bytes["layers.0.w13"] == EXPERTS * 2 * INTER * H * 2
    assert "layers.0.w13" in report.planned  # the daemon would build it, zeros in the gaps

    padded = meta_model(layers=1, tp_rank=1, tp_size=2)
    whole = checkpoint(layers=1)
    report = trace_load(padded, sources(whole), padded.load_weights)
    assert [f.param for f in report.plan.fills] == ["embed"] and report.incomplete == {}

    class PaddingLeftAlone(ToyEngine):
        def load_weights(self, weights):
            rest = []
            for name, w in weights:
                if name == "model.embed_tokens.weight":  # no fill_ of the padding rows
                    start = self.rank * self.rows
                    n = max(0, min(self.rows, VOCAB - start))
                    self.embed.data[:n].copy_(w[start : start + n])
                else:
                    rest.append((name, w))
            super().load_weights(iter(rest))

    with meta_parameters():
        unpadded = PaddingLeftAlone(layers=1, tp_rank=1, tp_size=2)
    report = trace_load(unpadded, sources(whole), unpadded.load_weights)
    assert report.incomplete == {"embed": 2 * H * 2}  # rows 30, 31 of 32: padding


def test_what_the_loader_computes_is_reported_as_copied_by_name() -> None:
    tensors = checkpoint(layers=1)

    class Computing(ToyEngine):
        def load_weights(self, weights):
            rest = []
            for name, w in weights:
                layer = self.layers[0]
                if name.endswith("o_proj.weight"):
                    layer.o_proj.data.copy_(w * 2)  # arithmetic
                elif name.endswith("input_layernorm.weight"):
                    layer.norm.data.copy_(torch.ones(H))  # not from the checkpoint
                elif name.endswith("gate.weight"):
                    w.mul_(1)  # the loaded tensor modified in place
                    layer.router.data.copy_(w)
                elif name == "model.norm.weight":
                    self.norm.data.copy_(w)
                    self.norm.data[:4].copy_(w[:4])  # written twice
                else:
                    rest.append((name, w))
            super().load_weights(iter(rest))

    with meta_parameters():
        traced = Computing(layers=1)
    report = trace_load(traced, sources(tensors), traced.load_weights)
    assert report.copied == {
        "layers.0.o_proj": "computed from checkpoint data by aten.mul.Tensor",
        "layers.0.norm": "written from a tensor not read from the checkpoint",
        "layers.0.router": "the checkpoint tensor was modified in place (aten.mul_.Tensor)",
        "norm": report.copied["norm"],
    }
    assert report.copied["norm"].startswith("its writes do not form a plan: copy ")
    assert "overlaps copy" in report.copied["norm"]
    assert report.copied_bytes == (H * HEADS_Q * HEAD + 2 * H + EXPERTS * H) * 2
    # Everything else is still planned, and still equal to the engine's own load.
    real = real_load(Computing(layers=1), tensors)
    built = reference_params(report.plan, tensors)
    assert [n for n in built if not same_bits(built[n], real[n])] == []
    assert len(built) == len(real) - 4


def test_post_processing_must_leave_parameters_alone() -> None:
    tensors = checkpoint(layers=1)

    def traced_with(post):
        model = meta_model(layers=1)
        return trace_load(model, sources(tensors), model.load_weights,
                          post_process=lambda: post(model))  # fmt: skip

    def harmless(model):  # reads, and sets attributes, as engines do
        model.layers[0].scale = model.layers[0].norm.shape[0] ** -0.5
        model.layers[0].extra = torch.zeros(3)  # a real tensor it creates

    report = traced_with(harmless)
    assert report.copied == {} and report.post_processed == {} and report.post_error is None

    def copies_onto_itself(model):  # vLLM's MoE "padding" without padding: torch's copy_
        model.norm.data.copy_(model.norm.data)  # of a tensor onto itself writes nothing

    assert traced_with(copies_onto_itself).post_processed == {}

    def transposes(model):
        layer = model.layers[0]
        layer.o_proj = nn.Parameter(layer.o_proj.t().contiguous(), requires_grad=False)

    def scales(model):
        model.norm.data.mul_(2)

    def needs_values(model):
        if model.norm.sum() > 0:  # cannot run on meta
            pass

    transposed = traced_with(transposes)
    assert transposed.copied == {}  # loading is planned; the engine then holds its own
    assert transposed.post_processed == {
        "layers.0.o_proj": ("replaces", "replaced by post-processing")
    }
    assert traced_with(scales).post_processed == {
        "norm": ("writes", "post-processing writes it (aten.mul_.Tensor)")
    }
    assert traced_with(scales).copied_bytes == H * 2
    failed = traced_with(needs_values)
    assert failed.post_error is not None and "meta" in failed.post_error


# Engine kernels with a CPU implementation and none for meta, as vLLM's CPU build registers
# its weight repacking (`_C::prepack_moe_weight(Tensor weight, Tensor(a!) packed, str isa)`).
_KERNELS = torch.library.Library("wc_trace_test", "DEF")
_KERNELS.define("repack(Tensor weight, Tensor(a!) packed) -> ()")
_KERNELS.define("scaled(Tensor weight) -> Tensor")
_KERNELS.impl("repack", lambda weight, packed: packed.copy_(weight.flip(0)), "CPU")
_KERNELS.impl("scaled", lambda weight: weight * 2, "CPU")


def test_a_post_processing_kernel_without_meta_support_is_followed_by_what_it_writes() -> None:
    """One that returns nothing and declares what it writes is followed as writing that
    (the parameters it ends up in are reported); any other stays a post_error, and during
    loading nothing is assumed."""
    tensors = checkpoint(layers=1)
    repack, scaled = torch.ops.wc_trace_test.repack, torch.ops.wc_trace_test.scaled

    def traced_with(post, load=None):
        model = meta_model(layers=1)
        return trace_load(model, sources(tensors), load or model.load_weights,
                          post_process=lambda: post(model))  # fmt: skip

    def repacks_into_a_new_parameter(model):
        layer = model.layers[0]
        packed = torch.empty_like(layer.o_proj)
        repack(layer.o_proj, packed)
        layer.o_proj = nn.Parameter(packed, requires_grad=False)

    def repacks_in_place(model):
        repack(model.norm.clone(), model.norm)

    replaced = traced_with(repacks_into_a_new_parameter)
    assert replaced.post_error is None and replaced.copied == {}
    assert replaced.post_processed == {
        "layers.0.o_proj": ("replaces", "replaced by post-processing")
    }
    in_place = traced_with(repacks_in_place)
    assert in_place.post_error is None
    assert in_place.post_processed == {
        "norm": ("writes", "post-processing writes it (wc_trace_test.repack.default)")
    }
    computed = traced_with(lambda model: scaled(model.norm))  # its result's shape is unknown
    assert computed.post_error is not None and "wc_trace_test::scaled" in computed.post_error

    def loads_through_the_kernel(model):
        def load(weights):
            for name, t in weights:
                if name == "model.norm.weight":
                    repack(t, model.norm)

        return load

    model = meta_model(layers=1)
    with pytest.raises(NotImplementedError, match="wc_trace_test::repack"):
        trace_load(model, sources(tensors), loads_through_the_kernel(model))


def test_a_stacked_and_transposed_loader_is_followed() -> None:
    """Experts stacked with torch.stack, then copied transposed into a [E, in, out] param."""
    tensors = checkpoint(layers=1)

    class Stacking(ToyEngine):
        def __init__(self):
            super().__init__(layers=1)
            self.layers[0].w2 = nn.Parameter(torch.empty(EXPERTS, INTER, H, dtype=torch.bfloat16),
                                             requires_grad=False)  # fmt: skip

        def load_weights(self, weights):
            rest, w2 = [], {}
            for name, w in weights:
                if name.endswith("w2.weight"):
                    w2[int(name.split(".")[5])] = w
                else:
                    rest.append((name, w))
            stacked = torch.stack([w2[e] for e in range(EXPERTS)])  # [E, H, INTER]
            self.layers[0].w2.data.copy_(stacked.transpose(1, 2))
            super().load_weights(iter(rest))

    with meta_parameters():
        traced = Stacking()
    report = trace_load(traced, sources(tensors), traced.load_weights)
    assert report.copied == {}
    w2 = [c for c in report.plan.copies if c.param == "layers.0.w2"]
    assert len(w2) == EXPERTS and all(c.src.stride[1:] == [1, INTER] for c in w2)
    assert_plan_equals_engine(report, tensors, real_load(Stacking(), tensors))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_transformers_models_loaded_by_load_state_dict(arch) -> None:
    """Hugging Face model classes (tied embeddings for qwen2) through torch's own loader."""
    import transformers  # a test dependency (pyproject's test extra)
    if arch == "llama":
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, vocab_size=50)  # fmt: skip
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.Qwen2Config(hidden_size=32, intermediate_size=48,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, vocab_size=50,
                                          tie_word_embeddings=True)  # fmt: skip
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    state = {k: v.to(torch.float16) for k, v in cls(config).state_dict().items()
             if not k.startswith("lm_head") or not config.tie_word_embeddings}  # fmt: skip
    engine = cls(config).to(torch.bfloat16)
    engine.load_state_dict(state, strict=False)
    with meta_parameters():
        traced = cls(config).to(torch.bfloat16)
    report = trace_load(
        traced, sources(state), lambda weights: traced.load_state_dict(dict(weights), strict=False)
    )
    assert report.copied == {} and report.unwritten == []
    names = {n for p in report.plan.params for n in (p.name, *p.aliases)}
    if config.tie_word_embeddings:
        assert "lm_head.weight" in names  # an alias of the embedding
    params = dict(engine.named_parameters(remove_duplicate=False))
    assert_plan_equals_engine(report, state, params)


# A process-wide module cache in vLLM's manner (its get_rope): one rotary module per
# configuration, handed to every model built afterwards, the throwaway traced one included.
_ROTARY_CACHE: dict[int, nn.Module] = {}


class _Rotary(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.arange(dim, dtype=torch.float32),
                             persistent=False)  # fmt: skip


def _rotary(dim: int) -> nn.Module:
    if dim not in _ROTARY_CACHE:
        _ROTARY_CACHE[dim] = _Rotary(dim)
    return _ROTARY_CACHE[dim]


class _WithRotary(ToyEngine):
    def __init__(self) -> None:
        super().__init__(layers=1)
        self.layers[0].rotary_emb = _rotary(HEAD)  # shared, as vLLM's cached rope is


def test_a_trace_leaves_every_module_of_the_traced_model_as_it_was() -> None:
    """The buffers go to meta only while the engine's code runs: a module the engine shares
    with the real model (vLLM's cached rotary embedding) keeps its real buffer, and
    post-processing's attributes, parameters and submodules are undone."""
    tensors = checkpoint(layers=1)
    _ROTARY_CACHE.clear()
    with meta_parameters():
        traced = _WithRotary()
    rotary = traced.layers[0].rotary_emb
    cache = rotary.cos_sin_cache
    before = {id(m): (dict(m.__dict__), dict(m._parameters), dict(m._buffers))
              for m in traced.modules()}  # fmt: skip

    def post():
        layer = traced.layers[0]
        layer.packed = nn.Parameter(torch.empty(3, device="meta"), requires_grad=False)
        layer.o_proj = nn.Parameter(layer.o_proj.t().contiguous(), requires_grad=False)
        layer.extra = nn.Linear(2, 2, device="meta")
        rotary.scale = 2.0

    report = trace_load(traced, sources(tensors), traced.load_weights, post_process=post)
    assert report.post_processed == {"layers.0.o_proj": ("replaces", "replaced by post-processing")}
    after = {id(m): (dict(m.__dict__), dict(m._parameters), dict(m._buffers))
             for m in traced.modules()}  # fmt: skip
    assert after == before
    assert rotary.cos_sin_cache is cache and not cache.is_meta
    assert torch.equal(cache, torch.arange(HEAD, dtype=torch.float32))
    with meta_parameters():
        real = _WithRotary()  # the cache hands it the same module: its buffer is real
    assert real.layers[0].rotary_emb is rotary and not rotary.cos_sin_cache.is_meta


def test_isolated_restores_the_process_state_building_a_model_changes() -> None:
    import random

    import numpy

    from weightcache.integrations.trace import isolated

    _ROTARY_CACHE.clear()
    kept = _rotary(2)
    torch.manual_seed(1), random.seed(1), numpy.random.seed(1)
    expected = (torch.rand(3), random.random(), numpy.random.rand())
    torch.manual_seed(1), random.seed(1), numpy.random.seed(1)
    with isolated(caches=[_ROTARY_CACHE]):
        torch.set_default_dtype(torch.float16)
        torch.set_grad_enabled(False)
        torch.rand(5), random.random(), numpy.random.rand(4)
        _rotary(HEAD)
        del _ROTARY_CACHE[2]
    drawn = (torch.rand(3), random.random(), numpy.random.rand())
    assert torch.equal(drawn[0], expected[0]) and drawn[1:] == expected[1:]
    assert torch.get_default_dtype() == torch.float32 and torch.is_grad_enabled()
    assert _ROTARY_CACHE == {2: kept}
