"""Fixtures building specs and daemon pods for the operator's unit tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.unit.operator.builders import gpu_entry, report
from weightcache_operator.spec import WeightCacheSpec, parse_spec, spec_hash
from weightcache_operator.views import DaemonPodView


@pytest.fixture
def gpu_spec() -> WeightCacheSpec:
    return parse_spec(
        {
            "model": {"path": "/models/m"},
            "gpus": {"perNode": 2, "tpSize": 2, "shardPlan": "llama"},
            "transport": "vmm_fd",
            "engine": {"selector": {}},
        }
    )


@pytest.fixture
def gpu_hash(gpu_spec: WeightCacheSpec) -> str:
    return spec_hash(gpu_spec)


@pytest.fixture
def make_pod(gpu_hash: str) -> Callable[..., DaemonPodView]:
    def make(
        name: str = "wc-abc",
        node: str | None = "node-a",
        *,
        gpus: int = 2,
        raw: str | None | bool = True,
        phase: str = "Running",
        ready: bool = True,
        terminating: bool = False,
        template_hash: str | None = None,
        created: str = "2026-01-01T00:00:00Z",
        **entry: Any,
    ) -> DaemonPodView:
        if raw is True:
            raw = report(gpu_hash, {f"GPU-{i}": gpu_entry(**entry) for i in range(gpus)})
        return DaemonPodView(
            namespace="ns",
            name=name,
            cache="wc",
            node=node,
            phase=phase,
            ready=ready,
            terminating=terminating,
            report=raw or None,
            spec_hash=template_hash or gpu_hash,
            created=created,
        )

    return make
