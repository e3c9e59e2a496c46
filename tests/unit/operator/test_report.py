"""The operator's report decoder, and its agreement with the daemon's reporter."""

from __future__ import annotations

import json

import pytest

from tests.unit.operator.builders import gpu_entry, report
from weightcache.daemon import reporter
from weightcache_operator.report import MAX_REPORT_BYTES, ReportError, parse_report


def test_valid_report() -> None:
    parsed = parse_report(report("h", {"GPU-1": gpu_entry(loadSeconds=None)}))
    assert parsed.spec_hash == "h"
    entry = parsed.gpus["GPU-1"]
    assert (entry.state, entry.preloaded_weights_bytes, entry.load_seconds) == (
        "Ready",
        1 << 30,
        None,
    )


def test_unknown_fields_are_tolerated() -> None:
    raw = json.loads(report("h", {"cpu": gpu_entry(newField=1)}))
    raw["extra"] = {"x": 1}
    assert parse_report(json.dumps(raw)).gpus["cpu"].state == "Ready"


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ("", "not JSON"),
        ("{", "not JSON"),
        ("null", "invalid report"),
        (json.dumps({"specHash": "h", "gpus": {}}), "v"),
        (json.dumps({"v": 1, "gpus": {}}), "specHash"),
        (report("h", {"GPU-0": gpu_entry(state="Sleeping")}), "state"),
        (report("h", {"GPU-0": gpu_entry(preloaded=-1)}), "preloadedWeightsBytes"),
        (report("h", {"GPU-0": gpu_entry(expected="9")}), "expectedBytes"),
        (report("h", {"GPU-0": gpu_entry(preloaded=True)}), "preloadedWeightsBytes"),
        (report("h", {"GPU-0": gpu_entry(loadSeconds=-1.0)}), "loadSeconds"),
        (report("h", {"bad key!": gpu_entry()}), "gpus"),
        (report("h", {f"GPU-{i}": gpu_entry() for i in range(65)}), "gpus"),
        (report("h", {"GPU-0": gpu_entry(message="m" * 2000)}), "message"),
    ],
)
def test_malformed_reports_name_the_problem(raw: str, why: str) -> None:
    with pytest.raises(ReportError) as err:
        parse_report(raw)
    assert why in str(err.value)


def test_oversized_report_is_rejected_before_decoding() -> None:
    raw = report("h", {"GPU-0": gpu_entry(message="")}) + " " * MAX_REPORT_BYTES
    with pytest.raises(ReportError, match="over the 65536 cap"):
        parse_report(raw)


def test_what_the_reporter_writes_the_operator_reads() -> None:
    status = {
        "state": "ready",
        "gpu": "GPU-abc",
        "preloaded_weights_bytes": 90_000_000,
        "expected_bytes": 90_000_000,
        "transport_backend": "memfd",
        "fingerprint": "a" * 64,
        "load_seconds": 0.8,
        "readopted": True,
        "error": None,
    }
    key, entry = reporter.gpu_entry(status)
    annotation = reporter.merge_report(None, key, entry, "spec-h", "2026-01-01T00:00:00Z")
    assert annotation is not None
    parsed = parse_report(annotation)
    assert parsed.spec_hash == "spec-h"
    got = parsed.gpus["GPU-abc"]
    assert (
        got.state,
        got.preloaded_weights_bytes,
        got.expected_bytes,
        got.transport,
        got.readopted,
        got.load_seconds,
    ) == ("Ready", 90_000_000, 90_000_000, "memfd", True, 0.8)
