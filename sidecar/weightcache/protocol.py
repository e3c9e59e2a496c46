"""The daemon <-> engine wire contract: frames, message schemas, CacheConfig.

Every frame is a 4-byte big-endian length followed by a MessagePack map. Every
message carries ``"v": 1``. Decoding is strict: unknown ops, unknown fields,
wrong types and out-of-range values are rejected by msgspec with a message that
names the offending field. Nothing a peer sends is ever unpickled.

This module is pure (no sockets); :mod:`weightcache.wire` moves frames.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Literal

import msgspec

from weightcache.plan import LoadPlan

PROTOCOL_VERSION = 1
LAYOUT_VERSION = 1
DEFAULT_MAX_FRAME = 64 * 1024 * 1024
# Requests are small (a config is ~150 bytes a checkpoint file; a load plan ~150 bytes a
# copy, ~7 MB for a 47,000-expert-tensor MoE model): the daemon refuses a request frame
# over this, and holds at most MAX_REQUEST_BYTES of unfinished request frames in all.
MAX_REQUEST_FRAME = 16 * 1024 * 1024
MAX_REQUEST_BYTES = 32 * 1024 * 1024
# A readopt request or reply is a few hundred bytes.
READOPT_MAX_FRAME = 64 * 1024
# A Unix socket path must fit sockaddr_un.sun_path (108 bytes with the NUL).
MAX_SOCKET_PATH_BYTES = 107

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
Sha256Hex = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
ShortStr = Annotated[str, msgspec.Meta(max_length=4096)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class ProtocolError(RuntimeError):
    """A peer sent something that violates the wire contract."""


# --------------------------------------------------------------------------- CacheConfig


class FileIdentity(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One checkpoint file: cheap to compute, changes whenever the file's tensors do."""

    name: ShortStr
    size: NonNegInt
    header_sha256: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]


