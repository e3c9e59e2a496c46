"""Daemon report builders shared by the operator's unit tests (through the one schema)."""

from __future__ import annotations

from typing import Any

import msgspec

from weightcache.report import DeviceReport, annotation_key, encode_report

GIB = 1 << 30


def device_report(
    device: str,
    spec_hash: str,
    node: str = "node-a",
    *,
    state: str = "Ready",
    preloaded: int = GIB,
    expected: int = GIB,
    **fields: Any,
) -> DeviceReport:
    defaults: dict[str, Any] = {
        "transport": "vmm_fd", "fingerprint": "f" * 64, "load_seconds": 1.5,
        "readopted": False, "message": "", "reported_at": "2026-01-01T00:00:00Z",
    }
    return DeviceReport(
        v=1, device=device, node=node, spec_hash=spec_hash, state=state,  # type: ignore[arg-type]
        preloaded_weights_bytes=preloaded, expected_bytes=expected, **{**defaults, **fields},
    )


def annotations(*reports: DeviceReport) -> dict[str, str]:
    """The pod annotations the daemons would have written for `reports`."""
    return {annotation_key(r.device): encode_report(r) for r in reports}


def raw_report(device: str, spec_hash: str, **changes: Any) -> str:
    """A report's JSON with camelCase fields changed or added (for malformed input)."""
    body = msgspec.to_builtins(device_report(device, spec_hash))
    body.update(changes)
    return msgspec.json.encode(body).decode()
