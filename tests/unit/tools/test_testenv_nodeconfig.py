from pathlib import Path

import pytest

from tools.testenv import nodeconfig, pki

# The standard library's TOML reader (Python >= 3.11, which Debian 12 ships).
tomllib = pytest.importorskip("tomllib", reason="Python < 3.11 has no tomllib")

LAYOUT = nodeconfig.Layout(run="/r", store="/s", name="real-0", cgroup="wc-test",
                           cluster_ip="10.96.0.1", sockets="/t")


def test_containerd_keeps_every_path_in_the_run_or_the_store() -> None:
    config = tomllib.loads(nodeconfig.containerd_config(LAYOUT, "localhost/pause:1"))
    assert config["root"] == "/s/root"
    assert config["state"] == "/r/containerd"
    assert config["grpc"]["address"] == "/t/containerd.sock"
    assert config["ttrpc"]["address"] == "/t/containerd.sock.ttrpc"
    assert config["plugins"]["io.containerd.internal.v1.opt"]["path"] == "/s/opt"
    cri = config["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["sandbox_image"] == "localhost/pause:1"
    # Without it runc fails on this machine: CAP_SYS_RESOURCE is not in the bounding set.
    assert cri["restrict_oom_score_adj"] is True
    runc = cri["containerd"]["runtimes"]["runc"]
    assert runc["options"] == {"SystemdCgroup": False, "Root": "/r/runc"}
    assert cri["cni"] == {"bin_dir": nodeconfig.CNI_BIN_DIR, "conf_dir": "/r/cni"}
    # Pod namespaces are pinned below the run directory, not in /run/netns.
    assert cri["netns_mounts_under_state_dir"] is True


def test_the_scrubbing_containerd_runs_without_cri() -> None:
    on = tomllib.loads(nodeconfig.containerd_config(LAYOUT, "p"))
    off = tomllib.loads(nodeconfig.containerd_config(LAYOUT, "p", cri=False))
    assert "io.containerd.grpc.v1.cri" not in on["disabled_plugins"]
    assert "io.containerd.grpc.v1.cri" in off["disabled_plugins"]


def test_pods_get_a_veth_into_the_node_namespace_and_ipam_state_stays_in_the_run() -> None:
    (ptp,) = nodeconfig.cni_config(LAYOUT)["plugins"]
    assert ptp["type"] == "ptp"
    assert ptp["ipMasq"] is False
    assert ptp["ipam"]["ranges"] == [[{"subnet": nodeconfig.POD_SUBNET}]]
    assert ptp["ipam"]["dataDir"].startswith("/r/")


def test_kubelet_authenticates_clients_and_never_deletes_imported_images() -> None:
    serving = pki.KeyPair(Path("/k/s.crt"), Path("/k/s.key"))
    config = nodeconfig.kubelet_config(LAYOUT, Path("/ca.crt"), serving)
    assert config["address"] == nodeconfig.NODE_IP
    assert config["readOnlyPort"] == 0
    assert config["authentication"]["anonymous"]["enabled"] is False
    assert config["authentication"]["x509"]["clientCAFile"] == "/ca.crt"
    assert config["authorization"]["mode"] == "Webhook"
    assert config["containerRuntimeEndpoint"] == "unix:///t/containerd.sock"
    assert config["cgroupRoot"] == "/wc-test"
    assert config["cgroupDriver"] == "cgroupfs"
    assert config["imageGCHighThresholdPercent"] == 100
    assert config["podLogsDir"].startswith("/r/")
    assert config["volumePluginDir"].startswith("/r/")
    assert all(v.endswith(("Mi", "Gi", "%")) for v in config["evictionHard"].values())


def test_kubelet_flags_name_the_node_and_its_address() -> None:
    flags = nodeconfig.kubelet_args(LAYOUT, Path("/r/k.yaml"), Path("/r/k.kubeconfig"))
    assert "--hostname-override=real-0" in flags
    assert f"--node-ip={nodeconfig.NODE_IP}" in flags
    assert "--root-dir=/t/kubelet" in flags
    assert f"--node-labels={nodeconfig.NODE_LABEL}={nodeconfig.NODE_LABEL_VALUE}" in flags


def test_kubelets_sockets_fit_whatever_the_run_directory() -> None:
    """Issue 34 item 5: under a long HOME, kubelet's plugin registration socket was 108 bytes
    (CSI registration failed; engine pods stayed ContainerCreating). kubelet's root lies in
    the node's short socket directory, not in the run directory."""
    layout = nodeconfig.Layout(run="/home/" + "x" * 200 + "/run", store="/s", name="real-0",
                               cgroup="wc-test", cluster_ip="10.96.0.1",
                               sockets="/tmp/wc-node-4194304-abcdef")
    for socket in (layout.kubelet_root / "plugins_registry" / "weightcache.dev-reg.sock",
                   layout.kubelet_root / "plugins" / "weightcache.dev" / "csi.sock",
                   layout.kubelet_root / "device-plugins" / "kubelet.sock",
                   layout.kubelet_root / "pod-resources" / "kubelet.sock",
                   layout.containerd_socket, layout.egress_socket):
        assert len(str(socket).encode()) <= 107, socket


def test_the_api_server_reaches_nodes_only_through_the_bridge_socket() -> None:
    config = nodeconfig.egress_selector_config(Path("/r/egress.sock"))
    (selection,) = config["egressSelections"]
    assert selection["name"] == "cluster"
    assert selection["connection"] == {
        "proxyProtocol": "HTTPConnect",
        "transport": {"uds": {"udsName": "/r/egress.sock"}},
    }


def test_nodes_get_the_node_role_and_the_api_server_the_kubelet_api() -> None:
    bindings = {b["metadata"]["name"]: b for b in nodeconfig.rbac_bindings()}
    nodes = bindings["testenv:nodes"]
    assert nodes["roleRef"]["name"] == "system:node"
    assert nodes["subjects"][0]["name"] == "system:nodes"
    client = bindings["testenv:apiserver-kubelet-client"]
    assert client["roleRef"]["name"] == "system:kubelet-api-admin"
    assert client["subjects"] == [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                                   "name": pki.APISERVER_KUBELET_CLIENT}]