class ModelIdentity(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    path: ShortStr
    revision: ShortStr | None
    files: Annotated[list[FileIdentity], msgspec.Meta(max_length=100_000)]


class ShardSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tp_size: PosInt = 1
    tp_rank: NonNegInt = 0
    plan: ShortStr | None = None


class CacheConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything that decides which bytes an engine gets.

    Two processes agree on the weights iff their configs are equal field by
    field; the fingerprint is a stable digest of exactly that. Not torch's
    version: the bytes and their layout do not depend on it, and daemon and
    engine images come from different teams. The one transport that needs
    both sides on the same torch (``torch_ipc``) checks it itself.
    """

    model: ModelIdentity
    dtype: Annotated[str, msgspec.Meta(max_length=32)] | None
    shard: ShardSpec
    device_capability: Annotated[str, msgspec.Meta(max_length=32)] | None
    layout_version: PosInt = LAYOUT_VERSION
    # An engine's layout: the hash of the load plan that built it from these weights
    # (weightcache.plan); None: the checkpoint's own layout.
    plan: Sha256Hex | None = None


def canonical_json(config: CacheConfig) -> bytes:
    """Sorted-key JSON: the same config always gives the same bytes."""
    return msgspec.json.encode(msgspec.to_builtins(config), order="sorted")


def fingerprint(config: CacheConfig) -> str:
    return hashlib.sha256(canonical_json(config)).hexdigest()


def config_differences(expected: Any, actual: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every field where two configs differ (the whole config, no prefix cut)."""
    if isinstance(expected, msgspec.Struct):
        expected = msgspec.to_builtins(expected)
    if isinstance(actual, msgspec.Struct):
        actual = msgspec.to_builtins(actual)
    if isinstance(expected, dict) and isinstance(actual, dict):
        out: list[str] = []
        for key in sorted(set(expected) | set(actual)):
            path = f"{prefix}.{key}" if prefix else key
            out += config_differences(expected.get(key), actual.get(key), path)
        return out
    if isinstance(expected, list) and isinstance(actual, list):
        if len(expected) != len(actual):
            return [f"{prefix} (length {len(expected)} != {len(actual)})"]
        out = []
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            out += config_differences(e, a, f"{prefix}[{i}]")
        return out
    return [] if expected == actual else [prefix]


# --------------------------------------------------------------------------- layout


class TensorGroup(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``count`` tensors of one dtype and shape, evenly spaced in one allocation.

    One grouped ``view(count, ...).unbind(0)`` yields them all, so attach cost
    grows with the number of groups, not tensors.
    """

    allocation: NonNegInt
    dtype: Annotated[str, msgspec.Meta(max_length=32)]
    shape: Annotated[list[NonNegInt], msgspec.Meta(max_length=32)]
    offset: NonNegInt
    step: NonNegInt
    names: Annotated[list[ShortStr], msgspec.Meta(min_length=1)]
    # Element strides of each tensor over its dense bytes; None: row-major (contiguous).
    stride: Annotated[list[NonNegInt], msgspec.Meta(max_length=32)] | None = None


class Layout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    allocation_sizes: list[NonNegInt]
    groups: list[TensorGroup]
    # Tied weights: extra name -> the name whose storage it shares.
    aliases: dict[ShortStr, ShortStr] = {}


# --------------------------------------------------------------------------- requests


class _Message(msgspec.Struct, tag_field="op", forbid_unknown_fields=True):
    v: Literal[1]


class PingRequest(_Message, tag="ping"):
    pass


class StatusRequest(_Message, tag="status"):
    pass


class FetchStateRequest(_Message, tag="fetch_state"):
    # None: accept whatever the daemon holds (tools, demos). Engines pass theirs.
    config: CacheConfig | None
    transports: Annotated[list[Name], msgspec.Meta(min_length=1, max_length=16)]


class FetchLayoutRequest(_Message, tag="fetch_layout"):
    """An engine's own layout of the daemon's weights, by the hash of its load plan.

    ``config`` is the checkpoint layout's, as in ``fetch_state``. Without
    ``plan`` the daemon serves a layout it holds or answers ``unknown_plan``;
    with it, the daemon checks that the plan hashes to ``plan_hash`` and builds
    the layout if it does not hold it yet (answering ``retryable`` meanwhile).
    """

    config: CacheConfig
    plan_hash: Sha256Hex
    transports: Annotated[list[Name], msgspec.Meta(min_length=1, max_length=16)]
    plan: LoadPlan | None = None


class ProbeRequest(_Message, tag="probe"):
    """The kubelet's liveness or readiness question (``weightcache-sidecar probe``)."""

    check: Literal["live", "ready"]


Request = PingRequest | StatusRequest | FetchStateRequest | FetchLayoutRequest | ProbeRequest


# --------------------------------------------------------------------------- replies


class _ReplyMessage(msgspec.Struct, tag_field="op"):
    """Replies tolerate fields they do not know, so a newer daemon can add
    optional fields without breaking older engines; requests stay strict."""

    v: Literal[1]


class LayoutStatus(msgspec.Struct):
    """One layout a daemon holds or builds: the checkpoint's (``plan`` None) or an engine's."""

    fingerprint: str
    plan: str | None
    state: Literal["building", "ready", "failed"]
    bytes: NonNegInt
    expected_bytes: NonNegInt
    # disk | readopted | peer (the checkpoint layout, or a layout re-adopted or seeded), or
    # resident: built from the checkpoint layout in memory.
    source: str | None = None
    seconds: float | None = None
    error: str | None = None


class RetainedStatus(msgspec.Struct):
    """A layout of an earlier generation the daemon keeps (daemon/generations.py): taken back
    from the engines that map it, served to engines asking for exactly its config."""

    spec_hash: str  # the generation whose daemon wrote its manifest ("" if unknown)
    fingerprint: str
    plan: str | None
    bytes: NonNegInt
    expected_bytes: NonNegInt
    # Seconds since an engine was last found holding it (or was served it).
    unheld_seconds: float = 0.0


class DaemonStatus(msgspec.Struct):
    state: Literal["loading", "ready", "error"]
    pid: NonNegInt
    device: str
    gpu: str
    transport_backend: str | None
    preloaded_weights_bytes: NonNegInt
    expected_bytes: NonNegInt
    fingerprint: str | None
    load_seconds: float | None
    load_source: Literal["disk", "readopted", "peer"] | None
    readopted: bool
    socket: str
    clients_served: NonNegInt
    error: str | None
    # Why the weights came from where they did (re-adopted, or why not).
    load_reason: str | None = None
    # load_source "peer": the GPU (UUID, or "cpu") of the daemon the weights were copied from.
    seeded_from: str | None = None
    # Every layout held or being built; the byte counts above sum the ready ones.
    layouts: list[LayoutStatus] = []
    # What went wrong that costs only a successor, while this daemon serves: e.g. its
    # manifest could not be written (a full filesystem), so a restart reloads from disk.
    warning: str | None = None
    # What a loading daemon is doing: "re-adopting" (asking engines for the weights they map;
    # it has not decided yet whether it takes them back), "loading" (from a neighbour or
    # the disk), "waiting-for-room" (the new generation does not fit beside kept ones).
    phase: str | None = None
    # Earlier generations kept beside these weights (daemon/generations.py).
    retained: list[RetainedStatus] = []
    # The device's memory now (daemon/devicememory.py); None where it cannot be read.
    memory_total_bytes: NonNegInt | None = None
    memory_free_bytes: NonNegInt | None = None
    # --rollout auto: a load waits until the free memory holds it beside kept generations.
    waiting_for_room: bool = False


class PingReply(_ReplyMessage, tag="ping_reply"):
    pid: NonNegInt


class StatusReply(_ReplyMessage, tag="status_reply"):
    status: DaemonStatus


class ErrorReply(_ReplyMessage, tag="error"):
    error: str
    # The same request may succeed later (busy, still loading).
    retryable: bool = False


class FetchStateReply(_ReplyMessage, tag="fetch_state_reply"):
    """``preloaded_weights_bytes`` and ``transport_backend`` are loose on purpose.

    Old daemons omit ``transport_backend`` (meaning ``torch_ipc``) and may omit
    the byte count (meaning 0); a present byte count of the wrong type is an
    error the client reports (see :func:`validated_preloaded_bytes`).
    """

    # unknown_plan: a fetch_layout by hash alone for a layout the daemon does not hold.
    status: Literal["ok", "mismatch", "error", "unknown_plan"]
    pid: NonNegInt = 0
    config: CacheConfig | None = None
    fingerprint: str | None = None
    transport_backend: str | None = None
    preloaded_weights_bytes: Any = None
    layout: Layout | None = None
    # Transport-specific, typed by the backend's own schema.
    handles: Any = None
    mismatched_fields: list[str] = []
    error: str | None = None
    # With status "error": the same request may succeed later (still loading).
    retryable: bool = False


class ProbeReply(_ReplyMessage, tag="probe_reply"):
    ok: bool
    message: str = ""


Reply = PingReply | StatusReply | ErrorReply | FetchStateReply | ProbeReply


# --------------------------------------------------------------------------- hand-back
# The reverse direction: a restarting daemon asks an engine (on the engine's
# own socket) for the fds of the weights it holds. Kept out of Request/Reply
# so neither side ever accepts the other's messages.

Fingerprint = Sha256Hex


class ReadoptRequest(_Message, tag="readopt"):
    # The daemon socket's file name (gpu-<UUID>.sock): engines attached to
    # another GPU's daemon in the same directory must not answer.
    socket_name: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_SOCKET_PATH_BYTES)]
    fingerprint: Fingerprint


