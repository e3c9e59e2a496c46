"""Merging fleet-scale runs into one results file, and its table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks import scale_report


def wave(name: str, converged: bool = True) -> dict[str, Any]:
    return {"wave": name, "converged": converged, "report_writes": 80,
            "total_s": 0.5 if converged else None, "status_bytes": 1000,
            "gate_latency_s": {"p50": 0.1, "p99": 0.4},
            "operator": {"writes": 40, "writes_per_change": 0.5, "status_writes": 3,
                         "peak_rss_mib": 100.0, "cpu_s": 1.5}}


def run(sizes: dict[str, list[dict[str, Any]]], host: str) -> dict[str, Any]:
    return {"machine": {"hostname": host}, "date": "2026-12-01",
            "suites": {"scale": {"sizes": {n: {"waves": w} for n, w in sizes.items()}}}}


def test_a_run_adds_its_sizes_to_its_arm_and_replaces_an_earlier_measurement() -> None:
    results = scale_report.merge({}, "after", run({"100": [wave("ready")]}, "a"))
    results = scale_report.merge(results, "before", run({"10": [wave("ready")]}, "a"))
    again = run({"1000": [wave("ready")], "100": [wave("spec")]}, "b")
    results = scale_report.merge(results, "after", again)
    assert list(results["arms"]) == ["after", "before"]
    assert list(results["arms"]["after"]) == ["100", "1000"]  # by fleet size, not as added
    assert results["arms"]["after"]["100"]["waves"][0]["wave"] == "spec"
    assert results["machine"] == {"hostname": "b"}


def test_the_table_has_a_row_per_wave_and_says_which_did_not_converge() -> None:
    results = scale_report.merge(
        {}, "after", run({"1000": [wave("ready"), wave("spec", converged=False)]}, "a"))
    lines = scale_report.table(results).splitlines()
    assert len(lines) == 2 + 2
    assert all(line.count("|") == len(scale_report.COLUMNS) + 1 for line in lines)
    assert "| after | 1000 | ready | 80 | 40 | 0.5 | 3 | 0.1 / 0.4 | 0.5 |" in lines[2]
    assert "not converged" in lines[3]


def test_the_command_writes_the_merged_file(tmp_path: Path, capsys: Any) -> None:
    out, first = tmp_path / "scale.json", tmp_path / "run.json"
    first.write_text(json.dumps(run({"10": [wave("loading")]}, "a")))
    assert scale_report.main([str(out), "--add", "after", str(first)]) == 0
    assert json.loads(out.read_text())["arms"]["after"]["10"]["waves"][0]["wave"] == "loading"
    assert "| after | 10 | loading |" in capsys.readouterr().out


def test_waves_that_watched_bound_engines_get_a_table_of_their_own() -> None:
    model = wave("model") | {"rollout_s": 213.2, "bound_engines": {
        "gates_closed_while_weights_held": 0, "gates_opened_without_weights": 0,
        "open_after_weights_left_s": {"p50": 0.0, "p99": 1.2, "max": 2.5, "n": 1000},
        "wrong_examples": {}}}
    results = scale_report.merge({}, "bound", run({"1000": [wave("ready"), model]}, "a"))
    text = scale_report.table(results)
    first, second = text.split("\n\n")
    assert len(first.splitlines()) == 2 + 2
    assert second.splitlines()[2] == (
        "| bound | 1000 | model | 213.2 | 0 | 0 | 0.0 / 1.2 / 2.5 | 0.04 | 100.0 |")
    plain = scale_report.merge({}, "after", run({"10": [wave("ready")]}, "a"))
    assert "\n\n" not in scale_report.table(plain)


def test_a_surge_wave_gets_a_table_of_its_own() -> None:
    surge = wave("surge") | {
        "rollout_s": 301.5,
        "bound_engines": {"gates_closed_while_weights_held": 0,
                          "gates_opened_without_weights": 0,
                          "open_after_weights_left_s": None, "wrong_examples": {}},
        "gate_closings": {"count": 0, "engines": 0, "examples": {}},
        "surge": {"nodes_rolled": 1000, "carry_seconds": 120.0,
                  "handover_s": {"p50": 0.5, "p99": 2.0, "max": 3.25, "n": 1000},
                  "handovers_past_carry": 0, "max_nodes_handing_over": 97,
                  "max_unavailable_nodes": 100, "examples_past_carry": []}}
    results = scale_report.merge({}, "surge", run({"1000": [wave("ready"), surge]}, "a"))
    waves_, bound, surged = scale_report.table(results).split("\n\n")
    assert len(bound.splitlines()) == 3  # the surge wave watched bound engines too
    assert surged.splitlines()[2] == (
        "| surge | 1000 | surge | yes | 301.5 | 0 | 0 | 0 | 0.5 / 2.0 / 3.25 | 0 | 97 (100) "
        "| 0.04 | 100.0 |")
    assert all(line.count("|") == len(scale_report.SURGE_COLUMNS) + 1
               for line in surged.splitlines())
