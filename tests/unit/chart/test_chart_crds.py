"""The chart ships the CRD byte for byte as crds/ defines it (crds/ is the source)."""

from __future__ import annotations

from tests.unit.chart.chartkit import CHART, REPO_ROOT

SOURCE = REPO_ROOT / "crds"
COPY = CHART / "crds"
FIX = f"fix with: cp crds/*.yaml {COPY.relative_to(REPO_ROOT)}/"


def test_chart_crds_are_byte_identical_to_the_source() -> None:
    source = {p.name: p.read_bytes() for p in SOURCE.glob("*.yaml")}
    copy = {p.name: p.read_bytes() for p in COPY.glob("*.yaml")}
    assert source, f"no CRD files in {SOURCE}"
    assert sorted(copy) == sorted(source), (
        f"{COPY} must hold exactly {sorted(source)}; {FIX}"
    )
    stale = [name for name in source if copy[name] != source[name]]
    assert not stale, f"{stale} differ from crds/; {FIX}"


def test_chart_crds_dir_holds_only_crds() -> None:
    # helm installs every file under crds/ verbatim: examples must stay out.
    assert sorted(p.name for p in COPY.iterdir()) == sorted(p.name for p in SOURCE.glob("*.yaml"))