class ReadoptReply(_Message, tag="readopt_reply"):
    """``ok`` carries one fd per allocation (SCM_RIGHTS, in allocation order)."""

    status: Literal["ok", "refused"]
    pid: NonNegInt
    allocation_sizes: list[NonNegInt] = []
    error: str | None = None


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_readopt_request_decoder = msgspec.msgpack.Decoder(ReadoptRequest)
_readopt_reply_decoder = msgspec.msgpack.Decoder(ReadoptReply)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_request(body: bytes) -> Request:
    """Strictly decode a client request; raise ProtocolError naming what is wrong."""
    try:
        return _request_decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as exc:
        raise ProtocolError(f"bad request: {exc}") from None


def decode_reply(body: bytes) -> Reply:
    try:
        return _reply_decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as exc:
        # RecursionError: deeply nested values in the loosely typed fields.
        raise ProtocolError(f"bad reply from daemon: {exc}") from None


def decode_readopt_request(body: bytes) -> ReadoptRequest:
    try:
        return _readopt_request_decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProtocolError(f"bad readopt request: {exc}") from None


def decode_readopt_reply(body: bytes) -> ReadoptReply:
    try:
        return _readopt_reply_decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProtocolError(f"bad readopt reply from engine: {exc}") from None


def validated_preloaded_bytes(value: Any) -> int:
    """The engine's rule: a non-bool, non-negative int; a missing field means 0."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise RuntimeError(
            f"daemon sent preloaded_weights_bytes of type {type(value).__name__}; expected int"
        )
    if value < 0:
        raise RuntimeError(f"daemon sent negative preloaded_weights_bytes ({value})")
    return value


def socket_path(socket_dir: str, namespace: str, name: str, gpu_uuid: str | None) -> str:
    """``<socketDir>/<namespace>.<name>/gpu-<UUID>.sock`` (``cpu.sock`` for CPU)."""
    leaf = "cpu.sock" if gpu_uuid is None else f"gpu-{gpu_uuid}.sock"
    path = f"{socket_dir.rstrip('/')}/{namespace}.{name}/{leaf}"
    check_socket_path(path)
    return path


def check_socket_path(path: str) -> None:
    size = len(path.encode())
    if size > MAX_SOCKET_PATH_BYTES:
        raise ValueError(
            f"socket path is {size} bytes, over the {MAX_SOCKET_PATH_BYTES}-byte limit of "
            f"a Unix socket address: {path!r} (use a shorter socket dir)"
        )
