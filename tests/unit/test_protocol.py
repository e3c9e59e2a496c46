"""weightcache.protocol: frame headers, strict request/reply schemas, CacheConfig identity."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import msgspec
import pytest

from weightcache.plan import Copy, LoadPlan, ParamEntry, Region
from weightcache.protocol import (
    MAX_SOCKET_PATH_BYTES,
    CacheConfig,
    ErrorReply,
    FetchLayoutRequest,
    FetchStateReply,
    FetchStateRequest,
    FileIdentity,
    ModelIdentity,
    PingReply,
    PingRequest,
    ProtocolError,
    ShardSpec,
    StatusRequest,
    canonical_json,
    config_differences,
    decode_reply,
    decode_request,
    encode,
    fingerprint,
    socket_path,
    validated_preloaded_bytes,
)

SHA_A = "a" * 64
SHA_B = "b" * 64
LOAD_PLAN = LoadPlan(
    v=1,
    params=[ParamEntry("qkv", "bfloat16", [8, 4], [4, 1])],
    copies=[Copy("q", Region(0, [8, 4], [4, 1]), "qkv", Region(0, [8, 4], [4, 1]))],
)


def make_config(**overrides) -> CacheConfig:
    model = ModelIdentity(
        path="/models/minilm",
        revision="r1",
        files=[
            FileIdentity("model-00001.safetensors", 1000, SHA_A),
            FileIdentity("model-00002.safetensors", 2000, SHA_B),
        ],
    )
    fields = dict(
        model=model,
        dtype="bfloat16",
        shard=ShardSpec(tp_size=2, tp_rank=1, plan="rowwise"),
        device_capability="sm_90",
        layout_version=1,
    )
    fields.update(overrides)
    return CacheConfig(**fields)


def request_body(**fields) -> bytes:
    """A request as a peer could send it: a plain map, nothing checked on our side."""
    return msgspec.msgpack.encode(fields)


def config_map(**overrides) -> dict:
    data = msgspec.to_builtins(make_config())
    data.update(overrides)
    return data


# ----------------------------------------------------------------------------- requests


@pytest.mark.parametrize(
    "message",
    [
        PingRequest(v=1),
        StatusRequest(v=1),
        FetchStateRequest(v=1, config=None, transports=["memfd"]),
        FetchStateRequest(v=1, config=make_config(), transports=["vmm_fd", "torch_ipc"]),
        FetchLayoutRequest(v=1, config=make_config(), plan_hash=SHA_A, transports=["memfd"]),
        FetchLayoutRequest(
            v=1, config=make_config(), plan_hash=SHA_B, transports=["vmm_fd"], plan=LOAD_PLAN
        ),
    ],
)
def test_requests_round_trip(message) -> None:
    assert decode_request(encode(message)) == message


def test_every_message_carries_its_op_and_version() -> None:
    assert msgspec.msgpack.decode(encode(PingRequest(v=1))) == {"op": "ping", "v": 1}
    decoded = msgspec.msgpack.decode(encode(FetchStateRequest(v=1, config=None, transports=["x"])))
    assert decoded["op"] == "fetch_state" and decoded["v"] == 1


@pytest.mark.parametrize(
    ("body", "names"),
    [
        (request_body(op="ping", v=2), "$.v"),
        (request_body(op="ping", v="1"), "$.v"),
        (request_body(op="ping", v=True), "$.v"),
        (request_body(op="ping"), "`v`"),
        (request_body(op="shutdown", v=1), "'shutdown'"),
        (request_body(v=1), "`op`"),
        (request_body(op=1, v=1), "$.op"),
        (request_body(op="ping", v=1, extra=1), "`extra`"),
        (request_body(op="fetch_state", v=1, config=None), "`transports`"),
        (request_body(op="fetch_state", v=1, transports=["memfd"]), "`config`"),
        (request_body(op="fetch_state", v=1, config=None, transports="memfd"), "$.transports"),
        (request_body(op="fetch_state", v=1, config=None, transports=[]), "$.transports"),
        (request_body(op="fetch_state", v=1, config=None, transports=["a"] * 17), "$.transports"),
        (request_body(op="fetch_state", v=1, config=None, transports=[""]), "$.transports[0]"),
        (
            request_body(op="fetch_state", v=1, config=None, transports=["x" * 65]),
            "$.transports[0]",
        ),
        (request_body(op="fetch_state", v=1, config=None, transports=[7]), "$.transports[0]"),
        (request_body(op="fetch_state", v=1, config=5, transports=["m"]), "$.config"),
        (
            request_body(op="fetch_state", v=1, config=config_map(dtype=16), transports=["memfd"]),
            "$.config.dtype",
        ),
        (
            request_body(
                op="fetch_state",
                v=1,
                config=config_map(shard={"tp_size": 0, "tp_rank": 0, "plan": None}),
                transports=["memfd"],
            ),
            "$.config.shard.tp_size",
        ),
        (
            request_body(
                op="fetch_state",
                v=1,
                config=config_map(shard={"tp_size": 1, "tp_rank": -1, "plan": None}),
                transports=["memfd"],
            ),
            "$.config.shard.tp_rank",
        ),
        (
            request_body(
                op="fetch_state",
                v=1,
                config=config_map(layout_version=0),
                transports=["memfd"],
            ),
            "$.config.layout_version",
        ),
        (
            request_body(
                op="fetch_state",
                v=1,
                config=config_map(
                    model={
                        "path": "/m",
                        "revision": None,
                        "files": [{"name": "f", "size": -1, "header_sha256": SHA_A}],
                    }
                ),
                transports=["memfd"],
            ),
            "$.config.model.files[0].size",
        ),
        (
            request_body(
                op="fetch_state",
                v=1,
                config=config_map(
                    model={
                        "path": "/m",
                        "revision": None,
                        "files": [{"name": "f", "size": 1, "header_sha256": "A" * 64}],
                    }
                ),
                transports=["memfd"],
            ),
            "$.config.model.files[0].header_sha256",
        ),
        (
            request_body(
                op="fetch_state", v=1, config=config_map(surprise=1), transports=["memfd"]
            ),
            "`surprise`",
        ),
        (
            request_body(op="fetch_layout", v=1, config=config_map(), transports=["memfd"],
                         plan_hash="A" * 64),
            "$.plan_hash",
        ),
        (
            request_body(op="fetch_layout", v=1, config=config_map(), transports=["memfd"],
                         plan_hash=SHA_A, plan={"v": 1, "params": [], "copies": []}),
            "$.plan.params",
        ),
        (
            request_body(op="fetch_layout", v=1, config=config_map(), transports=["memfd"],
                         plan_hash=SHA_A, plan={"v": 1, "copies": [], "params": [
                             {"name": "p", "dtype": "float32", "shape": [1], "stride": [1]}],
                             "fills": [["p", [0, [1], [1]], "zero"]]}),
            "$.plan.fills[0][2]",
        ),
        (
            request_body(op="fetch_layout", v=1, config=None, transports=["memfd"],
                         plan_hash=SHA_A),
            "$.config",
        ),
    ],
)
def test_bad_requests_are_refused_naming_the_field(body: bytes, names: str) -> None:
    with pytest.raises(ProtocolError, match="^bad request: ") as info:
        decode_request(body)
    assert names in str(info.value)


@pytest.mark.parametrize(
    "body",
    [b"", b"\xc1", b"\x92\x01\x02", b"not msgpack at all", b"\x81\xa2op"],
)
def test_bodies_that_are_not_a_msgpack_map_are_refused(body: bytes) -> None:
    with pytest.raises(ProtocolError, match="^bad request: "):
        decode_request(body)


def test_huge_strings_hit_the_schema_limits() -> None:
    body = request_body(
        op="fetch_state",
        v=1,
        config=config_map(dtype="9" * 100_000),
        transports=["memfd"],
    )
    with pytest.raises(ProtocolError, match=r"\$\.config\.dtype"):
        decode_request(body)


# ----------------------------------------------------------------------------- replies


def test_replies_round_trip_and_the_loose_fields_stay_loose() -> None:
    assert decode_reply(encode(PingReply(v=1, pid=7))) == PingReply(v=1, pid=7)
    assert decode_reply(encode(ErrorReply(v=1, error="no"))) == ErrorReply(v=1, error="no")
    # Old daemons omit transport_backend and preloaded_weights_bytes.
    old = decode_reply(msgspec.msgpack.encode({"op": "fetch_state_reply", "v": 1, "status": "ok"}))
    assert isinstance(old, FetchStateReply)
    assert old.transport_backend is None and old.preloaded_weights_bytes is None
    weird = decode_reply(
        msgspec.msgpack.encode(
            {"op": "fetch_state_reply", "v": 1, "status": "ok", "preloaded_weights_bytes": "9"}
        )
    )
    assert weird.preloaded_weights_bytes == "9"  # decoded as sent; the client judges it


def test_bad_replies_are_refused() -> None:
    with pytest.raises(ProtocolError, match="bad reply from daemon"):
        decode_reply(msgspec.msgpack.encode({"op": "fetch_state_reply", "v": 1, "status": "meh"}))
    with pytest.raises(ProtocolError, match="bad reply from daemon"):
        decode_reply(b"\x00garbage")


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, 0), (0, 0), (1, 1), (90_856_960, 90_856_960), (1 << 60, 1 << 60)],
)
def test_preloaded_bytes_accepted(value, expected) -> None:
    assert validated_preloaded_bytes(value) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (True, "type bool"),
        (False, "type bool"),
        (-1, "negative"),
        (1.0, "type float"),
        ("123", "type str"),
        ([1], "type list"),
    ],
)
def test_preloaded_bytes_rejected(value, message) -> None:
    with pytest.raises(RuntimeError, match=message):
        validated_preloaded_bytes(value)


# ----------------------------------------------------------------------------- CacheConfig


def test_fingerprint_is_sha256_of_sorted_compact_json() -> None:
    config = make_config(model=ModelIdentity("/m/ü", None, [FileIdentity("f", 1, SHA_A)]))
    independent = json.dumps(
        msgspec.to_builtins(config), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    ).encode()
    assert canonical_json(config) == independent
    assert fingerprint(config) == hashlib.sha256(independent).hexdigest()


def test_fingerprint_is_stable_across_construction_encoding_and_processes() -> None:
    config = make_config()
    rebuilt = CacheConfig(
        layout_version=1,
        device_capability="sm_90",
        shard=ShardSpec(plan="rowwise", tp_rank=1, tp_size=2),
        dtype="bfloat16",
        model=ModelIdentity(
            files=[
                FileIdentity(header_sha256=SHA_A, size=1000, name="model-00001.safetensors"),
                FileIdentity(header_sha256=SHA_B, size=2000, name="model-00002.safetensors"),
            ],
            revision="r1",
            path="/models/minilm",
        ),
    )
    over_the_wire = msgspec.msgpack.decode(msgspec.msgpack.encode(config), type=CacheConfig)
    assert fingerprint(rebuilt) == fingerprint(config) == fingerprint(over_the_wire)
    other_process = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, msgspec; from weightcache.protocol import CacheConfig, fingerprint; "
            "print(fingerprint(msgspec.json.decode(sys.stdin.buffer.read(), type=CacheConfig)))",
        ],
        input=msgspec.json.encode(config),
        capture_output=True,
        check=True,
    )
    assert other_process.stdout.decode().strip() == fingerprint(config)


# Every leaf of CacheConfig, with a changed value and the dotted path that names it.
FIELD_CHANGES = [
    ("model.path", lambda c: _model(c, path="/models/other")),
    ("model.revision", lambda c: _model(c, revision="r2")),
    ("model.files[1].name", lambda c: _file(c, 1, name="model-00003.safetensors")),
    ("model.files[0].size", lambda c: _file(c, 0, size=1001)),
    ("model.files[1].header_sha256", lambda c: _file(c, 1, header_sha256="c" * 64)),
    ("dtype", lambda c: msgspec.structs.replace(c, dtype="float16")),
    ("shard.tp_size", lambda c: _shard(c, tp_size=4)),
    ("shard.tp_rank", lambda c: _shard(c, tp_rank=0)),
    ("shard.plan", lambda c: _shard(c, plan=None)),
    ("device_capability", lambda c: msgspec.structs.replace(c, device_capability="sm_80")),
    ("layout_version", lambda c: msgspec.structs.replace(c, layout_version=2)),
    ("plan", lambda c: msgspec.structs.replace(c, plan="d" * 64)),
]


def _model(config: CacheConfig, **changes) -> CacheConfig:
    return msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, **changes))


def _file(config: CacheConfig, index: int, **changes) -> CacheConfig:
    files = list(config.model.files)
    files[index] = msgspec.structs.replace(files[index], **changes)
    return _model(config, files=files)


def _shard(config: CacheConfig, **changes) -> CacheConfig:
    return msgspec.structs.replace(config, shard=msgspec.structs.replace(config.shard, **changes))


@pytest.mark.parametrize(("path", "change"), FIELD_CHANGES, ids=[p for p, _ in FIELD_CHANGES])
def test_each_field_changes_the_fingerprint_and_is_named(path, change) -> None:
    config = make_config()
    changed = change(config)
    assert changed != config
    assert fingerprint(changed) != fingerprint(config)
    assert config_differences(config, changed) == [path]
    assert config_differences(changed, config) == [path]


def test_config_differences_names_every_differing_field_and_list_lengths() -> None:
    config = make_config()
    both = msgspec.structs.replace(_shard(config, tp_rank=0), dtype=None)
    assert config_differences(config, both) == ["dtype", "shard.tp_rank"]
    fewer = _model(config, files=config.model.files[:1])
    assert config_differences(config, fewer) == ["model.files (length 2 != 1)"]
    assert config_differences(config, config) == []


def test_a_difference_late_in_a_long_file_list_is_found() -> None:
    files = [FileIdentity(f"f{i}", i, SHA_A) for i in range(500)]
    config = make_config(model=ModelIdentity("/m", None, files))
    changed = _file(config, 499, size=10_000)
    assert config_differences(config, changed) == ["model.files[499].size"]
    assert fingerprint(config) != fingerprint(changed)


# ----------------------------------------------------------------------------- socket path


def test_socket_path_layout() -> None:
    assert socket_path("/run/wc/", "ns", "llama", None) == "/run/wc/ns.llama/cpu.sock"
    assert socket_path("/run/wc", "ns", "llama", "GPU-1234") == "/run/wc/ns.llama/gpu-GPU-1234.sock"


def test_socket_path_over_107_bytes_is_refused() -> None:
    directory = "/" + "d" * (MAX_SOCKET_PATH_BYTES - len("//n.c/cpu.sock"))
    assert len(socket_path(directory, "n", "c", None)) == MAX_SOCKET_PATH_BYTES
    with pytest.raises(ValueError, match="108 bytes, over the 107-byte limit"):
        socket_path(directory + "d", "n", "c", None)


@pytest.mark.parametrize("field", ["handles", "preloaded_weights_bytes"])
def test_deeply_nested_values_in_loose_reply_fields_are_a_protocol_error(field: str) -> None:
    head = {"op": "fetch_state_reply", "v": 1, "status": "ok"}
    # A map of one more entry than ``head``, whose last value nests 100,000 arrays deep.
    prefix = bytes([0x80 | (len(head) + 1)]) + msgspec.msgpack.encode(head)[1:]
    body = prefix + msgspec.msgpack.encode(field) + b"\x91" * 100_000 + b"\x01"
    with pytest.raises(ProtocolError, match="bad reply from daemon: maximum recursion depth"):
        decode_reply(body)


def test_deeply_nested_requests_are_a_protocol_error() -> None:
    for key in ("config", "transports", "extra"):
        prefix = b"\x84" + msgspec.msgpack.encode("op") + msgspec.msgpack.encode("fetch_state")
        prefix += msgspec.msgpack.encode("v") + b"\x01"
        body = prefix + msgspec.msgpack.encode(key) + b"\x91" * 100_000 + b"\x01"
        with pytest.raises(ProtocolError, match="^bad request: "):
            decode_request(body)


def test_replies_tolerate_fields_a_newer_daemon_adds_but_requests_do_not() -> None:
    from weightcache.protocol import PingReply, decode_reply, decode_request

    newer = msgspec.msgpack.encode({"op": "ping_reply", "v": 1, "pid": 7, "uptime": 3.5})
    assert decode_reply(newer) == PingReply(v=1, pid=7)
    with pytest.raises(ProtocolError, match="unknown field `uptime`"):
        decode_request(msgspec.msgpack.encode({"op": "ping", "v": 1, "uptime": 3.5}))
