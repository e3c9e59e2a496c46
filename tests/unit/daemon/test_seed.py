"""Peer seeding over memfd: real daemon processes of one socket directory, real sockets.

The GPU copy (vmm_fd over peer access) is proven on the device by
tests/gpu/test_peer_gpu.py; here CI covers the same path on CPU memory: the
neighbour survey, the checks before and after the copy, the coordination of
daemons that start together, and every fallback to disk.

The proof that a seeded daemon read no tensor bytes: it read (``rchar``)
less than the checkpoint holds, and at least 90 % of the checkpoint less than
a daemon that loaded from disk. (Changing the files in place cannot prove it:
a daemon never copies bytes whose files changed since they were read, see
provenance.py.)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest
import torch

from tests.unit.daemon.test_readopt import zero_tensor_bytes
from tests.unit.wc_harness import (
    DAEMON_GID,
    DAEMON_UID,
    OTHER_UID,
    cross_uid_workdir,
    package_env,
    python_for,
    read_chars,
    readable_model_copy,
    wait_until,
)
from weightcache.client import attach
from weightcache.daemon.manifest import manifest_path, read_manifest, write_manifest
from weightcache.daemon.seed import (
    SeedUnavailable,
    load_lock_path,
    manifest_problem,
    obtain_weights,
    peer_ordinal,
    plan_target,
    survey,
    unfit_reason,
)
from weightcache.daemon.statedir import prepare_state_dir
from weightcache.layout import build_views
from weightcache.protocol import DaemonStatus, Layout, TensorGroup

CPU = torch.device("cpu")
MEMFD = ("--transport", "memfd")


@pytest.fixture
def model(minilm_dir, tmp_path) -> Path:
    """A private copy of MiniLM's weights that the test may damage."""
    path = tmp_path / "model"
    path.mkdir()
    shutil.copy(minilm_dir / "model.safetensors", path / "model.safetensors")
    return path


def checkpoint_bytes(model: Path) -> int:
    return sum(p.stat().st_size for p in model.glob("*.safetensors"))


def assert_serves(socket_path: str, reference: dict) -> None:
    attached = attach(socket_path, transports=["memfd"])
    try:
        for name, tensor in reference.items():
            assert torch.equal(attached.tensors[name], tensor), name
    finally:
        attached.close()


# --------------------------------------------------------------------------- daemons


def test_a_second_daemon_seeds_from_the_first_without_reading_the_checkpoint(
    daemons, model, minilm_reference
) -> None:
    first = daemons(model, *MEMFD)
    assert first.status().load_source == "disk"

    second = daemons(model, *MEMFD, workdir=first.workdir, socket_name="d/cpu-b.sock")
    size = checkpoint_bytes(model)
    assert read_chars(first.pid) - read_chars(second.pid) >= 0.9 * size
    assert read_chars(second.pid) < size
    status = second.status()
    assert status.load_source == "peer" and not status.readopted
    assert status.seeded_from == "cpu"
    assert f"seeded from cpu (cpu.sock, pid {first.pid})" in status.load_reason
    assert "every checksum matching its manifest" in status.load_reason
    assert status.fingerprint == first.status().fingerprint
    assert status.preloaded_weights_bytes == first.status().preloaded_weights_bytes
    code, _, body = second.http("/status")
    assert code == 200
    public = msgspec.json.decode(body)
    assert public["load_source"] == "peer" and public["seeded_from"] == "cpu"
    assert_serves(second.socket, minilm_reference)

    # Its own manifest, under a key of its own, for its own successor.
    ours, theirs = (read_manifest(manifest_path(d.socket)) for d in (second, first))
    assert ours.fingerprint == theirs.fingerprint and ours.layout == theirs.layout
    assert ours.checksum_key != theirs.checksum_key and ours.digests != theirs.digests

    # Its own memory: the neighbour's death takes nothing from it.
    first.kill()
    assert_serves(second.socket, minilm_reference)


