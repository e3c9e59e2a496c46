"""The daemon's reporter against the real API server, with the daemon's own rights."""

from __future__ import annotations

import json

import pytest
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from tests.k8s.operator_flow import install_daemon_account
from tools.testenv.cluster import Cluster
from weightcache.daemon.reporter import REPORT_ANNOTATION, PodReporter

pytestmark = pytest.mark.k8s


def status(gpu: str, state: str = "ready") -> dict:
    return {"state": state, "gpu": gpu, "preloaded_weights_bytes": 1000,
            "expected_bytes": 1000, "transport_backend": "vmm_fd", "fingerprint": "f" * 64,
            "load_seconds": 2.0, "readopted": False, "error": None}


def test_daemons_sharing_a_pod_merge_their_entries(
    cluster: Cluster, k8s_api: k8s.ApiClient, namespace: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    core = k8s.CoreV1Api(k8s_api)
    core.create_namespaced_pod(namespace, {
        "metadata": {"name": "daemon"},
        "spec": {"nodeName": cluster.node_names[0],
                 "containers": [{"name": f"daemon-{i}", "image": "sidecar:1"}
                                for i in range(8)]},
    })
    kubeconfig = install_daemon_account(cluster, namespace)
    # The reporter's own client setup: $KUBECONFIG outside a cluster.
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    env = {"POD_NAME": "daemon", "POD_NAMESPACE": namespace, "WEIGHTCACHE_SPEC_HASH": "h"}
    reporters = [PodReporter.from_env(env) for _ in range(8)]
    try:
        for r in reporters:
            assert r is not None
            r.start()
        for i, r in enumerate(reporters):
            r.update(status(f"GPU-{i}", "loading"))
        for i, r in enumerate(reporters):
            r.update(status(f"GPU-{i}"))
        assert all(r.flush(timeout=60) for r in reporters)  # type: ignore[union-attr]
    finally:
        for r in reporters:
            if r is not None:
                r.stop()
    pod = core.read_namespaced_pod("daemon", namespace)
    report = json.loads(pod.metadata.annotations[REPORT_ANNOTATION])
    assert report["specHash"] == "h"
    assert sorted(report["gpus"]) == [f"GPU-{i}" for i in range(8)]
    assert {e["state"] for e in report["gpus"].values()} == {"Ready"}


def test_daemon_account_can_touch_pods_of_its_namespace_only(
    cluster: Cluster, namespace: str
) -> None:
    kubeconfig = install_daemon_account(cluster, namespace)
    daemon = k8s.CoreV1Api(k8s_config.new_client_from_config(config_file=str(kubeconfig)))
    patch = {"metadata": {"labels": {"x": "y"}}}
    for forbidden in (
        lambda: daemon.patch_node(cluster.node_names[0], patch),
        lambda: daemon.read_namespaced_pod("anything", "default"),
        lambda: daemon.list_namespaced_pod(namespace),
        lambda: daemon.delete_namespaced_pod("anything", namespace),
        lambda: daemon.patch_namespaced_pod_status("anything", namespace, patch),
    ):
        with pytest.raises(ApiException) as err:
            forbidden()
        assert err.value.status == 403
