"""The cache policy: what a WeightCache may ask of a node, parsed and checked (pure)."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest

from weightcache_operator.policy import (
    POLICY_ENV,
    HostPaths,
    ModelSources,
    Policy,
    PolicyError,
    image_allowed,
    path_within,
    policy_from_env,
    quantity,
)


def test_no_policy_allows_nothing() -> None:
    policy = policy_from_env({})
    assert policy.allowed_host_paths == HostPaths((), ())
    assert policy.setup_image is None


def test_policy_from_the_charts_json() -> None:
    raw = {
        "setupImage": "op:1", "sidecarImage": "side:1", "daemonServiceAccount": "d",
        "daemonNamespace": "weightcache-system", "allowedModelClaims": ["weights"],
        "allowedHostPaths": {"socketDirs": ["/run/wc"], "modelDirs": ["/models"]},
        "allowedSidecarImagePrefixes": ["reg.example.com/"], "allowedTransports": ["vmm_fd"],
    }
    policy = policy_from_env({POLICY_ENV: json.dumps(raw)})
    assert policy == Policy(
        setup_image="op:1", sidecar_image="side:1", daemon_service_account="d",
        daemon_namespace="weightcache-system", allowed_model_claims=("weights",),
        allowed_host_paths=HostPaths(("/run/wc",), ("/models",)),
        allowed_sidecar_image_prefixes=("reg.example.com/",), allowed_transports=("vmm_fd",),
    )


@pytest.mark.parametrize(
    ("raw", "what"),
    [
        ("{not json", "malformed"),
        (json.dumps({"allowedHostPaths": {"socketDirs": ["relative/dir"]}}), "socketDirs"),
        (json.dumps({"allowedHostPaths": {"sockets": ["/x"]}}), "sockets"),
        (json.dumps({"allowedTransports": ["carrier-pigeon"]}), "carrier-pigeon"),
        (json.dumps({"setupImage": ""}), "setupImage"),
        (json.dumps({"namespaceModelSources": {"Team_A": {}}}), "'Team_A' is not a namespace"),
        (json.dumps({"namespaceModelSources": {"a": {"modelDirs": ["rel"]}}}), "modelDirs"),
        (json.dumps({"namespaceModelSources": {"a": {"dirs": []}}}), "dirs"),
    ],
)
def test_a_malformed_policy_is_refused_naming_it(raw: str, what: str) -> None:
    with pytest.raises(PolicyError, match=POLICY_ENV) as err:
        policy_from_env({POLICY_ENV: raw})
    assert what in str(err.value)


@pytest.mark.parametrize(
    ("path", "allowed"),
    [
        ("/models", True),
        ("/models/", True),
        ("/models/llama", True),
        ("/models/llama/v1/", True),
        ("/modelsevil", False),
        ("/models-evil/x", False),
        ("/mod", False),
        ("/", False),
        ("/etc", False),
    ],
)
def test_paths_match_at_segment_boundaries(path: str, allowed: bool) -> None:
    assert path_within(path, ("/models", "/data/m/")) is allowed


@pytest.mark.parametrize(
    ("image", "allowed"),
    [
        ("registry.corp.example/x:1", True),
        ("registry.corp.example/team/x@sha256:" + "a" * 64, True),
        # Issue 25 item 13: the same host on another port is another registry.
        ("registry.corp.example:5000/x:1", False),
        ("docker.io/library/python@sha256:" + "b" * 64, True),
        # The bypass: a longer host that merely starts with the prefix.
        ("registry.corp.example.evil.io/x:1", False),
        ("registry.corp.exampleX/x:1", False),
        ("other.example/registry.corp.example/x:1", False),
        ("reg.example.com/wc/sidecar:1", True),
        ("reg.example.com/wc-evil/sidecar:1", False),
        ("reg.example.com/wc/", True),
        ("docker.io/library/python:3.12", True),
        ("docker.io/library/python-evil:3.12", False),
    ],
)
def test_image_prefixes_match_at_registry_and_path_boundaries(image: str, allowed: bool) -> None:
    prefixes = ("registry.corp.example", "reg.example.com/wc/", "docker.io/library/python")
    assert image_allowed(image, prefixes) is allowed


def test_no_prefixes_allow_any_image() -> None:
    assert image_allowed("anything.example/x:1", ())


@pytest.mark.parametrize(("text", "value"), [
    ("500m", "0.5"), ("8", "8"), (8, "8"), ("2Gi", str(2 * 2**30)), ("1e3", "1000"),
    ("1.5", "1.5"), ("100k", "100000"), ("3Mi", str(3 * 2**20)), ("0.5Gi", str(2**29)),
])
def test_quantities_read_as_kubernetes_reads_them(text: str | int, value: str) -> None:
    assert quantity(text) == Decimal(value)


@pytest.mark.parametrize("text", ["", "8 cpu", "1Zi", "-1", True])
def test_a_non_quantity_is_refused(text: object) -> None:
    with pytest.raises(ValueError, match="is not a quantity"):
        quantity(text)  # type: ignore[arg-type]


def test_the_environment_cannot_allow_unknown_modes_or_bad_caps() -> None:
    for raw, message in (({"allowedGpuAccessModes": ["all-gpus"]}, "unknown GPU access modes"),
                         ({"maxSidecarResources": {"cpu": "lots"}}, "maxSidecarResources.cpu")):
        with pytest.raises(PolicyError, match=message):
            policy_from_env({POLICY_ENV: json.dumps(raw)})
    policy = policy_from_env({POLICY_ENV: "{}"})
    assert policy.allowed_gpu_access_modes == ("visible-devices", "device-plugin", "dra")
    assert policy.allowed_priority_classes == ()
    assert policy.max_sidecar_resources == {"cpu": "8", "memory": "64Gi"}


def test_model_sources_are_per_namespace_with_a_cluster_default() -> None:
    """Issue 34 item 2: model directories and claims were cluster-wide, so any tenant could
    load, and its engines read, any other tenant's weights."""
    raw = {"allowedHostPaths": {"modelDirs": ["/models/shared"]},
           "allowedModelClaims": ["shared"],
           "namespaceModelSources": {"team-a": {"modelDirs": ["/models/a"],
                                                "modelClaims": ["a-weights"]},
                                     "locked": {}}}
    policy = policy_from_env({POLICY_ENV: json.dumps(raw)})
    assert policy.model_sources("team-a") == (
        ModelSources(("/models/a",), ("a-weights",)), "namespace team-a's")
    assert policy.model_sources("locked") == (ModelSources(), "namespace locked's")
    assert policy.model_sources("anyone") == (
        ModelSources(("/models/shared",), ("shared",)), "the cluster's default")
