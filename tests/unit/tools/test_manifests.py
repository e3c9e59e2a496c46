"""The chart's generated files are current (the verify step of `make manifests`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tools import manifests


def test_generated_chart_files_are_current() -> None:
    assert manifests.stale() == [], "run `make manifests` and commit the result"


@pytest.fixture
def chart_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    chart = tmp_path / "chart"
    shutil.copytree(manifests.CHART, chart)
    monkeypatch.setattr(manifests, "CHART", chart)
    monkeypatch.setattr(manifests, "REPO_ROOT", tmp_path)
    return chart


def test_check_names_every_stale_file_and_write_mends_it(chart_copy: Path) -> None:
    rules = chart_copy / "files" / "operator-rules.yaml"
    rules.write_text(rules.read_text().replace("- watch\n", "- watch\n- delete\n", 1))
    (chart_copy / "crds" / "stray.yaml").write_text("kind: Example\n")
    (chart_copy / "files" / "daemon-rules.yaml").unlink()
    assert sorted(manifests.stale()) == [
        "chart/crds/stray.yaml", "chart/files/daemon-rules.yaml", "chart/files/operator-rules.yaml",
    ]
    assert manifests.main(["check"]) == 1
    manifests.write()
    assert manifests.stale() == []
    assert manifests.main(["check"]) == 0
