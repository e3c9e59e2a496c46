"""The CRD and the operator's spec parser must agree on defaults and patterns."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from weightcache_operator import names, spec

ROOT = Path(__file__).resolve().parents[3]
CRD = ROOT / "crds" / "weightcache.dev_weightcaches.yaml"
EXAMPLES = sorted((ROOT / "crds" / "examples").glob("*.yaml"))


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD.read_text())


@pytest.fixture(scope="module")
def schema(crd: dict[str, Any]) -> dict[str, Any]:
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """The apiserver's structural defaulting, for objects (all this CRD defaults)."""
    if not isinstance(value, dict) or "properties" not in schema:
        return value
    out = copy.deepcopy(value)
    for key, sub in schema["properties"].items():
        if key not in out and "default" in sub:
            out[key] = copy.deepcopy(sub["default"])
        if key in out:
            out[key] = apply_defaults(out[key], sub)
    return out


def test_names_and_presentation(crd: dict[str, Any]) -> None:
    assert crd["metadata"]["name"] == f"{names.PLURAL}.{names.GROUP}"
    assert crd["spec"]["names"]["kind"] == names.KIND
    assert crd["spec"]["names"]["shortNames"] == ["wc"]
    assert crd["spec"]["scope"] == "Namespaced"
    (version,) = crd["spec"]["versions"]
    assert version["name"] == names.VERSION
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Ready", "Phase", "Resident", "Transport", "Rollout", "Age"]


@pytest.mark.parametrize(
    "raw",
    [
        {"model": {"path": "/m"}},
        {"model": {"pvc": {"claimName": "c"}}, "gpus": {"perNode": 4}, "gpuAccess": {}},
        {"model": {"path": "/m"}, "device": "cpu", "sidecar": {},
         "engine": {"selector": {"matchLabels": {"app": "e"}}}},
    ],
)
def test_crd_defaults_equal_parser_defaults(schema: dict[str, Any], raw: dict) -> None:
    defaulted = apply_defaults({"spec": raw}, schema)["spec"]
    assert defaulted != raw  # the CRD does default something here
    assert spec.parse_spec(defaulted) == spec.parse_spec(raw)


def test_patterns_equal_parser_patterns(schema: dict[str, Any]) -> None:
    props = schema["properties"]["spec"]["properties"]
    assert props["model"]["properties"]["path"]["pattern"] == spec.ABS_PATH_RE.pattern
    assert props["socketDir"]["pattern"] == spec.ABS_PATH_RE.pattern
    sub_path = props["model"]["properties"]["pvc"]["properties"]["subPath"]
    assert sub_path["pattern"] == spec.REL_PATH_RE.pattern
    assert props["gpuAccess"]["properties"]["resourceName"]["pattern"] == (
        spec.RESOURCE_NAME_RE.pattern
    )
    resources = props["sidecar"]["properties"]["resources"]["properties"]
    for kind in ("requests", "limits"):
        assert resources[kind]["additionalProperties"]["pattern"] == spec.QUANTITY_RE.pattern
    assert props["transport"]["enum"] == list(spec.TRANSPORTS)
    assert props["device"]["enum"] == list(spec.DEVICES)
    assert props["model"]["properties"]["dtype"]["enum"] == list(spec.DTYPES)
    assert props["gpuAccess"]["properties"]["mode"]["enum"] == list(spec.GPU_ACCESS_MODES)
    assert props["gpus"]["properties"]["perNode"]["maximum"] == spec.MAX_GPUS_PER_NODE
    assert props["rollout"]["properties"]["strategy"]["enum"] == list(spec.ROLLOUT_STRATEGIES)
    max_unavailable = props["rollout"]["properties"]["maxUnavailable"]
    assert max_unavailable["pattern"] == spec.PERCENT_RE.pattern
    assert (max_unavailable["minimum"], max_unavailable["maximum"]) == (1, spec.MAX_INT32)
    http_port = props["sidecar"]["properties"]["httpPort"]
    assert http_port["maximum"] + spec.MAX_GPUS_PER_NODE == 65535


def test_status_phases_cover_the_aggregator(schema: dict[str, Any]) -> None:
    from weightcache_operator import aggregate

    phases = schema["properties"]["status"]["properties"]["phase"]["enum"]
    assert sorted(phases) == sorted(
        [
            aggregate.PHASE_PENDING,
            aggregate.PHASE_LOADING,
            aggregate.PHASE_READY,
            aggregate.PHASE_DEGRADED,
            aggregate.PHASE_ERROR,
        ]
    )


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_parse(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    assert doc["apiVersion"] == names.API_VERSION
    assert doc["kind"] == names.KIND
    parsed = spec.parse_spec(doc["spec"])
    assert parsed.engine.selector is not None


def test_there_is_a_cpu_and_a_gpu_example() -> None:
    devices = {yaml.safe_load(p.read_text())["spec"].get("device", "cuda") for p in EXAMPLES}
    assert devices == {"cpu", "cuda"}
