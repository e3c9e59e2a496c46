"""Median with min and max: the one summary every figure uses."""

from __future__ import annotations

import statistics


def summary(samples: list[float], unit: str) -> dict:
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "runs": len(samples),
        "unit": unit,
        "samples": samples,
    }