def test_bytes_read_before_the_files_changed_are_never_seeded_back_and_forth(
    daemons, model
) -> None:
    """Issue 25 item 9, as reported: daemon A loaded a poisoned checkpoint, B seeded from A,
    the checkpoint was restored on disk under the same header (same fingerprint), and A,
    restarted, seeded back from B: both kept serving bytes the disk no longer held. A copy
    is taken only while the files carry the stamps its bytes were read under."""

    def serves_the_disk(daemon) -> bool:
        attached = attach(daemon.socket, transports=["memfd"])
        try:
            return all(not t.any() for t in attached.tensors.values())
        finally:
            attached.close()

    first = daemons(model, *MEMFD)  # reads the "poisoned" bytes (the original values)
    second = daemons(model, *MEMFD, workdir=first.workdir, socket_name="d/cpu-b.sock")
    assert second.status().load_source == "peer", second.status().load_reason
    zero_tensor_bytes(model / "model.safetensors")  # restored on disk: same header

    first.kill()
    status = first.start().status()  # its only neighbour holds a copy of the old read
    assert status.load_source == "disk", status.load_reason
    assert (
        "the checkpoint changed since its bytes were read from disk "
        "(model.safetensors was rewritten or replaced)" in status.load_reason
    )
    assert serves_the_disk(first)

    # Bytes read after the restore are the disk's: a newcomer copies those, not the stale.
    third = daemons(model, *MEMFD, workdir=first.workdir, socket_name="d/cpu-c.sock")
    status = third.status()
    assert status.load_source == "peer", status.load_reason
    assert f"pid {first.pid}" in status.load_reason
    assert serves_the_disk(third)


def test_started_together_exactly_one_reads_the_checkpoint(daemons, model, minilm_reference):
    workdir = daemons.workdir()
    started = [
        daemons(model, *MEMFD, workdir=workdir, socket_name=f"d/cpu-{i}.sock", wait=False)
        for i in range(2)
    ]
    statuses = [d.wait_ready() for d in started]
    by_source = {s.load_source: (d, s) for d, s in zip(started, statuses, strict=True)}
    assert sorted(by_source) == ["disk", "peer"], [s.load_reason for s in statuses]
    (reader, _), (seeder, seeded) = by_source["disk"], by_source["peer"]
    assert f"pid {reader.pid}" in seeded.load_reason
    # The reader paid for every tensor byte; the seeder for less than the checkpoint
    # (its rchar is interpreter start-up, headers and socket traffic).
    size = checkpoint_bytes(model)
    assert read_chars(reader.pid) - read_chars(seeder.pid) >= 0.9 * size
    assert read_chars(seeder.pid) < size
    for d in started:
        assert_serves(d.socket, minilm_reference)


def test_a_neighbour_holding_other_weights_is_never_used(daemons, model, minilm_reference):
    other = daemons(model, *MEMFD, "--revision", "other")
    second = daemons(model, *MEMFD, workdir=other.workdir, socket_name="d/cpu-b.sock")
    status = second.status()
    assert status.load_source == "disk" and status.seeded_from is None
    assert f"cpu.sock (pid {other.pid}): holds other weights" in status.load_reason
    assert status.fingerprint != other.status().fingerprint
    assert_serves(second.socket, minilm_reference)


def test_a_neighbour_whose_bytes_differ_from_its_manifest_is_caught(
    daemons, model, minilm_reference
) -> None:
    first = daemons(model, *MEMFD)
    # memfd memory is sealed: nothing can change the neighbour's bytes. What its manifest
    # vouches for can differ, though, and only the checksum of the copy can tell.
    path = manifest_path(first.socket)
    manifest = read_manifest(path)
    flipped = f"{int(manifest.digests[0][0], 16) ^ 1:x}" + manifest.digests[0][1:]
    write_manifest(path, msgspec.structs.replace(manifest, digests=[flipped]))

    second = daemons(model, *MEMFD, workdir=first.workdir, socket_name="d/cpu-b.sock")
    status = second.status()
    assert status.load_source == "disk"
    assert "no neighbour's weights could be used" in status.load_reason
    assert "checksum of allocation(s) [0] does not match its manifest" in status.load_reason
    assert_serves(second.socket, minilm_reference)


