"""The webhook's handler (webhook.py) with a stand-in apiserver read: what it binds.

tests/k8s/test_webhook.py runs it behind a real apiserver; here the one rule
that a real apiserver shows only by a race: the binding is the generation the
apiserver holds now, never the operator's watch's (which may lag an edit).
"""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import pytest
from kubernetes.client.exceptions import ApiException

from weightcache_operator import names, webhook
from weightcache_operator.spec import parse_spec, spec_hash

V1 = {"model": {"path": "/models/m"}, "device": "cpu"}
V2 = {"model": {"path": "/models/m2"}, "device": "cpu"}


class Apiserver:
    def __init__(self, spec: dict[str, Any] | None, error: int | None = None) -> None:
        self.spec, self.error, self.reads = spec, error, 0

    async def read_cache(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads += 1
        if self.error is not None:
            raise ApiException(status=self.error, reason="Unavailable")
        if self.spec is None:
            return None
        return {"metadata": {"name": name, "namespace": namespace, "uid": "u",
                             "generation": 2}, "spec": self.spec}


def admit(apiserver: Apiserver, annotations: dict[str, str] | None = None) -> kopf.Patch:
    memo = kopf.Memo()
    memo.reconciler = type("R", (), {"kube": apiserver})()
    body = {"metadata": {"name": "e", "namespace": "team",
                         "labels": {names.CACHE_LABEL: "wc"},
                         "annotations": annotations or {}},
            "spec": {"containers": [{"name": "engine", "image": "e:1"}]}}
    patch = kopf.Patch()
    # The watch's index is not consulted: it may still hold V1 after an edit to V2.
    asyncio.run(webhook.inject_engine_pod(body=body, spec=body["spec"], namespace="team",
                                          patch=patch, memo=memo))
    return patch


def test_the_binding_is_the_apiservers_generation_not_the_watchs() -> None:
    apiserver = Apiserver(V2)
    patch = admit(apiserver)
    assert apiserver.reads == 1
    assert patch["metadata"]["annotations"] == {
        names.binding_key("team", "wc"): spec_hash(parse_spec(V2))}
    # A binding the pod brings is kept.
    assert "metadata" not in admit(Apiserver(V2), {
        names.binding_key("team", "wc"): spec_hash(parse_spec(V1))})


def test_a_cache_the_apiserver_cannot_give_refuses_the_pod() -> None:
    with pytest.raises(kopf.AdmissionError) as missing:
        admit(Apiserver(None))
    assert "does not exist" in str(missing.value)
    with pytest.raises(kopf.AdmissionError) as unreadable:
        admit(Apiserver(V1, error=503))
    assert unreadable.value.code == 503 and "reading WeightCache team/wc" in str(
        unreadable.value)
