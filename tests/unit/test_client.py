"""weightcache.client: attach to a daemon and load its tensors into a module, no copies."""

from __future__ import annotations

import json
import os
import textwrap
import threading
import time
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from tests.unit.wc_harness import (
    DAEMON_GID,
    DAEMON_UID,
    ENGINE_UID,
    OTHER_UID,
    FakeDaemon,
    cross_uid_workdir,
    open_fd_count,
    serve_tensors,
)
from weightcache.checkpoint import cache_config, read_checkpoint
from weightcache.client import (
    AttachedWeights,
    ConfigMismatch,
    DaemonError,
    DaemonNotReady,
    UntrustedDaemon,
    attach,
    load_into,
    meta_parameters,
)
from weightcache.protocol import (
    CacheConfig,
    ErrorReply,
    FetchStateReply,
    FileIdentity,
    ModelIdentity,
    PingReply,
    ProtocolError,
    ShardSpec,
    TensorGroup,
    fingerprint,
)
from weightcache.wire import send_message

SENTENCES = [
    "The weights stay resident while the engine restarts.",
    "A sidecar daemon maps memory into the engine without copying it.",
    "Short one.",
]


def data_ranges(attached: AttachedWeights) -> list[tuple[int, int]]:
    return [(b.data_ptr(), b.data_ptr() + b.numel()) for b in attached._memory.buffers]


