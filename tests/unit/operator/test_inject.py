"""What the one-label webhook adds to a pod, and when it refuses (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from weightcache_operator import inject, names
from weightcache_operator.spec import parse_spec, spec_hash
from weightcache_operator.views import CacheView

SPEC = {"model": {"path": "/models/m"}, "device": "cpu",
        "sidecar": {"runAsUser": 65533, "runAsGroup": 65534}}


def cache(namespace: str = "team", name: str = "minilm", deleting: bool = False,
          **spec: Any) -> CacheView:
    return CacheView(namespace, name, "uid", 1, {**SPEC, **spec}, {}, deleting)


def pod_spec() -> dict[str, Any]:
    return {"containers": [{"name": "engine", "image": "engine:1",
                            "env": [{"name": "OTHER", "value": "1"}]},
                           {"name": "sidecar", "image": "proxy:1"}],
            "securityContext": {"runAsNonRoot": True, "runAsUser": 1000}}


def injection(ns: str = "team") -> inject.Injection:
    want = inject.wanted(ns, {names.CACHE_LABEL: "minilm"}, {})
    return inject.decide(ns, want, cache())


def test_a_pod_asks_for_a_cache_whatever_else_manages_it() -> None:
    """The chart's objectSelector (the label exists, `managed-by` is not the operator's):
    every pod it sends is injected or refused, a Helm-managed one included."""
    assert inject.asks({names.CACHE_LABEL: "minilm"})
    assert inject.asks({names.CACHE_LABEL: "minilm", names.MANAGED_BY_LABEL: "Helm"})
    # Issue 34 item 3: the operator's `managed-by` alone once skipped the webhook.
    assert inject.asks({names.CACHE_LABEL: "minilm", names.MANAGED_BY_LABEL: names.MANAGER})
    assert inject.asks({names.CACHE_LABEL: "minilm",
                        names.COMPONENT_LABEL: names.DAEMON_COMPONENT})
    # Only both daemon labels together, which the daemon-pod guard admits from the
    # DaemonSet controller alone, in the daemon namespace.
    assert not inject.asks({names.CACHE_LABEL: "minilm", names.MANAGED_BY_LABEL: names.MANAGER,
                            names.COMPONENT_LABEL: names.DAEMON_COMPONENT})
    assert not inject.asks({"app": "engine"})


def test_the_label_names_a_cache_of_the_pods_namespace_or_the_annotated_one() -> None:
    assert inject.wanted("team", {names.CACHE_LABEL: "minilm"}, {}) == inject.Wanted(
        "team", "minilm")
    assert inject.wanted("serving", {names.CACHE_LABEL: "minilm"},
                         {names.CACHE_NAMESPACE_LABEL: "team"}) == inject.Wanted("team", "minilm")
    for labels, notes in (({names.CACHE_LABEL: ""}, {}),
                          ({names.CACHE_LABEL: "Mini_LM"}, {}),
                          ({names.CACHE_LABEL: "m"}, {names.CACHE_NAMESPACE_LABEL: "a/b"})):
        with pytest.raises(inject.Refused) as info:
            inject.wanted("team", labels, notes)
        assert info.value.code == 400


def test_everything_the_engine_needs_is_added() -> None:
    spec = inject.mutated_spec(pod_spec(), injection())
    assert spec["readinessGates"] == [{"conditionType": names.GATE_CONDITION}]
    assert spec["volumes"] == [{"name": inject.VOLUME, "csi": {
        "driver": "weightcache.dev", "volumeAttributes": {"cache": "team/minilm"}}}]
    for container in spec["containers"]:
        assert container["volumeMounts"] == [{"name": inject.VOLUME,
                                              "mountPath": "/run/wc/team.minilm"}]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env[inject.SOCKET_DIR_ENV] == "/run/wc"
        assert env[inject.CACHE_ENV] == "team.minilm"
        assert env[inject.DAEMON_UIDS_ENV] == "65533"
    assert spec["containers"][0]["env"][0] == {"name": "OTHER", "value": "1"}
    # The daemon's group joins the pod's own; nothing of the pod's is replaced.
    assert spec["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1000,
                                       "supplementalGroups": [65534]}


def test_admitting_again_changes_nothing_and_what_the_author_set_wins() -> None:
    once = inject.mutated_spec(pod_spec(), injection())
    assert inject.mutated_spec(once, injection()) == once
    own = pod_spec()
    own["containers"][0]["env"].append({"name": inject.DAEMON_UIDS_ENV, "value": "4242"})
    spec = inject.mutated_spec(own, injection())
    uids = [e for e in spec["containers"][0]["env"] if e["name"] == inject.DAEMON_UIDS_ENV]
    assert uids == [{"name": inject.DAEMON_UIDS_ENV, "value": "4242"}]


def test_a_missing_deleting_or_invalid_cache_is_refused_naming_it() -> None:
    want = inject.Wanted("team", "minilm")
    for found, message in ((None, "WeightCache team/minilm does not exist"),
                           (cache(deleting=True), "being deleted"),
                           (cache(device="tpu"), "is invalid: spec.device")):
        with pytest.raises(inject.Refused, match=message) as info:
            inject.decide("team", want, found)
        assert info.value.code == 403


def test_another_namespace_is_refused_unless_the_cache_lists_it() -> None:
    want = inject.Wanted("team", "minilm")
    with pytest.raises(inject.Refused, match="namespace intruder may not use WeightCache"):
        inject.decide("intruder", want, cache())
    listed = cache(engine={"namespaces": ["serving"]})
    assert inject.decide("serving", want, listed).mount_path == "/run/wc/team.minilm"


def test_a_pod_is_bound_to_the_caches_generation_at_admission() -> None:
    """The weights a pod will run are those of the cache's spec when it is admitted; its
    gate follows them through a later model change (issue 36)."""
    found = injection()
    key = names.binding_key("team", "minilm")
    assert found.spec_hash == spec_hash(parse_spec(SPEC))
    assert inject.added_annotations({}, found) == {key: found.spec_hash}
    # Brought by the author (pinned in the template) or by an earlier admission: kept.
    assert inject.added_annotations({key: "b" * 64}, found) == {}
    upgraded = inject.decide("team", inject.wanted("team", {names.CACHE_LABEL: "minilm"}, {}),
                             cache(model={"path": "/models/m2"}))
    assert upgraded.spec_hash != found.spec_hash
    for brought in ("v2", "B" * 64, found.spec_hash[:63]):
        with pytest.raises(inject.Refused) as info:
            inject.added_annotations({key: brought}, found)
        assert info.value.code == 400 and key in str(info.value)
