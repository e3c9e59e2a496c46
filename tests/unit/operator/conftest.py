"""Fixtures building specs and daemon pods for the operator's unit tests."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest

from tests.unit.operator.builders import annotations, device_report
from weightcache_operator.spec import WeightCacheSpec, parse_spec, spec_hash
from weightcache_operator.views import DaemonPodView, DaemonSetView

DS_UID = "ds-uid"


@pytest.fixture
def gpu_spec() -> WeightCacheSpec:
    return parse_spec(
        {
            "model": {"path": "/models/m"},
            "gpus": {"perNode": 2, "tpSize": 2, "shardPlan": "llama"},
            "transport": "vmm_fd",
            "engine": {"selector": {"matchLabels": {"app": "engine"}}},
        }
    )


@pytest.fixture
def gpu_hash(gpu_spec: WeightCacheSpec) -> str:
    return spec_hash(gpu_spec)


def daemonset(
    desired: int = 2, updated: int | None = None, generation: int = 1, applied: int | None = 1
) -> DaemonSetView:
    return DaemonSetView(
        namespace="ns",
        name="weightcache-wc",
        uid=DS_UID,
        controller_uid="cache-uid",
        cache="wc",
        desired=desired,
        updated=desired if updated is None else updated,
        generation=generation,
        observed_generation=generation,
        applied_generation=applied,
        render_hash="h",
    )


@pytest.fixture
def make_pod(gpu_hash: str) -> Callable[..., DaemonPodView]:
    def make(
        name: str = "wc-abc",
        node: str | None = "node-a",
        *,
        gpus: int = 2,
        reports: Mapping[str, str] | None | bool = True,
        phase: str = "Running",
        ready: bool = True,
        terminating: bool = False,
        template_hash: str | None = None,
        created: str = "2026-01-01T00:00:00Z",
        controller_uid: str | None = DS_UID,
        **entry: Any,
    ) -> DaemonPodView:
        if reports is True:
            reports = annotations(
                *(device_report(f"GPU-{i}", gpu_hash, node or "", **entry) for i in range(gpus))
            )
        return DaemonPodView(
            namespace="ns",
            name=name,
            cache="wc",
            node=node,
            phase=phase,
            ready=ready,
            terminating=terminating,
            reports=dict(reports or {}),
            spec_hash=template_hash or gpu_hash,
            created=created,
            controller_uid=controller_uid,
        )

    return make
