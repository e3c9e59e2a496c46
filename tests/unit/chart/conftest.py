"""Fixtures for the chart checks (helpers in chartkit.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.chart.chartkit import Renderer, helm_binary


@pytest.fixture(scope="session")
def helm() -> Path:
    return helm_binary()


@pytest.fixture(scope="session")
def render(helm: Path) -> Renderer:
    return Renderer(helm)