def inside(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    return any(lo <= start and end <= hi for lo, hi in ranges)


# ----------------------------------------------------------------------------- MiniLM


@pytest.fixture(scope="module")
def bert_reference(minilm_dir: Path):
    from transformers import AutoTokenizer, BertModel

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    model = BertModel.from_pretrained(minilm_dir).eval()
    with torch.no_grad():
        expected = model(**batch).last_hidden_state
    return batch, expected


@pytest.mark.parametrize("daemon_fixture", ["memfd_daemon", "torch_ipc_daemon"])
def test_bert_on_meta_loaded_from_the_daemon_equals_a_plain_load(
    request, daemon_fixture: str, minilm_dir: Path, bert_reference
) -> None:
    from transformers import BertConfig, BertModel

    daemon = request.getfixturevalue(daemon_fixture)
    expected_config = cache_config(read_checkpoint(minilm_dir), torch.device("cpu"))
    attached = attach(daemon.socket, expected_config, transports=["memfd", "torch_ipc"])
    try:
        assert attached.transport == daemon_fixture.removesuffix("_daemon")
        assert attached.daemon_pid == daemon.pid
        assert attached.fingerprint == fingerprint(expected_config) == daemon.status().fingerprint
        assert attached.preloaded_weights_bytes == daemon.status().preloaded_weights_bytes > 0

        with meta_parameters():
            model = BertModel(BertConfig.from_pretrained(minilm_dir))
        model.eval()
        assert all(p.is_meta for p in model.parameters())
        unused = load_into(model, attached)
        # position_ids is a buffer BERT computes itself (non-persistent), kept as built.
        assert unused == ["embeddings.position_ids"]
        assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        ranges = data_ranges(attached)
        for name, param in model.named_parameters():
            assert inside(param, ranges), f"{name} was copied out of the daemon's memory"
            assert param.data_ptr() == attached.tensors[name].data_ptr()

        batch, expected = bert_reference
        with torch.no_grad():
            got = model(**batch).last_hidden_state
        assert torch.equal(got, expected)
    finally:
        attached.close()


# ----------------------------------------------------------------------------- tied weights


class TiedNet(nn.Module):
    """Embedding and head share one Parameter; one buffer is computed, one checkpointed."""

    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.nothing = nn.Parameter(torch.empty(0, dim))
        self.register_buffer("scale", torch.full((dim,), 0.5), persistent=False)
        self.register_buffer("running_mean", torch.zeros(dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.proj(self.embed(ids)) * self.scale + self.running_mean
        return self.head(hidden)


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory) -> tuple[Path, TiedNet]:
    torch.manual_seed(0)
    reference = TiedNet().eval()
    reference.running_mean.copy_(torch.arange(6.0) / 10)
    state = reference.state_dict()
    # safetensors stores a shared tensor once: the head is the embedding.
    del state["head.weight"]
    assert "scale" not in state
    directory = tmp_path_factory.mktemp("tied")
    save_file({k: v.contiguous() for k, v in state.items()}, directory / "model.safetensors")
    return directory, reference


@pytest.fixture(scope="module")
def tied_daemon(module_daemons, tied_checkpoint):
    return module_daemons(tied_checkpoint[0], "--transport", "memfd")


@pytest.fixture
def tied_attached(tied_daemon):
    attached = attach(tied_daemon.socket)
    yield attached
    attached.close()


def test_tied_weights_share_one_storage_after_attach(tied_attached, tied_checkpoint) -> None:
    _, reference = tied_checkpoint
    with meta_parameters():
        model = TiedNet()
    model.eval()
    assert model.head.weight is model.embed.weight
    assert load_into(model, tied_attached) == []
    assert model.head.weight is model.embed.weight
    daemon_embedding = tied_attached.tensors["embed.weight"]
    assert model.head.weight.data_ptr() == daemon_embedding.data_ptr()
    assert "head.weight" not in tied_attached.tensors
    # The non-persistent buffer keeps its computed value; the persistent one is the daemon's.
    assert torch.equal(model.scale, torch.full((6,), 0.5))
    assert model.running_mean.data_ptr() == tied_attached.tensors["running_mean"].data_ptr()
    assert model.nothing.shape == (0, 6)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    ids = torch.tensor([[1, 5, 9, 0], [10, 2, 2, 3]])
    with torch.no_grad():
        assert torch.equal(model(ids), reference(ids))


def test_a_parameter_the_daemon_lacks_stays_on_meta_and_is_an_error(tied_attached) -> None:
    class Bigger(TiedNet):
        def __init__(self) -> None:
            super().__init__()
            self.extra = nn.Linear(6, 2)

    with meta_parameters():
        model = Bigger()
    missing = r"2 tensor\(s\) left on meta.*extra\.weight, extra\.bias"
    with pytest.raises(RuntimeError, match=missing):
        load_into(model, tied_attached)


def test_a_buffer_left_on_meta_is_an_error(tied_attached) -> None:
    with meta_parameters():
        model = TiedNet()
    model.register_buffer("running_var", torch.empty(6, device="meta"))
    with pytest.raises(RuntimeError, match="left on meta.*running_var"):
        load_into(model, tied_attached)


def test_shape_mismatch_names_the_tensor_and_both_shapes(tied_attached) -> None:
    with meta_parameters():
        model = TiedNet(vocab=12)
    with pytest.raises(
        ValueError,
        match=r"embed\.weight: the daemon holds torch\.float32 \(11, 6\), "
        r"the module expects torch\.float32 \(12, 6\)",
    ):
        load_into(model, tied_attached)


def test_dtype_mismatch_names_the_tensor_and_both_dtypes(tied_attached) -> None:
    with meta_parameters():
        model = TiedNet().to(torch.float16)
    with pytest.raises(ValueError, match=r"the daemon holds torch\.float32 .* torch\.float16"):
        load_into(model, tied_attached)


def test_load_into_takes_a_plain_mapping_and_checks_strides() -> None:
    with meta_parameters():
        model = nn.Linear(3, 2)
    transposed = torch.zeros(3, 2).t()  # shape (2, 3) but column-major
    with pytest.raises(ValueError, match=r"weight: stride \(1, 2\) != expected \(3, 1\)"):
        load_into(model, {"weight": transposed, "bias": torch.zeros(2)})
    assert load_into(model, {"weight": torch.ones(2, 3), "bias": torch.zeros(2), "x": 1}) == ["x"]
    assert torch.equal(model.weight, torch.ones(2, 3))


# ----------------------------------------------------------------------------- replies


CONFIG = CacheConfig(
    model=ModelIdentity("/fake", None, [FileIdentity("model.safetensors", 64, "0" * 64)]),
    dtype=None,
    shard=ShardSpec(),
    device_capability=None,
)
MISSING = object()


@pytest.fixture(scope="module")
def served():
    s = serve_tensors("memfd", {"w": torch.arange(8.0), "n": torch.tensor([7])})
    yield s
    s.memory.close()


@pytest.fixture
def fake(tmp_path, served):
    """A daemon whose fetch_state reply the test shapes through ``fake.reply``."""
    replies: dict[str, object] = {}

    def handler(request, conn) -> None:
        message = replies["reply"]
        try:
            if isinstance(message, FetchStateReply) and message.status == "ok":
                served.backend.send_fetch_state_response(conn, message, served.export)
            else:
                send_message(conn, message)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client refused the reply and hung up before the fds

    daemon = FakeDaemon(str(tmp_path / "fake.sock"), handler)
    daemon.replies = replies
    yield daemon
    daemon.close()


def ok_reply(served, **changes) -> FetchStateReply:
    fields = dict(
        v=1,
        status="ok",
        pid=4242,
        config=CONFIG,
        fingerprint=fingerprint(CONFIG),
        transport_backend="memfd",
        preloaded_weights_bytes=served.memory.preloaded_weights_bytes,
        layout=served.layout,
    )
    fields.update(changes)
    if fields["preloaded_weights_bytes"] is MISSING:
        del fields["preloaded_weights_bytes"]
    return FetchStateReply(**fields)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (True, "preloaded_weights_bytes of type bool"),
        (False, "preloaded_weights_bytes of type bool"),
        (-1, r"negative preloaded_weights_bytes \(-1\)"),
        (1.0, "preloaded_weights_bytes of type float"),
        (4096.5, "preloaded_weights_bytes of type float"),
        ("4096", "preloaded_weights_bytes of type str"),
        ([4096], "preloaded_weights_bytes of type list"),
    ],
)
def test_bad_preloaded_bytes_are_rejected_before_anything_is_mapped(
    fake, served, value, message
) -> None:
    fake.replies["reply"] = ok_reply(served, preloaded_weights_bytes=value)
    for attempt in range(3):
        if attempt == 1:
            fake.wait_handled(1)
            before = open_fd_count()  # after a first attempt, which may allocate lazily
        with pytest.raises(RuntimeError, match=message):
            attach(fake.socket_path)
    fake.wait_handled(3)  # the fake daemon's end of each connection is in this process too
    assert open_fd_count() == before