def test_seeding_off_reads_the_disk(daemons, model) -> None:
    first = daemons(model, *MEMFD)
    second = daemons(
        model, *MEMFD, "--no-peer-seed", workdir=first.workdir, socket_name="d/cpu-b.sock"
    )
    status = second.status()
    assert status.load_source == "disk" and "peer seeding is off" in status.load_reason


HOLDER = textwrap.dedent(
    """
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.pwrite(fd, f"{os.getpid()}\\n".encode(), 0)
    print("held", flush=True)
    time.sleep(3600)
    """
)


@pytest.fixture
def load_lock_holder(daemons, model):
    """A process holding the load lock for the model's weights in a fresh socket directory,
    as a neighbour reading them from disk does: (workdir, the process)."""
    workdir = daemons.workdir()
    socket_path = str(workdir / "d" / "cpu.sock")
    os.makedirs(os.path.dirname(socket_path), 0o750)
    prepare_state_dir(socket_path)
    target = plan_target(socket_path, "cpu", model, CPU, "memfd", None, None, None)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, load_lock_path(socket_path, target.fingerprint)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    yield workdir, holder
    if holder.poll() is None:
        holder.kill()
    holder.wait()
    holder.stdout.close()


def test_a_waiter_reads_the_disk_once_the_loader_dies(daemons, model, load_lock_holder) -> None:
    workdir, holder = load_lock_holder
    waiter = daemons(model, *MEMFD, workdir=workdir, socket_name="d/cpu-b.sock", wait=False)
    wait_until(
        lambda: f"pid {holder.pid} is reading these weights from disk; waiting" in waiter.log(),
        "the daemon to wait for the lock holder",
    )
    assert waiter.status().state == "loading"
    holder.send_signal(signal.SIGKILL)  # the kernel drops its flock
    status = waiter.wait_ready()
    assert status.load_source == "disk"
    assert f"pid {holder.pid} stopped loading without serving" in status.load_reason


def test_the_wait_for_a_loading_neighbour_is_bounded(daemons, model, load_lock_holder) -> None:
    workdir, holder = load_lock_holder
    waiter = daemons(
        model, *MEMFD, "--peer-wait-seconds", "0.5", workdir=workdir, socket_name="d/cpu-b.sock"
    )
    status = waiter.status()
    assert status.load_source == "disk"
    assert (
        f"pid {holder.pid} was still reading these weights from disk after the 0.5 s peer wait"
        in status.load_reason
    )
    assert holder.poll() is None


def test_daemons_of_the_kubernetes_uid_seed_each_other(daemons, model, minilm_reference):
    """As in a pod: both daemons run as 65533:65533, admitting engines by group."""
    workdir = daemons.workdir()
    cross_uid_workdir(workdir)
    shared = readable_model_copy(model, workdir)
    # --allow-uid 0: this test's own probes (root could read everything anyway).
    args = (*MEMFD, "--allow-uid", "0", "--allow-gid", str(DAEMON_GID))
    ids = dict(user=DAEMON_UID, group=DAEMON_GID, workdir=workdir)
    first = daemons(shared, *args, **ids)
    second = daemons(shared, *args, socket_name="d/cpu-b.sock", **ids)
    assert second.status().load_source == "peer", second.status().load_reason
    assert read_chars(second.pid) < checkpoint_bytes(shared)
    assert f"pid {first.pid}" in second.status().load_reason
    assert_serves(second.socket, minilm_reference)


# --------------------------------------------------------------------------- in this process
# The seeding daemon is this test process (the same code the daemon runs), its neighbour a
# real daemon process: the progress callback, called at every step, lets a test kill the
# neighbour at an exact point of the exchange.


def obtain_here(workdir: Path, model: Path, progress):
    socket_path = str(workdir / "d" / "cpu-t.sock")
    prepare_state_dir(socket_path)
    return obtain_weights(socket_path, "cpu", model, CPU, "memfd", timeout=10.0, progress=progress)


def views(obtained) -> dict:
    return build_views(obtained.resident.memory.buffers, obtained.resident.layout)


def killer(daemon, phase_prefix: str):
    def progress(phase: str | None = None) -> None:
        if phase and phase.startswith(phase_prefix) and daemon.proc.poll() is None:
            daemon.kill()

    return progress


