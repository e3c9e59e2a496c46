"""The daemon's reporter against the real API server, with the daemon's own rights."""

from __future__ import annotations

import pytest
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from tests.k8s.operator_flow import install_daemon_account, reports_of
from tools.testenv.cluster import Cluster
from weightcache.daemon.reporter import PodReporter
from weightcache.protocol import DaemonStatus

pytestmark = pytest.mark.k8s
HASH = "a" * 64


def status(gpu: str, state: str = "ready") -> DaemonStatus:
    return DaemonStatus(
        state=state, pid=1, device="cuda:0", gpu=gpu, transport_backend="vmm_fd",  # type: ignore[arg-type]
        preloaded_weights_bytes=1000, expected_bytes=1000, fingerprint="f" * 64,
        load_seconds=2.0, load_source="disk", readopted=False, socket="/s",
        clients_served=0, error=None,
    )


def test_daemons_sharing_a_pod_each_report_their_device(
    cluster: Cluster, k8s_api: k8s.ApiClient, namespace: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    core = k8s.CoreV1Api(k8s_api)
    node = cluster.node_names[0]
    core.create_namespaced_pod(namespace, {
        "metadata": {"name": "daemon"},
        "spec": {"nodeName": node,
                 "containers": [{"name": f"daemon-{i}", "image": "sidecar:1"}
                                for i in range(8)]},
    })
    kubeconfig = install_daemon_account(cluster, namespace)
    # The reporter's own client setup: $KUBECONFIG outside a cluster.
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    env = {"POD_NAME": "daemon", "POD_NAMESPACE": namespace, "WEIGHTCACHE_SPEC_HASH": HASH,
           "NODE_NAME": node}
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
    reports = reports_of(core.read_namespaced_pod("daemon", namespace))
    assert sorted(reports) == [f"GPU-{i}" for i in range(8)]
    assert {(r.state, r.spec_hash, r.node) for r in reports.values()} == {("Ready", HASH, node)}


def test_daemon_account_cannot_read_any_pod(
    cluster: Cluster, k8s_api: k8s.ApiClient, namespace: str
) -> None:
    """The reporter writes without reading: its token sees no pod's spec or environment.

    Once, the daemon could `get` every pod of its namespace and read a secret
    from an engine's env.
    """
    core = k8s.CoreV1Api(k8s_api)
    core.create_namespaced_pod(namespace, {
        "metadata": {"name": "engine"},
        "spec": {"nodeName": cluster.node_names[0],
                 "containers": [{"name": "engine", "image": "engine:1",
                                 "env": [{"name": "API_KEY", "value": "s3cret"}]}]},
    })
    kubeconfig = install_daemon_account(cluster, namespace)
    daemon = k8s.CoreV1Api(k8s_config.new_client_from_config(config_file=str(kubeconfig)))
    patch = {"metadata": {"labels": {"x": "y"}}}
    for forbidden in (
        lambda: daemon.read_namespaced_pod("engine", namespace),
        lambda: daemon.list_namespaced_pod(namespace),
        lambda: daemon.patch_node(cluster.node_names[0], patch),
        lambda: daemon.read_namespaced_pod("anything", "default"),
        lambda: daemon.delete_namespaced_pod("engine", namespace),
        lambda: daemon.patch_namespaced_pod_status("engine", namespace, patch),
    ):
        with pytest.raises(ApiException) as err:
            forbidden()
        assert err.value.status == 403
