"""Merge fleet-scale runs into one results file and print its table.

    python -m benchmarks.scale_report results/polyglot-scale.json --add after run-1000.json
    python -m benchmarks.scale_report results/polyglot-scale.json     # the README table

Each run is what `python -m benchmarks.run --suite scale --out RUN` wrote; its fleet
sizes go under the named arm ("before", "after"), replacing a size measured earlier.
The results file keeps the machine of the last run added.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

COLUMNS = ("arm", "nodes", "wave", "reports", "writes", "per change", "status writes",
           "gate p50 / p99 s", "all right s", "RSS", "CPU s", "status B")


def merge(results: dict[str, Any], arm: str, run: dict[str, Any]) -> dict[str, Any]:
    """`results` with the run's fleet sizes under `arm`; a pure function of both."""
    sizes = run["suites"]["scale"]["sizes"]
    arms = {k: dict(v) for k, v in results.get("arms", {}).items()}
    arms.setdefault(arm, {}).update(sizes)
    ordered = {a: dict(sorted(s.items(), key=lambda kv: int(kv[0]))) for a, s in arms.items()}
    return {**results, "machine": run["machine"], "date": run["date"], "arms": ordered}


def _cell(value: Any) -> str:
    return "–" if value is None else str(value)


def rows(results: dict[str, Any]) -> list[list[str]]:
    """One row per arm, fleet size and wave."""
    out = []
    for arm, sizes in results.get("arms", {}).items():
        for nodes, run in sizes.items():
            for w in run["waves"]:
                op = w["operator"]
                gate = w.get("gate_latency_s") or {}
                total = w["total_s"] if w["converged"] else "not converged"
                out.append([arm, nodes, w["wave"], _cell(w["report_writes"]),
                            _cell(op["writes"]), _cell(op["writes_per_change"]),
                            _cell(op["status_writes"]),
                            f"{_cell(gate.get('p50'))} / {_cell(gate.get('p99'))}",
                            _cell(total), _cell(op["peak_rss_mib"]), _cell(op["cpu_s"]),
                            _cell(w["status_bytes"])])
    return out


BINDING_COLUMNS = ("arm", "nodes", "wave", "rollout s", "closed while held",
                   "opened without weights", "open after weights left p50 / p99 / max s",
                   "operator writes per node", "RSS")


def binding_rows(results: dict[str, Any]) -> list[list[str]]:
    """One row per wave that watched bound engine pods (scale.BindingWatch)."""
    out = []
    for arm, sizes in results.get("arms", {}).items():
        for nodes, run in sizes.items():
            for w in run["waves"]:
                bound = w.get("bound_engines")
                if bound is None:
                    continue
                late = bound["open_after_weights_left_s"] or {}
                op = w["operator"]
                out.append([arm, nodes, w["wave"], _cell(w.get("rollout_s")),
                            _cell(bound["gates_closed_while_weights_held"]),
                            _cell(bound["gates_opened_without_weights"]),
                            " / ".join(_cell(late.get(k)) for k in ("p50", "p99", "max")),
                            _cell(round(op["writes"] / int(nodes), 2)),
                            _cell(op["peak_rss_mib"])])
    return out


SURGE_COLUMNS = ("arm", "nodes", "wave", "converged", "rollout s", "gate closings",
                 "closed while held", "opened without weights",
                 "hand-over p50 / p99 / max s", "hand-overs past the carry",
                 "most nodes handing over (maxUnavailable)", "operator writes per node",
                 "RSS")


def surge_rows(results: dict[str, Any]) -> list[list[str]]:
    """One row per Surge rollout under bound engines (scale.SurgeWatch): every figure that
    must be 0 (closings the engine watch delivered, gates wrong at a poll) and the
    hand-overs the operator's carried verdict covered."""
    out = []
    for arm, sizes in results.get("arms", {}).items():
        for nodes, run in sizes.items():
            for w in run["waves"]:
                surge = w.get("surge")
                if surge is None:
                    continue
                bound = w.get("bound_engines") or {}
                hand = surge["handover_s"] or {}
                op = w["operator"]
                out.append([arm, nodes, w["wave"], "yes" if w["converged"] else "no",
                            _cell(w.get("rollout_s")),
                            _cell((w.get("gate_closings") or {}).get("count")),
                            _cell(bound.get("gates_closed_while_weights_held")),
                            _cell(bound.get("gates_opened_without_weights")),
                            " / ".join(_cell(hand.get(k)) for k in ("p50", "p99", "max")),
                            _cell(surge["handovers_past_carry"]),
                            f"{surge['max_nodes_handing_over']} "
                            f"({surge['max_unavailable_nodes']})",
                            _cell(round(op["writes"] / int(nodes), 2)),
                            _cell(op["peak_rss_mib"])])
    return out


def _markdown(columns: tuple[str, ...], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(r) + " |" for r in body]


def table(results: dict[str, Any]) -> str:
    """The waves' table, then (where a run bound its engine pods) the bindings' table, then
    (where it rolled a model by Surge) the surge table."""
    lines = _markdown(COLUMNS, rows(results))
    bound = binding_rows(results)
    if bound:
        lines += ["", *_markdown(BINDING_COLUMNS, bound)]
    surge = surge_rows(results)
    if surge:
        lines += ["", *_markdown(SURGE_COLUMNS, surge)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--add", nargs=2, action="append", default=[], metavar=("ARM", "RUN"))
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text()) if args.results.exists() else {}
    for arm, run in args.add:
        results = merge(results, arm, json.loads(Path(run).read_text()))
    if args.add:
        args.results.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
