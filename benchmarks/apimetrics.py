"""Who asked the apiserver for what, and what processes cost: the scale harness's meters.

`apiserver_request_total` has no client label, so the operator's requests are
told apart by API Priority and Fairness: one FlowSchema per (verb, resource)
the operator's RBAC grants, matching only the operator's ServiceAccount, makes
`apiserver_flowcontrol_dispatched_requests_total{flow_schema=...}` count that
identity's requests by verb and resource, from the apiserver's own /metrics.
The schemas keep the operator at the priority level every ServiceAccount gets
by default (`workload-low`), so its requests are served as they would be.

Parsing and differencing are pure; reading /proc and the apiserver are the edges.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

FLOW_PREFIX = "wcscale-"
# What every ServiceAccount gets without a FlowSchema of its own (the
# "service-accounts" schema), so counting changes nothing about serving.
PRIORITY_LEVEL = "workload-low"
PRECEDENCE = 1000
MUTATING = frozenset({"create", "update", "patch", "delete", "deletecollection"})
OTHER = "other"

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\}\s+(\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def flow_name(prefix: str, verb: str, resource: str) -> str:
    """A FlowSchema name for one verb on one resource (`pods/status` -> `pods-status`)."""
    part = resource.replace("/", "-").replace(".", "-")
    return f"{FLOW_PREFIX}{prefix}-{verb}-{part}"


def flow_schemas(prefix: str, namespace: str, account: str,
                 rules: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """FlowSchemas counting one ServiceAccount's requests per (verb, resource) of `rules`.

    Rules in RBAC form (`apiGroups`, `resources`, `verbs`); anything else the
    account does (discovery, a verb the rules lack) lands in `<prefix>-other`.
    """
    subject = {"kind": "ServiceAccount",
               "serviceAccount": {"name": account, "namespace": namespace}}
    docs = []
    for rule in rules:
        for resource in rule["resources"]:
            for verb in rule["verbs"]:
                docs.append(_schema(flow_name(prefix, verb, resource), PRECEDENCE, subject, {
                    "resourceRules": [{
                        "verbs": [verb], "apiGroups": list(rule["apiGroups"]),
                        "resources": [resource], "clusterScope": True, "namespaces": ["*"],
                    }],
                }))
    docs.append(_schema(f"{FLOW_PREFIX}{prefix}-{OTHER}", PRECEDENCE + 1, subject, {
        "resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"],
                           "clusterScope": True, "namespaces": ["*"]}],
        "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}],
    }))
    return docs


def _schema(name: str, precedence: int, subject: dict[str, Any], rule: dict[str, Any]
            ) -> dict[str, Any]:
    return {
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
        "kind": "FlowSchema",
        "metadata": {"name": name},
        "spec": {
            "priorityLevelConfiguration": {"name": PRIORITY_LEVEL},
            "matchingPrecedence": precedence,
            "distinguisherMethod": {"type": "ByUser"},
            "rules": [{"subjects": [subject], **rule}],
        },
    }


def parse_samples(text: str, metric: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of `metric` in Prometheus text format, as (labels, value)."""
    out = []
    for line in text.splitlines():
        if not line.startswith(metric + "{"):
            continue
        match = _SAMPLE.match(line)
        if match is None or match.group(1) != metric:
            continue
        labels = dict(_LABEL.findall(match.group(2)))
        out.append((labels, float(match.group(3))))
    return out


@dataclass(frozen=True)
class Counts:
    """Request counters read from one /metrics scrape."""

    # (verb, resource[/subresource]) -> requests, every client together.
    all_clients: Mapping[tuple[str, str], float]
    # FlowSchema name -> requests dispatched (the counted identities).
    flows: Mapping[str, float]
    rejected: Mapping[str, float]


def counts(text: str) -> Counts:
    all_clients: dict[tuple[str, str], float] = {}
    for labels, value in parse_samples(text, "apiserver_request_total"):
        resource = labels.get("resource", "")
        if labels.get("subresource"):
            resource += "/" + labels["subresource"]
        key = (labels.get("verb", "").lower(), resource)
        all_clients[key] = all_clients.get(key, 0.0) + value
    flows: dict[str, float] = {}
    for labels, value in parse_samples(text, "apiserver_flowcontrol_dispatched_requests_total"):
        name = labels.get("flow_schema", "")
        flows[name] = flows.get(name, 0.0) + value
    rejected: dict[str, float] = {}
    for labels, value in parse_samples(text, "apiserver_flowcontrol_rejected_requests_total"):
        name = labels.get("flow_schema", "")
        rejected[name] = rejected.get(name, 0.0) + value
    return Counts(all_clients, flows, rejected)


def flow_delta(before: Counts, after: Counts, prefix: str) -> dict[str, int]:
    """Requests per `<verb> <resource>` of one counted identity between two scrapes."""
    head = f"{FLOW_PREFIX}{prefix}-"
    out = {}
    for name, value in after.flows.items():
        if not name.startswith(head):
            continue
        delta = int(round(value - before.flows.get(name, 0.0)))
        if delta:
            out[_flow_label(name[len(head):])] = delta
    return dict(sorted(out.items()))


def _flow_label(rest: str) -> str:
    verb, _, resource = rest.partition("-")
    return f"{verb} {resource.replace('-', '/')}" if resource else verb


def all_clients_delta(before: Counts, after: Counts) -> dict[str, int]:
    out = {}
    for key, value in after.all_clients.items():
        delta = int(round(value - before.all_clients.get(key, 0.0)))
        if delta:
            out[f"{key[0]} {key[1]}".strip()] = delta
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def writes(requests: Mapping[str, int]) -> int:
    """Mutating requests among `<verb> <resource>` counts."""
    return sum(n for key, n in requests.items() if key.split(" ", 1)[0] in MUTATING)


# --------------------------------------------------------------------------- /proc


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process (threads included)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # After the command: state is field 3, utime 14 and stime 15 (1-based).
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def system_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, all cores."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    total = sum(values[:8])
    return (total - idle) / CLOCK_TICKS, total / CLOCK_TICKS


def loadavg() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(v) for v in f.read().split()[:3]]
