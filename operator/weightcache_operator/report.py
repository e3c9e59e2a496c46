"""Decode the `weightcache.dev/report` annotation a daemon writes on its pod.

The annotation is written by a process the operator does not control, so
decoding is strict about types and ranges and bounded in size; anything off is
a `ReportError` naming what was wrong. Unknown fields are tolerated so a newer
daemon can add some without breaking an older operator.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

MAX_REPORT_BYTES = 64 * 1024
MAX_GPU_ENTRIES = 64

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
Text = Annotated[str, msgspec.Meta(max_length=1024)]
GpuKey = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")]


class ReportError(ValueError):
    """The annotation is not a valid report; the message says why."""


class GpuReport(msgspec.Struct, frozen=True, rename="camel"):
    state: Literal["Loading", "Ready", "Error"]
    preloaded_weights_bytes: NonNegInt
    expected_bytes: NonNegInt
    transport: Text = ""
    fingerprint: Text = ""
    load_seconds: Annotated[float, msgspec.Meta(ge=0)] | None = None
    readopted: bool = False
    message: Text = ""


class Report(msgspec.Struct, frozen=True, rename="camel"):
    v: Literal[1]
    spec_hash: Text
    gpus: Annotated[dict[GpuKey, GpuReport], msgspec.Meta(max_length=MAX_GPU_ENTRIES)]
    reported_at: Text = ""


def parse_report(raw: str) -> Report:
    if len(raw.encode()) > MAX_REPORT_BYTES:
        raise ReportError(f"report is {len(raw.encode())} bytes, over the {MAX_REPORT_BYTES} cap")
    try:
        return msgspec.json.decode(raw, type=Report)
    except msgspec.ValidationError as exc:
        raise ReportError(f"invalid report: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ReportError(f"report is not JSON: {exc}") from None
