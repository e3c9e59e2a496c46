"""The daemon's report to the operator: one annotation per device on the daemon's own pod.

Each daemon process writes ``weightcache.dev/report.<device>`` (``<device>`` is
its GPU UUID, or ``cpu``) on its own pod with a merge patch that needs no prior
read: daemons never read pods (their token cannot), and the daemons sharing a
pod never race for one annotation. The operator decodes every such annotation
of a daemon pod with :func:`decode_pod_reports`.

The daemon is not trusted by the operator, so decoding is strict: types,
ranges and sizes are bounded to what the WeightCache status schema accepts
(int64 byte counts, short strings), and anything off is a :class:`ReportError`
naming what was wrong. Unknown fields are tolerated so that a newer daemon may
add some without breaking an older operator.

Torch-free: the operator image imports this module.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping
from typing import Annotated, Literal

import msgspec

GROUP = "weightcache.dev"
ANNOTATION_PREFIX = f"{GROUP}/report."
# The operator passes the spec's hash to each daemon container in this variable;
# the daemon echoes it so the operator can tell which spec its weights are for.
SPEC_HASH_ENV = "WEIGHTCACHE_SPEC_HASH"
NODE_NAME_ENV = "NODE_NAME"
REPORT_VERSION = 1

MAX_ANNOTATION_BYTES = 4096
MAX_DEVICES = 64
# No single device holds 16 TiB; keeps every sum over a fleet inside int64.
MAX_DEVICE_BYTES = 1 << 44
MAX_MESSAGE_CHARS = 512
# The name part of an annotation key is at most 63 characters: "report." + 56.
DEVICE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,55}$"
_DEVICE_RE = re.compile(DEVICE_PATTERN)

Bytes = Annotated[int, msgspec.Meta(ge=0, le=MAX_DEVICE_BYTES)]
Hash = Annotated[str, msgspec.Meta(pattern=r"^([0-9a-f]{64})?$")]
Device = Annotated[str, msgspec.Meta(pattern=DEVICE_PATTERN)]
NodeName = Annotated[str, msgspec.Meta(max_length=253)]
Short = Annotated[str, msgspec.Meta(max_length=64)]
Message = Annotated[str, msgspec.Meta(max_length=MAX_MESSAGE_CHARS)]
Seconds = Annotated[float, msgspec.Meta(ge=0, le=1e9)]

# What a loading daemon is doing (``loadPhase``). While it re-adopts it has not decided yet
# whether it takes back the weights the engines on its node map: the operator keeps their
# gates meanwhile (gate.py, the carry). Other values say it no longer re-adopts; a value an
# older operator does not know means the same.
PHASE_READOPTING = "re-adopting"
PHASE_LOADING = "loading"
PHASE_WAITING_FOR_ROOM = "waiting-for-room"
# Kept generations listed in one report (each about 230 bytes: four stay well inside the
# 4096-byte annotation beside a full message); `retainedOmitted` counts the rest.
MAX_RETAINED_REPORTED = 4


class ReportError(ValueError):
    """An annotation is not a valid report; the message names the key and the field."""


class RetainedReport(msgspec.Struct, frozen=True, rename="camel"):
    """Weights of an earlier generation a daemon took back from the engines that map them
    and keeps (daemon/generations.py): served to an engine asking for exactly their config,
    dropped once no engine holds them."""

    spec_hash: Hash
    # The CacheConfig fingerprint of the layout kept (an engine layout's has its plan).
    fingerprint: Hash
    preloaded_weights_bytes: Bytes
    expected_bytes: Bytes


class DeviceReport(msgspec.Struct, frozen=True, rename="camel"):
    """What one daemon holds on one device, as the operator reads it."""

    v: Literal[1]
    device: Device
    # The node the daemon runs on (from the downward API); the operator
    # checks it against the pod's own spec.nodeName.
    node: NodeName
    spec_hash: Hash
    state: Literal["Loading", "Ready", "Error"]
    preloaded_weights_bytes: Bytes
    expected_bytes: Bytes
    transport: Short = ""
    fingerprint: Hash = ""
    load_seconds: Seconds | None = None
    readopted: bool = False
    message: Message = ""
    # Where the weights came from: disk | readopted | peer ("" from older daemons), and for
    # peer the GPU (UUID, or cpu) of the neighbour daemon they were copied from.
    load_source: Short = ""
    seeded_from: Short = ""
    reported_at: Short = ""
    # PHASE_*: what a Loading daemon is doing ("" when it is not loading, or an older daemon).
    load_phase: Short = ""
    # Earlier generations kept beside the current one, at most MAX_RETAINED_REPORTED.
    retained: Annotated[list[RetainedReport], msgspec.Meta(max_length=MAX_RETAINED_REPORTED)] = []
    retained_omitted: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0
    # The device's memory (CUDA: cudaMemGetInfo; CPU: the daemon's cgroup, else the node's
    # meminfo); None from older daemons. Rewritten between status changes only on 1 GiB moves.
    memory_total_bytes: Bytes | None = None
    memory_free_bytes: Bytes | None = None
    # The new generation does not fit beside the kept ones (--rollout auto): the daemon
    # waits for room; the operator then evicts the node's engines on older generations.
    waiting_for_room: bool = False
    # Random, fresh in each daemon process: a report left on the pod by a process that has
    # since died is told from its successor's ("" from older daemons).
    instance: Annotated[str, msgspec.Meta(pattern=r"^([0-9a-f]{16})?$")] = ""

    def holding(self, spec_hash: str) -> RetainedReport | None:
        """The kept weights of generation ``spec_hash``, if this device keeps them."""
        return next((r for r in self.retained if r.spec_hash == spec_hash), None)


def annotation_key(device: str) -> str:
    """``weightcache.dev/report.<device>``; ``ValueError`` for a device the key cannot carry."""
    if not _DEVICE_RE.match(device):
        raise ValueError(f"device {device!r} does not fit an annotation key ({DEVICE_PATTERN})")
    return ANNOTATION_PREFIX + device


def encode_report(report: DeviceReport) -> str:
    return msgspec.json.encode(report).decode()


def decode_report(key: str, raw: str) -> DeviceReport:
    """One annotation's report; its ``device`` must be the one its key names."""
    size = len(raw.encode())
    if size > MAX_ANNOTATION_BYTES:
        raise ReportError(f"{key}: {size} bytes, over the {MAX_ANNOTATION_BYTES}-byte cap")
    try:
        report = msgspec.json.decode(raw, type=DeviceReport)
    except msgspec.ValidationError as exc:
        raise ReportError(f"{key}: invalid report: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ReportError(f"{key}: not JSON: {exc}") from None
    if ANNOTATION_PREFIX + report.device != key:
        raise ReportError(f"{key}: reports device {report.device!r}, not the key's")
    return report


def report_annotations(annotations: Mapping[str, str]) -> dict[str, str]:
    """The report annotations among a pod's annotations, by key."""
    return {k: v for k, v in annotations.items() if k.startswith(ANNOTATION_PREFIX)}


def decode_pod_reports(reports: Mapping[str, str]) -> dict[str, DeviceReport]:
    """Every device's report from a pod's report annotations (see :func:`report_annotations`)."""
    if len(reports) > MAX_DEVICES:
        raise ReportError(f"{len(reports)} report annotations, over the {MAX_DEVICES} cap")
    decoded = (decode_report(key, raw) for key, raw in sorted(reports.items()))
    return {r.device: r for r in decoded}


def rfc3339_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