@pytest.mark.parametrize(("value", "expected"), [(MISSING, 0), (None, 0), (0, 0), (12345, 12345)])
def test_missing_preloaded_bytes_mean_zero(fake, served, value, expected) -> None:
    fake.replies["reply"] = ok_reply(served, preloaded_weights_bytes=value)
    attached = attach(fake.socket_path)
    assert attached.preloaded_weights_bytes == expected
    assert attached.daemon_pid == 4242
    assert torch.equal(attached.tensors["w"], torch.arange(8.0))
    attached.close()


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"fingerprint": "f" * 64}, ProtocolError, "fingerprint does not match"),
        ({"config": None}, ProtocolError, "lacks config, layout or fingerprint"),
        ({"layout": None}, ProtocolError, "lacks config, layout or fingerprint"),
        ({"transport_backend": "torch_ipc"}, ProtocolError, "did not offer"),
        ({"transport_backend": "rdma"}, ProtocolError, "did not offer"),
        ({"status": "error", "error": "disk on fire"}, DaemonError, "disk on fire"),
    ],
)
def test_inconsistent_replies_are_refused(fake, served, changes, error, message) -> None:
    fake.replies["reply"] = ok_reply(served, **changes)
    with pytest.raises(error, match=message):
        attach(fake.socket_path, transports=["memfd"])


def test_a_layout_reading_past_its_allocation_is_refused(fake, served) -> None:
    size = served.layout.allocation_sizes[0]
    bad = msgspec.structs.replace(
        served.layout,
        groups=[TensorGroup(0, "float32", [size], 0, size * 4, ["w"])],
    )
    fake.replies["reply"] = ok_reply(served, layout=bad)
    with pytest.raises(ProtocolError, match="bad layout from daemon: .*past the end"):
        attach(fake.socket_path)


def test_an_ok_reply_for_another_config_is_refused(fake, served) -> None:
    other = msgspec.structs.replace(CONFIG, dtype="float16")
    fake.replies["reply"] = ok_reply(served)
    with pytest.raises(ProtocolError, match="config other than the one requested"):
        attach(fake.socket_path, other)


