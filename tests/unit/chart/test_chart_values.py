"""values.schema.json: good values lint clean, bad ones fail naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.unit.chart.chartkit import (
    CHART,
    EXAMPLE_VALUES,
    VALUE_SETS,
    files,
    run_helm,
    template_args,
    values_id,
)


@pytest.mark.parametrize("values", VALUE_SETS, ids=values_id)
def test_lint_is_clean(helm: Path, values: Path | None) -> None:
    extra = [arg for f in files(values) for arg in ("-f", str(f))]
    result = run_helm(helm, "lint", "--strict", str(CHART), *extra)
    assert result.returncode == 0, result.stdout + result.stderr
    # --strict fails on warnings; INFO lines (e.g. "icon is recommended") are advice only.
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


def test_there_is_an_example_values_file() -> None:
    assert EXAMPLE_VALUES, f"no ci/*-values.yaml in {CHART}"


BAD_VALUES = [
    pytest.param({"replicaCount": 1.5}, ["/replicaCount", "want integer"],
                 id="fractional-replicas"),
    pytest.param({"replicaCount": "1"}, ["/replicaCount", "want integer"], id="string-replicas"),
    pytest.param({"replicaCount": 2}, ["/replicaCount", "maximum"], id="two-replicas"),
    pytest.param({"cachePolicy": {"allowedTransports": ["auto", "nccl"]}},
                 ["/cachePolicy/allowedTransports/1", "'vmm_fd'"], id="unknown-transport"),
    pytest.param({"image": None}, ["missing property 'image'"], id="no-image"),
    pytest.param({"image": {"repository": None}}, ["/image", "missing property 'repository'"],
                 id="no-image-repository"),
    pytest.param({"sidecarImage": {"repository": ""}}, ["/sidecarImage/repository", "minLength"],
                 id="empty-sidecar-image"),
    pytest.param({"image": {"repository": "ghcr.io/x/operator:1.0"}}, ["/image/repository"],
                 id="tag-in-repository"),
    pytest.param({"image": {"digest": "sha256:abc"}}, ["/image/digest"], id="short-digest"),
    pytest.param({"image": {"tag": "latest"}, "replicas": 1}, ["replicas"], id="unknown-key"),
    pytest.param({"daemon": {"namespace": "Inference"}}, ["/daemon/namespace"],
                 id="bad-namespace"),
    pytest.param({"cachePolicy": {"namespaceModelSources": {"Team_A": {}}}},
                 ["invalid propertyName 'Team_A'"], id="bad-source-namespace"),
    pytest.param({"cachePolicy": {"namespaceModelSources": {"a": {"modelDirs": ["rel"]}}}},
                 ["/cachePolicy/namespaceModelSources/a/modelDirs/0"], id="relative-model-dir"),
    pytest.param({"cachePolicy": {"namespaceModelSources": {"a": {"dirs": []}}}},
                 ["/cachePolicy/namespaceModelSources/a", "dirs"], id="unknown-source-key"),
    pytest.param({"sweeper": {"intervalSeconds": 0}}, ["/sweeper/intervalSeconds", "minimum"],
                 id="sweeper-never"),
    pytest.param({"daemon": {"migrateFromNamespaces": ["a b"]}},
                 ["/daemon/migrateFromNamespaces/0"], id="bad-migration-namespace"),
    pytest.param({"daemon": {"serviceAccount": {"name": "Bad_Name"}}},
                 ["/daemon/serviceAccount/name"], id="bad-daemon-sa"),
    pytest.param({"cachePolicy": {"allowedSidecarImagePrefixes": ["reg.example.com/'x"]}},
                 ["/cachePolicy/allowedSidecarImagePrefixes/0"], id="quote-in-image-prefix"),
    pytest.param({"resources": {"limits": {"memory": "1 GiB"}}}, ["/resources/limits/memory"],
                 id="malformed-quantity"),
    pytest.param({"cachePolicy": {"allowedHostPaths": {"socketDirs": ["/"], "modelDirs": []}}},
                 ["/cachePolicy/allowedHostPaths/socketDirs/0"], id="root-as-socket-dir"),
    pytest.param({"cachePolicy": {"allowedHostPaths": {"socketDirs": [],
                                                       "modelDirs": ["/models/../etc"]}}},
                 ["/cachePolicy/allowedHostPaths/modelDirs/0"], id="dotdot-model-dir"),
    pytest.param({"cachePolicy": {"allowedHostPaths": {"socketDirs": ["run/wc"],
                                                       "modelDirs": []}}},
                 ["/cachePolicy/allowedHostPaths/socketDirs/0"], id="relative-socket-dir"),
    pytest.param({"cachePolicy": {"allowedHostPaths": {"socketDirs": ["/run/wc/"],
                                                       "modelDirs": []}}},
                 ["/cachePolicy/allowedHostPaths/socketDirs/0"], id="trailing-slash"),
]


@pytest.mark.parametrize(("values", "expected"), BAD_VALUES)
def test_schema_rejects_bad_values(
    helm: Path, tmp_path: Path, values: dict, expected: list[str]
) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    result = run_helm(helm, *template_args(path))
    assert result.returncode != 0, f"helm accepted {values}"
    assert "values don't meet the specifications of the schema" in result.stderr, result.stderr
    for text in expected:
        assert text in result.stderr, result.stderr
