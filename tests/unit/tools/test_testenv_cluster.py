from pathlib import Path

import yaml

from tools.testenv import cluster, nodes, pki

PORTS = cluster.Ports(
    etcd_client=1001, etcd_peer=1002, apiserver=1003, controller_manager=1004, scheduler=1005
)


def _pki(root: Path) -> pki.Pki:
    def pair(name: str) -> pki.KeyPair:
        return pki.KeyPair(root / f"{name}.crt", root / f"{name}.key")

    return pki.Pki(
        pair("ca"),
        pair("apiserver"),
        pair("admin"),
        pair("kcm"),
        pair("sched"),
        pair("kubelet-client"),
        root / "sa.key",
        root / "sa.pub",
    )


def _flags(args: list[str]) -> dict[str, str]:
    return {k: v for k, _, v in (a.removeprefix("--").partition("=") for a in args)}


def test_apiserver_serves_only_tls_on_loopback_with_rbac(tmp_path: Path) -> None:
    flags = _flags(cluster.apiserver_args(_pki(tmp_path), PORTS, tmp_path))
    assert flags["bind-address"] == "127.0.0.1"
    assert flags["secure-port"] == "1003"
    assert flags["authorization-mode"] == "RBAC"
    assert flags["etcd-servers"] == "http://127.0.0.1:1001"
    assert flags["client-ca-file"] == str(tmp_path / "ca.crt")
    assert flags["service-account-signing-key-file"] == str(tmp_path / "sa.key")
    assert not any(k.startswith("insecure") for k in flags)
    assert flags["kubelet-certificate-authority"] == str(tmp_path / "ca.crt")
    assert flags["kubelet-client-certificate"] == str(tmp_path / "kubelet-client.crt")
    assert "egress-selector-config-file" not in flags


def test_a_real_node_routes_the_api_servers_node_traffic_through_egress(tmp_path: Path) -> None:
    egress = tmp_path / "egress.json"
    flags = _flags(cluster.apiserver_args(_pki(tmp_path), PORTS, tmp_path, egress))
    assert flags["egress-selector-config-file"] == str(egress)
    assert flags["kubelet-preferred-address-types"] == "InternalIP"


def test_controllers_sign_tokens_and_publish_the_root_ca(tmp_path: Path) -> None:
    config = tmp_path / "kcm.kubeconfig"
    flags = _flags(cluster.controller_manager_args(_pki(tmp_path), PORTS, config, tmp_path))
    assert flags["service-account-private-key-file"] == str(tmp_path / "sa.key")
    assert flags["root-ca-file"] == str(tmp_path / "ca.crt")
    assert flags["use-service-account-credentials"] == "true"
    assert flags["bind-address"] == "127.0.0.1"
    assert flags["kubeconfig"] == str(config)


def test_the_node_controller_waits_longer_than_kwok_renews_leases(tmp_path: Path) -> None:
    config = tmp_path / "kcm.kubeconfig"
    for lease in (cluster.NODE_LEASE_SECONDS, 600):
        kcm = _flags(cluster.controller_manager_args(_pki(tmp_path), PORTS, config, tmp_path,
                                                     lease))
        kwok = _flags(cluster.kwok_args(config, lease))
        assert kwok["node-lease-duration-seconds"] == str(lease)
        # A node counts as gone only after a whole lease without renewal (kwok renews
        # every quarter of it).
        assert int(kcm["node-monitor-grace-period"].removesuffix("s")) > lease
    # The default keeps the controller's own default grace period.
    kcm = _flags(cluster.controller_manager_args(_pki(tmp_path), PORTS, config, tmp_path))
    assert kcm["node-monitor-grace-period"] == "50s"


def test_etcd_listens_on_loopback_only(tmp_path: Path) -> None:
    flags = _flags(cluster.etcd_args(tmp_path, PORTS))
    assert flags["listen-client-urls"] == "http://127.0.0.1:1001"
    assert flags["listen-peer-urls"] == "http://127.0.0.1:1002"


def test_kwok_manages_only_annotated_nodes_with_our_stages(tmp_path: Path) -> None:
    flags = _flags(cluster.kwok_args(tmp_path / "admin.kubeconfig"))
    assert flags["manage-all-nodes"] == "false"
    assert flags["manage-nodes-with-annotation-selector"] == (
        f"{nodes.KWOK_NODE_ANNOTATION}={nodes.KWOK_NODE_ANNOTATION_VALUE}"
    )
    assert Path(flags["config"]) == cluster.STAGES_FILE
    assert cluster.STAGES_FILE.is_file()


def test_node_ready_reads_the_ready_condition() -> None:
    assert cluster._node_ready({"status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    assert not cluster._node_ready(
        {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    )
    assert not cluster._node_ready({})


def test_both_readiness_from_reports_stages_name_the_clusters_toleration_key() -> None:
    """The key lives twice in stages.yaml (a Go template, a jq selector) and once in
    Python: the pod that starts NotReady and the stage that makes it Ready must agree."""
    stages = {s["metadata"]["name"]: s for s in yaml.safe_load_all(cluster.STAGES_FILE.read_text())
              if s}
    start = stages["pod-ready"]["spec"]["next"]["statusTemplate"]
    flip = stages["pod-readiness-from-reports"]["spec"]["selector"]["matchExpressions"]
    assert f'"{cluster.READINESS_FROM_REPORTS}"' in start
    assert any(f'"{cluster.READINESS_FROM_REPORTS}"' in e["key"] for e in flip)
