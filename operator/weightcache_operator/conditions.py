"""Kubernetes-style conditions: keep lastTransitionTime unless the status flips."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def merge_conditions(
    old: Iterable[Mapping[str, Any]], new: Iterable[Mapping[str, Any]], now: str
) -> list[dict[str, Any]]:
    """`new` conditions (type, status, reason, message, ...) with transition times carried over."""
    previous = {c.get("type"): c for c in old}
    merged = []
    for cond in new:
        before = previous.get(cond["type"])
        same = before is not None and before.get("status") == cond["status"]
        stamp = before.get("lastTransitionTime") if same else None
        merged.append({**cond, "lastTransitionTime": stamp or now})
    return merged


def condition(type_: str, ok: bool, reason: str, message: str, **extra: Any) -> dict[str, Any]:
    return {
        "type": type_,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
        **extra,
    }
