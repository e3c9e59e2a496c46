"""The real node's configuration, pure: where its pieces live and what each is told.

containerd's config.toml, the CNI network, kubelet's KubeletConfiguration and
flags, the API server's egress to the node, and the RBAC bindings nodes need;
node.py writes them and starts the processes, nodeclean.py undoes it all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools.testenv import pki

NODE_IP = "10.250.0.1"
# Real pods' addresses (kwok's fake ones come from 10.244.0.0/16).
POD_SUBNET = "10.245.0.0/24"
DEFAULT_NAME = "real-0"
# The socket root's tmpfs: room for many caches' sockets and manifests, little enough to
# fill in a moment (blocks and inodes).
SOCKET_ROOT_OPTIONS = "size=16m,nr_inodes=2048,mode=0755"
KUBELET_PORT = 10250
API_SERVICE_PORT = 443
CNI_BIN_DIR = "/usr/lib/cni"
CONTAINERD_NAMESPACE = "k8s.io"
# Set on the node by kubelet (NodeRestriction allows keys outside kubernetes.io).
NODE_LABEL = "testenv.weightcache.dev/node"
NODE_LABEL_VALUE = "real"
# kubelet sets these host-wide kernel tunables at start; teardown puts them back.
KUBELET_SYSCTLS = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)


@dataclass(frozen=True)
class Layout:
    """Where one node's pieces live; also the guard's and `down`'s record of what to undo."""

    # Every path here is resolved (no symlink in it): the kernel's mount table names
    # resolved paths, so teardown finds mounts by them, and containerd grants Bidirectional
    # propagation only where the path it is given lies on a shared mount by its text.
    run: str  # per-run: state, configs, logs, the netns pin
    store: str  # containerd root (images): a cache slot or a directory inside `run`
    name: str
    cgroup: str
    cluster_ip: str  # the `kubernetes` Service IP, on the namespace's lo
    # Unix sockets (containerd's, the bridge's, and those kubelet dials below its root)
    # need a path of at most 107 bytes, which a user's HOME or a test's tmp directory may
    # not give: a short directory of their own under /tmp, holding kubelet's root too.
    sockets: str
    # A small tmpfs of the node's own for pods' sockets (a WeightCache's socketDir): small,
    # so a test can fill it. Empty in state files written before it existed.
    socket_root: str = ""

    def path(self, *parts: str) -> Path:
        return Path(self.run, *parts)

    @property
    def netns(self) -> Path:
        return self.path("netns")

    @property
    def containerd_state(self) -> Path:
        return self.path("containerd")

    @property
    def containerd_socket(self) -> Path:
        return Path(self.sockets, "containerd.sock")

    @property
    def runc_root(self) -> Path:
        return self.path("runc")

    @property
    def cni_conf_dir(self) -> Path:
        return self.path("cni")

    @property
    def kubelet_root(self) -> Path:
        """Short, whatever `run` is: kubelet dials plugins at
        `<root>/plugins_registry/<driver>-reg.sock` and serves `<root>/device-plugins/
        kubelet.sock` (once a long HOME made the CSI registration socket 108 bytes)."""
        return Path(self.sockets, "kubelet")

    @property
    def pod_logs(self) -> Path:
        return self.path("pod-logs")

    @property
    def egress_socket(self) -> Path:
        return Path(self.sockets, "egress.sock")

    @property
    def state_file(self) -> Path:
        return self.path("node.json")

    @property
    def dirty_marker(self) -> Path:
        return Path(self.store, "dirty")


def containerd_config(layout: Layout, pause_image: str, cri: bool = True) -> str:
    """containerd 1.6 config: every path inside the run or the store, CRI for kubelet.

    restrict_oom_score_adj: this machine's bounding set lacks CAP_SYS_RESOURCE,
    and without it runc fails with a misleading "can't get final child's PID".
    """
    disabled = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper"]
    if not cri:
        disabled.append("io.containerd.grpc.v1.cri")
    state = layout.containerd_state
    return f"""version = 2
root = "{layout.store}/root"
state = "{state}"
disabled_plugins = {json.dumps(disabled)}
[grpc]
  address = "{layout.containerd_socket}"
[ttrpc]
  address = "{layout.containerd_socket}.ttrpc"
[plugins]
  [plugins."io.containerd.internal.v1.opt"]
    path = "{layout.store}/opt"
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "{pause_image}"
    restrict_oom_score_adj = true
    enable_selinux = false
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
    netns_mounts_under_state_dir = true
    [plugins."io.containerd.grpc.v1.cri".containerd]
      snapshotter = "overlayfs"
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          SystemdCgroup = false
          Root = "{layout.runc_root}"
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "{CNI_BIN_DIR}"
      conf_dir = "{layout.cni_conf_dir}"
"""


