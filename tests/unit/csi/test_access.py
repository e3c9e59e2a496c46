"""Which cache a CSI volume names and whether the pod's namespace may mount it (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from weightcache_csi.access import (
    EPHEMERAL,
    POD_NAME,
    POD_NAMESPACE,
    Refused,
    Request,
    Target,
    decide,
    parse_request,
)

ROOTS = frozenset({"/var/run/weightcache"})


def context(cache: str, namespace: str = "team", **extra: str) -> dict[str, str]:
    return {"cache": cache, POD_NAMESPACE: namespace, POD_NAME: "engine-0", EPHEMERAL: "true",
            **extra}


def cache(namespace: str = "team", name: str = "minilm", **spec: Any) -> dict[str, Any]:
    return {"metadata": {"namespace": namespace, "name": name}, "spec": spec}


def test_a_bare_name_is_a_cache_of_the_pods_own_namespace() -> None:
    assert parse_request(context("minilm")) == Request("team", "engine-0", "team", "minilm")
    assert parse_request(context("models/minilm")).cache == "models/minilm"


@pytest.mark.parametrize("raw", ["", "a/b/c", "../x", "Team/minilm", "team/", "/minilm",
                                 "team/mini lm", "x" * 64 + "/minilm"])
def test_what_is_not_a_cache_reference_is_refused_naming_the_attribute(raw: str) -> None:
    with pytest.raises(Refused, match="volumeAttributes.cache") as info:
        parse_request(context(raw))
    assert info.value.code == "INVALID_ARGUMENT"


def test_a_path_or_unknown_attribute_is_refused_not_used() -> None:
    with pytest.raises(Refused, match=r"unknown volume attributes \['path'\]"):
        parse_request(context("minilm", path="/etc"))


def test_only_inline_ephemeral_volumes_with_kubelets_pod_info_are_served() -> None:
    without = context("minilm")
    del without[EPHEMERAL]
    with pytest.raises(Refused, match="inline ephemeral"):
        parse_request(without)
    anonymous = context("minilm")
    del anonymous[POD_NAMESPACE]
    with pytest.raises(Refused, match="no pod namespace"):
        parse_request(anonymous)


def test_the_pods_own_namespace_may_mount_its_cache() -> None:
    target = decide(parse_request(context("minilm")), cache(), ROOTS)
    assert target == Target("/var/run/weightcache", "team.minilm")


def test_another_namespace_is_refused_unless_the_cache_lists_it() -> None:
    request = parse_request(context("team/minilm", namespace="intruder"))
    with pytest.raises(Refused, match="namespace intruder may not use WeightCache team/minilm"
                       ) as info:
        decide(request, cache(), ROOTS)
    assert info.value.code == "PERMISSION_DENIED"
    listed = cache(engine={"namespaces": ["serving", "intruder"]})
    assert decide(request, listed, ROOTS).name == "team.minilm"


def test_a_missing_or_deleting_cache_is_refused() -> None:
    request = parse_request(context("gone"))
    with pytest.raises(Refused, match="WeightCache team/gone does not exist") as info:
        decide(request, None, ROOTS)
    assert info.value.code == "NOT_FOUND"
    deleting = cache(name="gone")
    deleting["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    with pytest.raises(Refused, match="being deleted"):
        decide(request, deleting, ROOTS)


def test_the_directory_comes_from_the_cache_under_a_root_the_plugin_serves() -> None:
    request = parse_request(context("minilm"))
    assert decide(request, cache(socketDir="/var/run/weightcache/"), ROOTS).socket_dir == (
        "/var/run/weightcache")
    with pytest.raises(Refused, match="socketDir /elsewhere, which this plugin does not serve"):
        decide(request, cache(socketDir="/elsewhere"), ROOTS)
