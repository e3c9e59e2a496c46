"""Daemon report builders shared by the operator's unit tests."""

from __future__ import annotations

import json
from typing import Any

GIB = 1 << 30


def gpu_entry(
    state: str = "Ready", preloaded: int = GIB, expected: int = GIB, **extra: Any
) -> dict[str, Any]:
    return {
        "state": state,
        "preloadedWeightsBytes": preloaded,
        "expectedBytes": expected,
        "transport": "vmm_fd",
        "fingerprint": "f" * 64,
        "loadSeconds": 1.5,
        "readopted": False,
        "message": "",
        **extra,
    }


def report(spec_hash: str, gpus: dict[str, dict[str, Any]]) -> str:
    return json.dumps(
        {"v": 1, "specHash": spec_hash, "gpus": gpus, "reportedAt": "2026-01-01T00:00:00Z"}
    )