def cni_config(layout: Layout) -> dict[str, Any]:
    """Pods that are not hostNetwork get a point-to-point veth into the node's namespace.

    The operator's DaemonSet and the chart's Deployment use the pod network;
    through the veth they reach the `kubernetes` Service IP (on the node's
    `lo`, served by the bridge) and kubelet reaches their probes. The node's
    namespace has no other device, so pod traffic still ends inside it.
    """
    return {
        "cniVersion": "0.4.0",
        "name": "testenv-ptp",
        "plugins": [
            {
                "type": "ptp",
                "ipMasq": False,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_SUBNET}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(layout.path("cni-ipam")),
                },
            }
        ],
    }


def kubelet_config(layout: Layout, ca: Path, serving: pki.KeyPair) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": NODE_IP,
        "port": KUBELET_PORT,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "tlsCertFile": str(serving.cert),
        "tlsPrivateKeyFile": str(serving.key),
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(ca)},
        },
        "authorization": {"mode": "Webhook"},
        "containerRuntimeEndpoint": f"unix://{layout.containerd_socket}",
        # This machine: cgroup v1, PID 1 is not systemd.
        "cgroupDriver": "cgroupfs",
        "failCgroupV1": False,
        "cgroupRoot": f"/{layout.cgroup}",
        "failSwapOn": False,
        "podLogsDir": str(layout.pod_logs),
        "volumePluginDir": str(layout.path("kubelet-plugins")),
        "resolvConf": "",
        "makeIPTablesUtilChains": False,
        "podPidsLimit": 4096,
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1Gi",
            "imagefs.available": "1Gi",
            "nodefs.inodesFree": "1%",
        },
        # The disk reports far more size than is free: with the defaults kubelet
        # deleted every image (pause included). Imported images are never pulled again.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "shutdownGracePeriod": "0s",
    }


def kubelet_args(layout: Layout, config: Path, kubeconfig_path: Path) -> list[str]:
    return [
        f"--config={config}",
        f"--kubeconfig={kubeconfig_path}",
        f"--root-dir={layout.kubelet_root}",
        f"--hostname-override={layout.name}",
        f"--node-ip={NODE_IP}",
        f"--node-labels={NODE_LABEL}={NODE_LABEL_VALUE}",
        "--v=2",
    ]


def egress_selector_config(egress_socket: Path) -> dict[str, Any]:
    """The API server reaches nodes (logs, exec, port-forward) through bridge.py only."""
    return {
        "apiVersion": "apiserver.k8s.io/v1beta1",
        "kind": "EgressSelectorConfiguration",
        "egressSelections": [
            {
                "name": "cluster",
                "connection": {
                    "proxyProtocol": "HTTPConnect",
                    "transport": {"uds": {"udsName": str(egress_socket)}},
                },
            }
        ],
    }


def rbac_bindings() -> list[dict[str, Any]]:
    """Nodes as RBAC's system:node role (the API server runs no Node authorizer), and the
    API server's kubelet client as system:kubelet-api-admin (kubelet authorizes by webhook)."""

    def binding(name: str, role: str, subject: dict[str, str]) -> dict[str, Any]:
        return {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": role},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", **subject}],
        }

    return [
        binding("testenv:nodes", "system:node", {"kind": "Group", "name": "system:nodes"}),
        binding("testenv:apiserver-kubelet-client", "system:kubelet-api-admin",
                {"kind": "User", "name": pki.APISERVER_KUBELET_CLIENT}),
    ]


def ctr_argv(layout: Layout) -> list[str]:
    """The `ctr` command line for the node's containerd, in CRI's namespace."""
    return ["ctr", f"--address={layout.containerd_socket}", f"--namespace={CONTAINERD_NAMESPACE}"]