def test_error_mismatch_and_wrong_kind_replies(fake, served) -> None:
    fake.replies["reply"] = ErrorReply(v=1, error="busy: 64 connections in progress",
                                       retryable=True)
    with pytest.raises(DaemonNotReady, match="busy: 64 connections"):
        attach(fake.socket_path)
    # Only the field makes a refusal retryable, never its wording.
    fake.replies["reply"] = ErrorReply(v=1, error="something odd; retry")
    with pytest.raises(DaemonError, match="something odd") as info:
        attach(fake.socket_path)
    assert not isinstance(info.value, DaemonNotReady)
    fake.replies["reply"] = FetchStateReply(
        v=1, status="mismatch", mismatched_fields=["dtype", "shard.tp_rank"]
    )
    with pytest.raises(ConfigMismatch, match="differing fields: dtype, shard.tp_rank") as info:
        attach(fake.socket_path)
    assert info.value.fields == ["dtype", "shard.tp_rank"]
    fake.replies["reply"] = PingReply(v=1, pid=1)
    with pytest.raises(ProtocolError, match="expected a fetch_state reply, got PingReply"):
        attach(fake.socket_path)


# ----------------------------------------------------------------------------- disk fallback


def test_disk_fallback_only_when_the_socket_is_absent(
    memfd_daemon, minilm_dir: Path, minilm_reference, tmp_path: Path
) -> None:
    absent = str(tmp_path / "absent.sock")
    from_disk = attach(absent, fallback_model_dir=minilm_dir)
    assert from_disk.transport == "disk" and from_disk.preloaded_weights_bytes == 0
    assert from_disk.fingerprint == memfd_daemon.status().fingerprint
    assert set(from_disk.tensors) == set(minilm_reference)
    for name, tensor in minilm_reference.items():
        assert torch.equal(from_disk.tensors[name], tensor)
    # With a daemon there, the caller's permission to fall back changes nothing.
    served = attach(memfd_daemon.socket, fallback_model_dir=minilm_dir)
    assert served.transport == "memfd"
    served.close()
    # Without permission, an absent socket is an error, not a silent disk load.
    with pytest.raises(FileNotFoundError, match=r"no weightcache daemon answering.*absent\.sock"):
        attach(absent)
    assert not os.path.exists(absent)


# ----------------------------------------------------------------------------- waiting for a daemon


def test_wait_ready_retries_while_the_daemon_loads_then_attaches(fake, served) -> None:
    loading = FetchStateReply(v=1, status="error", pid=4242, error="daemon is still loading",
                              retryable=True)
    fake.replies["reply"] = loading
    with pytest.raises(DaemonNotReady, match="still loading"):
        attach(fake.socket_path, transports=["memfd"])  # wait_ready=0: fail at once

    def become_ready() -> None:
        time.sleep(0.5)
        fake.replies["reply"] = ok_reply(served)

    threading.Thread(target=become_ready).start()
    attached = attach(fake.socket_path, transports=["memfd"], wait_ready=30)
    assert attached.preloaded_weights_bytes == served.memory.preloaded_weights_bytes
    attached.close()


