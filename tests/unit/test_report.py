"""The report schema: what the daemon writes and the operator reads, bounded and strict."""

from __future__ import annotations

import pytest

from tests.unit.operator.builders import device_report, raw_report
from weightcache.report import (
    ANNOTATION_PREFIX,
    MAX_ANNOTATION_BYTES,
    MAX_DEVICE_BYTES,
    MAX_DEVICES,
    ReportError,
    annotation_key,
    decode_pod_reports,
    decode_report,
    encode_report,
    report_annotations,
)

HASH = "a" * 64


def test_round_trip_with_camel_case_fields() -> None:
    report = device_report("GPU-1", HASH, "node-a", load_seconds=None)
    raw = encode_report(report)
    assert '"preloadedWeightsBytes"' in raw and '"specHash"' in raw
    assert decode_report(annotation_key("GPU-1"), raw) == report


def test_unknown_fields_are_tolerated() -> None:
    raw = raw_report("cpu", HASH, newField=1)
    assert decode_report(annotation_key("cpu"), raw).device == "cpu"


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"state": "Sleeping"}, "state"),
        ({"preloadedWeightsBytes": -1}, "preloadedWeightsBytes"),
        ({"preloadedWeightsBytes": MAX_DEVICE_BYTES + 1}, "preloadedWeightsBytes"),
        ({"preloadedWeightsBytes": 2**64 - 1}, "preloadedWeightsBytes"),
        ({"expectedBytes": "9"}, "expectedBytes"),
        ({"preloadedWeightsBytes": True}, "preloadedWeightsBytes"),
        ({"loadSeconds": -1.0}, "loadSeconds"),
        ({"message": "m" * 2000}, "message"),
        ({"fingerprint": "not-a-hash"}, "fingerprint"),
        ({"specHash": "x" * 64}, "specHash"),
        ({"node": "n" * 300}, "node"),
        ({"v": 2}, "v"),
        # Issue 42's fields: kept generations (4 at most, each bounded), memory, instance.
        ({"retained": [{"specHash": HASH, "fingerprint": HASH, "preloadedWeightsBytes": 1,
                        "expectedBytes": 1}] * 5}, "retained"),
        ({"retained": [{"specHash": "x", "fingerprint": HASH, "preloadedWeightsBytes": 1,
                        "expectedBytes": 1}]}, "specHash"),
        ({"retainedOmitted": -1}, "retainedOmitted"),
        ({"memoryFreeBytes": MAX_DEVICE_BYTES + 1}, "memoryFreeBytes"),
        ({"waitingForRoom": "yes"}, "waitingForRoom"),
        ({"instance": "not hex"}, "instance"),
        ({"loadPhase": "p" * 65}, "loadPhase"),
    ],
)
def test_out_of_bounds_fields_are_named(changes: dict, field: str) -> None:
    with pytest.raises(ReportError, match=field):
        decode_report(annotation_key("GPU-0"), raw_report("GPU-0", HASH, **changes))


def test_size_key_and_count_are_bounded() -> None:
    key = annotation_key("GPU-0")
    with pytest.raises(ReportError, match="over the"):
        decode_report(key, raw_report("GPU-0", HASH) + " " * MAX_ANNOTATION_BYTES)
    with pytest.raises(ReportError, match="not the key's"):
        decode_report(key, raw_report("GPU-1", HASH))
    with pytest.raises(ReportError, match="not JSON"):
        decode_report(key, "{")
    many = {annotation_key(f"GPU-{i}"): raw_report(f"GPU-{i}", HASH) for i in range(MAX_DEVICES)}
    assert len(decode_pod_reports(many)) == MAX_DEVICES
    many[annotation_key("GPU-x")] = raw_report("GPU-x", HASH)
    with pytest.raises(ReportError, match="cap"):
        decode_pod_reports(many)


@pytest.mark.parametrize("device", ["", "bad/key", "x" * 57, "-lead"])
def test_annotation_key_refuses_what_a_label_key_cannot_carry(device: str) -> None:
    with pytest.raises(ValueError, match="annotation key"):
        annotation_key(device)


def test_annotation_key_fits_a_real_gpu_uuid() -> None:
    key = annotation_key("GPU-8f8e5a3c-1b2d-4e5f-9a8b-7c6d5e4f3a2b")
    assert len(key.split("/", 1)[1]) <= 63


def test_report_annotations_pick_only_reports() -> None:
    annotations = {
        annotation_key("cpu"): "{}",
        "weightcache.dev/report": "old",
        "weightcache.dev/spec-hash": "h",
        "x/y": "z",
    }
    assert report_annotations(annotations) == {annotation_key("cpu"): "{}"}
    assert all(k.startswith(ANNOTATION_PREFIX) for k in report_annotations(annotations))
