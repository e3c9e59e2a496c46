"""The test harness's environment for daemons started as other processes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.unit.wc_harness import package_env


def test_package_env_keeps_site_packages_but_not_directories_packages_add_inside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "lib" / "site-packages"
    inner = site / "nvidia_cutlass_dsl" / "dsl_packages" / "cutlass" / "base_dsl"
    inner.mkdir(parents=True)
    (inner / "typing.py").write_text("raise ImportError('shadowed the stdlib')\n")
    monkeypatch.setattr(sys, "path", [*sys.path, str(site), str(inner)])
    entries = package_env()["PYTHONPATH"].split(os.pathsep)
    assert str(site) in entries
    assert str(inner) not in entries