def test_wait_ready_gives_up_and_hard_errors_are_not_retried(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        attach(str(tmp_path / "nobody.sock"), wait_ready=0.5)
    asked = []

    def handler(request, conn) -> None:
        asked.append(request)
        send_message(conn, FetchStateReply(v=1, status="error", pid=1, error="disk on fire"))

    daemon = FakeDaemon(str(tmp_path / "fake.sock"), handler)
    try:
        with pytest.raises(DaemonError, match="disk on fire") as info:
            attach(daemon.socket_path, transports=["memfd"], wait_ready=30)
    finally:
        daemon.close()
    assert not isinstance(info.value, DaemonNotReady)
    assert len(asked) == 1  # a hard error is final: asked once, not retried


# ----------------------------------------------------------------------------- who serves it

# An engine as it runs in a pod (its own uid, the daemon's gid): attach with defaults,
# then report what happened and how many memfd mappings the process holds.
PROBING_ENGINE = textwrap.dedent(
    """
    import json, sys
    from weightcache.client import attach
    try:
        attached = attach(sys.argv[1], transports=["memfd"])
        outcome = {"served_by_pid": attached.daemon_pid}
    except Exception as exc:
        outcome = {"error": type(exc).__name__, "message": str(exc)}
    with open("/proc/self/maps") as f:
        outcome["memfd_mappings"] = sum("/memfd:" in line for line in f)
    print(json.dumps(outcome), flush=True)
    sys.stdin.read()
    """
)


def probe(engines, socket_path: str, **env: str) -> dict:
    proc = engines.start(
        socket_path,
        PROBING_ENGINE,
        user=ENGINE_UID,
        group=DAEMON_GID,
        env=env,
        check=lambda line: line.startswith("{"),
    )
    return json.loads(proc.line)


def memfd_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum("/memfd:" in line for line in f)


def test_an_impostor_on_the_daemons_socket_is_refused_before_mapping(
    daemons, engines, minilm_dir
) -> None:
    workdir = daemons.workdir()
    daemon_dir = cross_uid_workdir(workdir)  # the daemon's, its daemon down
    os.chmod(daemon_dir, 0o750)
    own = workdir / "imp"
    own.mkdir()
    os.chown(own, OTHER_UID, DAEMON_GID)
    # A real daemon, serving real weights, but under another uid.
    impostor = daemons(
        minilm_dir,
        *("--transport", "memfd", "--allow-gid", str(DAEMON_GID), "--allow-uid", "0"),
        workdir=workdir,
        socket_name="imp/cpu.sock",
        user=OTHER_UID,
        group=DAEMON_GID,
    )
    planted = str(daemon_dir / "cpu.sock")
    os.rename(impostor.socket, planted)  # left by whoever could once write the directory

    refused = probe(engines, planted)
    assert refused.get("error") == "UntrustedDaemon", refused
    assert f"served by pid {impostor.pid} running as uid {OTHER_UID}" in refused["message"]
    assert f"expected uid {DAEMON_UID} (owner of {daemon_dir})" in refused["message"]
    assert refused["memfd_mappings"] == 0
    # The control: told to expect that uid, the same engine maps the impostor's weights,
    # so the refusal above was the uid check and nothing else.
    accepted = probe(engines, planted, WEIGHTCACHE_DAEMON_UIDS=str(OTHER_UID))
    assert accepted["served_by_pid"] == impostor.pid and accepted["memfd_mappings"] >= 1
    # With the daemon's uid pinned, the directory is not even asked: refused as well.
    pinned = probe(engines, planted, WEIGHTCACHE_DAEMON_UIDS=f"{DAEMON_UID},4242")
    assert pinned.get("error") == "UntrustedDaemon" and pinned["memfd_mappings"] == 0
    assert f"expected uid 4242, {DAEMON_UID} (WEIGHTCACHE_DAEMON_UIDS)" in pinned["message"]


def test_a_directory_others_could_write_cannot_vouch_for_the_daemon(daemons, minilm_dir):
    daemon = daemons(minilm_dir, "--transport", "memfd")
    directory = Path(daemon.socket).parent
    link = daemon.workdir / "link"
    link.symlink_to(directory)
    cases = [
        (lambda: os.chmod(directory, 0o770), daemon.socket, "is writable by group or others"),
        (lambda: os.chmod(daemon.workdir, 0o777), daemon.socket, "above the socket directory"),
        (lambda: None, str(link / "cpu.sock"), "is a symlink or not a directory"),
    ]
    mapped = memfd_mappings()  # other tests' attachments may still be alive
    for change, path, message in cases:
        os.chmod(directory, 0o750)
        os.chmod(daemon.workdir, 0o700)
        change()
        with pytest.raises(UntrustedDaemon, match=message):
            attach(path, transports=["memfd"])
        assert memfd_mappings() == mapped
        # Naming the daemon's uid replaces the directory's word for it.
        attach(path, transports=["memfd"], daemon_uids=[os.getuid()], handback=False).close()
    os.chmod(daemon.workdir, 0o1777)  # sticky: others may add, but not replace our entries
    attach(daemon.socket, transports=["memfd"], handback=False).close()


def test_a_daemon_of_another_uid_than_expected_is_refused(memfd_daemon, monkeypatch) -> None:
    mapped = memfd_mappings()
    with pytest.raises(UntrustedDaemon) as info:
        attach(memfd_daemon.socket, daemon_uids=[4242])
    assert f"running as uid {os.getuid()}" in str(info.value)
    assert "expected uid 4242 (daemon_uids)" in str(info.value)
    assert memfd_mappings() == mapped
    monkeypatch.setenv("WEIGHTCACHE_DAEMON_UIDS", "65533,x")
    with pytest.raises(ValueError, match="expected comma-separated non-negative uids"):
        attach(memfd_daemon.socket)
