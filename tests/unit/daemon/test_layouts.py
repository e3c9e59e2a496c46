"""Engine layouts served by a real daemon over its real socket (CPU, memfd).

An engine traces its load plan (tests/unit/toyengine.py, vLLM-shaped), asks the
daemon for that layout and maps every parameter by name: bit-equal to the
engine's own load, every byte in the daemon's memory. The daemon refuses bad
plans by name and keeps serving; it drops the checkpoint layout once an engine
layout is built, and rebuilds it from disk for an engine that asks for it.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from tests.unit.plankit import reference_params, same_bits
from tests.unit.toyengine import (
    ToyEngine,
    checkpoint,
    meta_model,
    real_load,
    save_checkpoint,
    sources,
)
from tests.unit.wc_harness import exchange, frame, wait_until
from weightcache.checkpoint import cache_config, read_checkpoint
from weightcache.client import DaemonError, attach, attach_layout, check_params, ping
from weightcache.integrations.trace import trace_load
from weightcache.plan import Copy, plan_hash
from weightcache.protocol import (
    FetchLayoutRequest,
    FetchStateReply,
    ProtocolError,
    ShardSpec,
    decode_reply,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    tensors = checkpoint()
    return save_checkpoint(tmp_path_factory.mktemp("toy"), tensors), tensors


def plan_of(**kw):
    model = meta_model(**kw)
    return trace_load(model, sources(checkpoint()), model.load_weights).plan


def config_of(model_dir, **kw):
    return cache_config(read_checkpoint(model_dir), CPU, **kw)


def in_daemon_memory(attached, tensors) -> list[str]:
    spans = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in attached.allocations()]
    return [
        n for n, t in tensors.items()
        if any(lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.itemsize <= hi
               for lo, hi in spans)
    ]  # fmt: skip


def test_an_engine_maps_its_own_layout_zero_copy_and_others_get_it_by_hash(
    module_daemons, toy
) -> None:
    model_dir, tensors = toy
    daemon = module_daemons(model_dir, "--transport", "memfd")
    config, plan = config_of(model_dir), plan_of()
    attached = attach_layout(daemon.socket, config, plan, wait_ready=60)
    try:
        engine = real_load(ToyEngine(), tensors)
        assert sorted(attached.tensors) == sorted(engine)
        assert [n for n in engine if not same_bits(attached.tensors[n], engine[n])] == []
        # Every byte the engine uses is the daemon's: mapped, none copied.
        assert sorted(in_daemon_memory(attached, attached.tensors)) == sorted(engine)
        assert attached.config.plan == plan_hash(plan) and attached.transport == "memfd"
        status = daemon.status()
        # The checkpoint layout was dropped: no engine had mapped it.
        assert [(s.plan, s.state, s.source) for s in status.layouts] == [
            (plan_hash(plan), "ready", "resident")
        ]
        assert status.preloaded_weights_bytes == attached.preloaded_weights_bytes
        assert status.expected_bytes == sum(
            t.numel() * t.itemsize for n, t in engine.items() if n != "lm_head"
        )
        # Another engine asks by hash alone, and gets the same layout without sending a plan.
        request = FetchLayoutRequest(v=1, config=config, plan_hash=plan_hash(plan),
                                     transports=["memfd"])  # fmt: skip
        got = exchange(daemon.socket, frame(request), timeout=10)
        reply = decode_reply(got.replies[0])
        assert isinstance(reply, FetchStateReply) and reply.status == "ok"
        assert reply.config == attached.config and reply.layout is not None
    finally:
        attached.close()


def test_tp_ranks_build_from_their_shard_daemons(module_daemons, toy) -> None:
    model_dir, tensors = toy
    for rank in (0, 1):
        shard = ShardSpec(2, rank, "llama")
        daemon = module_daemons(model_dir, "--transport", "memfd", "--tp-size", "2",
                                "--tp-rank", str(rank), "--shard-plan", "llama")  # fmt: skip
        plan = plan_of(tp_rank=rank, tp_size=2)
        attached = attach_layout(daemon.socket, config_of(model_dir, shard=shard), plan,
                                 wait_ready=60)  # fmt: skip
        try:
            engine = real_load(ToyEngine(tp_rank=rank, tp_size=2), tensors)
            assert [n for n in engine if not same_bits(attached.tensors[n], engine[n])] == []
            [layout] = daemon.status().layouts
            # Rank 0's padded vocabulary needs a row the even split gave rank 1: from disk.
            assert layout.source == ("resident+disk" if rank == 0 else "resident")
        finally:
            attached.close()


def refusal(socket, config, plan, key=None, transports=("memfd",)) -> FetchStateReply:
    request = FetchLayoutRequest(v=1, config=config, plan_hash=key or plan_hash(plan),
                                 transports=list(transports), plan=plan)  # fmt: skip
    reply = decode_reply(exchange(socket, frame(request), timeout=10).replies[0])
    assert isinstance(reply, FetchStateReply)
    return reply


def test_bad_plans_are_refused_by_name_and_the_daemon_keeps_serving(daemons, toy) -> None:
    model_dir, _ = toy
    daemon = daemons(model_dir, "--transport", "memfd", "--max-layouts", "1")
    config, plan = config_of(model_dir), plan_of()
    first = plan.copies[0]

    def with_copy(copy: Copy):
        return msgspec.structs.replace(plan, copies=[copy, *plan.copies[1:]])

    cases = {
        "the checkpoint has no tensor 'nope'": with_copy(
            msgspec.structs.replace(first, source="nope")),
        "source region reaches element": with_copy(msgspec.structs.replace(
            first, src=msgspec.structs.replace(first.src, offset=10**6))),
        "overlaps": msgspec.structs.replace(plan, copies=[*plan.copies, first]),
    }  # fmt: skip
    for message, bad in cases.items():
        reply = refusal(daemon.socket, config, bad)
        assert reply.status == "error" and not reply.retryable
        assert f"refused plan {plan_hash(bad)[:12]}: " in reply.error and message in reply.error
    reply = refusal(daemon.socket, config, plan, key="0" * 64)
    assert reply.error == f"the plan hashes to {plan_hash(plan)}, not {'0' * 64}"
    # An engine cannot pass its own plan off under the hash another engine asks for.
    other = plan_of(style="cast")
    reply = refusal(daemon.socket, config, other, key=plan_hash(plan))
    assert reply.error == f"the plan hashes to {plan_hash(other)}, not {plan_hash(plan)}"
    reply = refusal(daemon.socket, config, plan, transports=["vmm_fd"])
    assert reply.status == "error" and "this daemon serves memfd" in reply.error
    mismatch = refusal(daemon.socket, config_of(model_dir, revision="r2"), plan)
    assert mismatch.status == "mismatch" and mismatch.mismatched_fields == ["model.revision"]
    # Still serving: a good plan builds, and then a second one is over --max-layouts 1.
    assert ping(daemon.socket) == daemon.pid
    attached = attach_layout(daemon.socket, config, plan, wait_ready=60)
    attached.close()
    reply = refusal(daemon.socket, config, plan_of(style="cast"))
    assert "already holds or builds 1 engine layout(s), its limit (--max-layouts 1)" in (
        reply.error
    )
    with pytest.raises(DaemonError, match="already holds or builds 1 engine layout"):
        attach_layout(daemon.socket, config, plan_of(style="cast"), wait_ready=5)


def test_the_checkpoint_layout_is_dropped_then_rebuilt_for_an_engine_that_asks(
    daemons, toy
) -> None:
    model_dir, tensors = toy
    daemon = daemons(model_dir, "--transport", "memfd")
    config = config_of(model_dir)
    layout = attach_layout(daemon.socket, config, plan_of(), wait_ready=60)
    assert [s.plan for s in daemon.status().layouts] == [plan_hash(plan_of())]
    # An engine of the checkpoint layout (an older adapter, a tool): rebuilt from disk.
    whole = attach(daemon.socket, config, ["memfd"], wait_ready=60)
    try:
        assert all(torch.equal(whole.tensors[n], t) for n, t in tensors.items())
        status = daemon.status()
        assert sorted((s.plan is None, s.state) for s in status.layouts) == [
            (False, "ready"), (True, "ready")
        ]  # fmt: skip
        assert status.preloaded_weights_bytes == sum(s.bytes for s in status.layouts)
        # A loader that concatenates q, k, v first writes the same regions: the same plan.
        assert plan_hash(plan_of(style="cat")) == plan_hash(plan_of())
        # It served an engine, so building another engine layout keeps it.
        second = attach_layout(daemon.socket, config, plan_of(style="cast"), wait_ready=60)
        second.close()
        assert sorted(s.plan is None for s in daemon.status().layouts) == [False, False, True]
    finally:
        whole.close()
        layout.close()


def test_keep_checkpoint_layout_keeps_it(daemons, toy) -> None:
    model_dir, _ = toy
    daemon = daemons(model_dir, "--transport", "memfd", "--keep-checkpoint-layout")
    attach_layout(daemon.socket, config_of(model_dir), plan_of(), wait_ready=60).close()
    assert sorted(s.plan is None for s in daemon.status().layouts) == [False, True]


def test_the_engine_checks_the_views_against_its_plan() -> None:
    plan = plan_of()
    good = reference_params(plan, checkpoint())
    check_params(good, plan)
    missing = {n: t for n, t in good.items() if n != "norm"}
    with pytest.raises(ProtocolError, match=r"extra \[\], missing \['norm'\]"):
        check_params(missing, plan)
    with pytest.raises(ProtocolError, match="norm: daemon's view is .'float32'"):
        check_params({**good, "norm": good["norm"].float()}, plan)
    with pytest.raises(ProtocolError, match="embed: its tied names are not one tensor"):
        check_params({**good, "lm_head": good["embed"].clone()}, plan)


def test_every_load_after_the_first_waits_for_room_too(toy) -> None:
    """Issue 42 review: the room check (--rollout auto) ran before the first load only; an
    engine layout built later and the checkpoint layout rebuilt went ahead beside kept
    generations regardless. Each build now asks first, for what it will allocate."""
    from weightcache.checkpoint import checkpoint_sources
    from weightcache.daemon.layouts import Holdings
    from weightcache.daemon.resident import load_from_disk, planned_bytes
    from weightcache.plan import check_plan

    model_dir, _ = toy
    checkpoint = read_checkpoint(model_dir)
    disk = (model_dir, CPU, "memfd")
    asked: list[tuple[int, str]] = []
    holdings = Holdings(
        base_config=config_of(model_dir), checkpoint=checkpoint, device=CPU, transport="memfd",
        checkpoint_layout=load_from_disk(*disk), load_checkpoint=lambda: load_from_disk(*disk),
        room=lambda need, what: asked.append((need, what)), checkpoint_bytes=planned_bytes(*disk))
    plan = plan_of()
    key = plan_hash(plan)
    request = FetchLayoutRequest(v=1, config=config_of(model_dir), plan_hash=key,
                                 transports=["memfd"], plan=plan)

    def settled(plans: set) -> bool:
        return {s.plan for s in holdings.statuses() if s.state == "ready"} == plans

    try:
        with holdings.layout(request) as (reply, _, _):
            assert reply.retryable
        wait_until(lambda: settled({key}), "the layout built (the checkpoint layout dropped)")
        with holdings.checkpoint() as got:
            assert isinstance(got, FetchStateReply) and got.retryable
        wait_until(lambda: settled({key, None}), "the checkpoint layout rebuilt")
        summary = check_plan(plan, checkpoint_sources(checkpoint))
        assert asked == [(summary.param_bytes, f"layout {key[:12]}"),
                         (planned_bytes(*disk), "the checkpoint layout")]
    finally:
        holdings.close()