def test_a_neighbour_killed_before_it_hands_over_means_the_disk(
    daemons, model, minilm_reference
) -> None:
    first = daemons(model, *MEMFD)
    obtained = obtain_here(first.workdir, model, killer(first, "asking cpu.sock"))
    try:
        assert first.proc.returncode == -signal.SIGKILL
        assert obtained.resident.load_source == "disk"
        assert f"cpu.sock (pid {first.pid})" in obtained.reason
        assert "no weightcache daemon answering" in obtained.reason
        for name, tensor in minilm_reference.items():
            assert torch.equal(views(obtained)[name], tensor), name
    finally:
        obtained.release()
        obtained.resident.close()


def test_a_neighbour_killed_mid_copy_cannot_spoil_it(daemons, model, minilm_reference) -> None:
    first = daemons(model, *MEMFD)
    obtained = obtain_here(first.workdir, model, killer(first, "copying from cpu.sock"))
    try:
        # Dead before a byte was copied; the fds in hand kept its memory, and the
        # checksums under its key vouch for the copy.
        assert first.proc.returncode == -signal.SIGKILL
        assert obtained.resident.load_source == "peer", obtained.reason
        for name, tensor in minilm_reference.items():
            assert torch.equal(views(obtained)[name], tensor), name
    finally:
        obtained.release()
        obtained.resident.close()


LISTENER = textwrap.dedent(
    """
    import socket, sys, time
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(sys.argv[1])
    s.listen(8)
    print("listening", flush=True)
    time.sleep(3600)
    """
)


def test_a_socket_of_another_uid_is_never_asked(daemons, model) -> None:
    workdir = daemons.workdir()
    directory = workdir / "d"
    directory.mkdir(mode=0o777)
    os.chmod(workdir, 0o755)
    os.chmod(directory, 0o1777)  # so the other uid can bind there (a misconfigured node)
    intruder = subprocess.Popen(
        [python_for(OTHER_UID), "-c", LISTENER, str(directory / "gpu-x.sock")],
        user=OTHER_UID, stdout=subprocess.PIPE, text=True, env=package_env(),
    )  # fmt: skip
    try:
        assert intruder.stdout.readline().strip() == "listening"
        socket_path = str(directory / "cpu.sock")
        target = plan_target(socket_path, "cpu", model, CPU, "memfd", None, None, None)
        found = survey(target, timeout=5.0)
        assert found.candidates == []
        [note] = found.notes
        assert note.startswith("gpu-x.sock: ") and f"uid {OTHER_UID}" in note
    finally:
        intruder.kill()
        intruder.wait()
        intruder.stdout.close()


# --------------------------------------------------------------------------- decisions


def status(**changes) -> DaemonStatus:
    base = dict(
        state="ready", pid=7, device="cuda:0", gpu="GPU-a", transport_backend="vmm_fd",
        preloaded_weights_bytes=512, expected_bytes=500, fingerprint="f" * 64,
        load_seconds=1.0, load_source="disk", readopted=False, socket="/s",
        clients_served=0, error=None,
    )  # fmt: skip
    return DaemonStatus(**{**base, **changes})


def test_only_a_ready_neighbour_with_our_fingerprint_and_transport_may_seed() -> None:
    assert unfit_reason(status(), "f" * 64, "vmm_fd") is None
    assert unfit_reason(status(state="loading"), "f" * 64, "vmm_fd") == "not ready (loading)"
    assert unfit_reason(status(fingerprint="e" * 64), "f" * 64, "vmm_fd") == (
        "holds other weights (fingerprint eeeeeeeeeeee…)"
    )
    assert unfit_reason(status(transport_backend="torch_ipc"), "f" * 64, "vmm_fd") == (
        "serves transport torch_ipc, not vmm_fd"
    )


def test_the_neighbours_manifest_must_describe_what_we_would_hold(minilm_dir) -> None:
    from weightcache.daemon.manifest import build_manifest

    layout = Layout(
        allocation_sizes=[512],
        groups=[TensorGroup(allocation=0, dtype="float32", shape=[4], offset=0, step=256,
                            names=["w"])],
        aliases={},
    )  # fmt: skip
    target = plan_target("/tmp/x/cpu.sock", "cpu", minilm_dir, CPU, "memfd", None, None, None)
    manifest = build_manifest(
        config=target.config, transport="memfd", gpu="GPU-a", layout=layout,
        buffers=[torch.zeros(512, dtype=torch.uint8)],
    )  # fmt: skip
    fp = target.fingerprint
    check = dict(fingerprint=fp, transport="memfd", gpu="GPU-a", layout=layout)
    assert manifest_problem(manifest, **check) is None
    assert "other weights" in manifest_problem(manifest, **{**check, "fingerprint": "0" * 64})
    assert "transport memfd" in manifest_problem(manifest, **{**check, "transport": "vmm_fd"})
    assert "for GPU-a, it serves GPU-b" in manifest_problem(manifest, **{**check, "gpu": "GPU-b"})
    other = msgspec.structs.replace(layout, allocation_sizes=[1024])
    assert "layout differs" in manifest_problem(manifest, **{**check, "layout": other})


def test_a_gpu_must_be_visible_and_peer_accessible_to_seed_from() -> None:
    visible = {"GPU-a": 0, "GPU-b": 1}
    assert peer_ordinal(1, "GPU-a", visible, lambda mine, theirs: True) == 0
    with pytest.raises(SeedUnavailable, match="GPU-c is not visible to this daemon"):
        peer_ordinal(0, "GPU-c", visible, lambda mine, theirs: True)
    # Two daemons of one GPU (--socket paths of their own): no peer access needed.
    assert peer_ordinal(0, "GPU-a", visible, lambda mine, theirs: False) == 0
    with pytest.raises(SeedUnavailable, match=r"no peer access from cuda:1 to cuda:0 \(GPU-a\)"):
        peer_ordinal(1, "GPU-a", visible, lambda mine, theirs: False)


def test_a_lone_daemon_says_nobody_holds_its_weights(daemons, model) -> None:
    lone = daemons(model, *MEMFD)
    assert "read from disk: no neighbour holds these weights" in lone.status().load_reason


def test_engine_layouts_are_seeded_from_a_neighbour_that_holds_only_those(
    daemons, tmp_path
) -> None:
    """The neighbour dropped its checkpoint layout once an engine's own was built: the
    second daemon copies that layout (verified under the neighbour's manifest key), not the
    checkpoint, and serves it by hash bit-equal to the engine's own load."""
    from tests.unit.plankit import same_bits
    from tests.unit.toyengine import (
        ToyEngine,
        checkpoint,
        meta_model,
        real_load,
        save_checkpoint,
        sources,
    )
    from weightcache.checkpoint import cache_config, read_checkpoint
    from weightcache.client import attach_by_hash, attach_layout
    from weightcache.integrations.trace import trace_load

    tensors = checkpoint()
    model = save_checkpoint(tmp_path / "toy", tensors)
    first = daemons(model, *MEMFD)
    meta = meta_model()
    plan = trace_load(meta, sources(tensors), meta.load_weights).plan
    config = cache_config(read_checkpoint(model), CPU)
    attach_layout(first.socket, config, plan, ["memfd"], wait_ready=60).close()
    [layout] = first.status().layouts
    assert layout.plan is not None  # the checkpoint layout is gone

    second = daemons(model, *MEMFD, workdir=first.workdir, socket_name="d/cpu-b.sock")
    status = second.status()
    assert status.load_source == "peer" and status.seeded_from == "cpu"
    assert [(s.plan, s.source) for s in status.layouts] == [(layout.plan, "peer")]
    assert (
        f"engine layout(s) {layout.plan[:12]} (it holds no checkpoint layout)"
        in status.load_reason
    )
    ours = read_manifest(manifest_path(second.socket, layout.plan))
    theirs = read_manifest(manifest_path(first.socket, layout.plan))
    assert ours.fingerprint == theirs.fingerprint == layout.fingerprint
    assert ours.checksum_key != theirs.checksum_key
    attached = attach_by_hash(second.socket, config, layout.plan, ["memfd"])
    try:
        own = real_load(ToyEngine(), tensors)
        assert [n for n in own if not same_bits(attached.tensors[n], own[n])] == []
    finally:
        attached.close()
