"""The real node itself: kubelet, containerd and runc beside the kwok nodes.

Pods here are real containers from images built from this repository
(tools/testenv/images.py). Nothing asserts on time; waits poll with bounds.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kubernetes import client as k8s

from tests.k8s.conftest import long_symlinked_dir
from tests.k8s.operator_flow import eventually
from tests.k8s.realstack import tenant_pod
from tools.testenv import assets, cgroups, images, nodeclean, nodeconfig
from tools.testenv.assets import K8S_VERSION
from tools.testenv.cluster import Cluster

REPO_ROOT = Path(__file__).resolve().parents[2]

# Inside the pod: who am I, can I reach the API server, can I reach anything else?
PROBE = """
import json, os, socket
out = {"uid": os.getuid(), "addresses": socket.gethostbyname_ex(socket.gethostname())[2]}
api = (os.environ["KUBERNETES_SERVICE_HOST"], int(os.environ["KUBERNETES_SERVICE_PORT"]))
with socket.create_connection(api, timeout=5) as s:
    out["api"] = list(s.getpeername())
try:
    socket.create_connection(("1.1.1.1", 443), timeout=5).close()
    out["outside"] = "reached"
except OSError as e:
    out["outside"] = e.strerror
print(json.dumps(out))
"""


def probe_pod(name: str, image: str, host_network: bool, node_name: str) -> dict[str, Any]:
    return tenant_pod(name, image, node_name, ["python3", "-c", PROBE], host_network)


def run_to_completion(cluster: Cluster, namespace: str, pod: dict[str, Any]) -> dict[str, Any]:
    name = pod["metadata"]["name"]
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod))

    def finished() -> dict[str, Any] | None:
        got = json.loads(cluster.kubectl("get", "pod", "-n", namespace, name, "-o", "json").stdout)
        return got if got["status"].get("phase") in ("Succeeded", "Failed") else None

    return eventually(f"pod {name} finishes", finished, bound=180)


def test_the_real_node_joins_beside_kwok_with_the_pinned_kubelet(real_cluster: Cluster,
                                                                  real_api: k8s.ApiClient) -> None:
    core = k8s.CoreV1Api(real_api)
    real = core.read_node(real_cluster.real_node_name)
    info = real.status.node_info
    assert info.kubelet_version == K8S_VERSION
    assert info.container_runtime_version.startswith("containerd://1.6")
    assert real.metadata.labels[nodeconfig.NODE_LABEL] == nodeconfig.NODE_LABEL_VALUE
    addresses = {a.type: a.address for a in real.status.addresses}
    assert addresses["InternalIP"] == nodeconfig.NODE_IP
    kwok = core.read_node(real_cluster.node_names[0])
    assert kwok.status.node_info.kubelet_version == K8S_VERSION
    assert nodeconfig.NODE_LABEL not in (kwok.metadata.labels or {})


def test_a_host_network_pod_runs_to_completion_and_reaches_only_the_api_server(
    real_cluster: Cluster, node_images: images.ImageSet, real_namespace: str
) -> None:
    pod = run_to_completion(real_cluster, real_namespace, probe_pod(
        "host-probe", node_images.refs["python"], True, real_cluster.real_node_name))
    assert pod["status"]["phase"] == "Succeeded", pod["status"]
    assert pod["status"]["podIP"] == nodeconfig.NODE_IP
    # kubectl logs: the API server reaches kubelet through the node's egress bridge.
    out = json.loads(real_cluster.kubectl("logs", "-n", real_namespace, "host-probe").stdout)
    assert out["uid"] == 4242
    assert out["api"] == ["10.96.0.1", 443]
    assert out["outside"] == "Network is unreachable"


def test_a_pod_network_pod_gets_its_own_address_and_reaches_only_the_api_server(
    real_cluster: Cluster, node_images: images.ImageSet, real_namespace: str
) -> None:
    pod = run_to_completion(real_cluster, real_namespace, probe_pod(
        "pod-probe", node_images.refs["python"], False, real_cluster.real_node_name))
    assert pod["status"]["phase"] == "Succeeded", pod["status"]
    prefix = nodeconfig.POD_SUBNET.rsplit(".", 1)[0] + "."
    assert pod["status"]["podIP"].startswith(prefix)
    out = json.loads(real_cluster.kubectl("logs", "-n", real_namespace, "pod-probe").stdout)
    assert out["api"] == ["10.96.0.1", 443]
    assert out["outside"] == "Network is unreachable"


# -- teardown -------------------------------------------------------------------

SLEEPER = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "sleeper", "namespace": "default"},
    "spec": {"nodeSelector": {"kubernetes.io/hostname": nodeconfig.DEFAULT_NAME},
             "securityContext": {"runAsUser": 4242, "runAsGroup": 4242},
             "containers": [{"name": "sleep", "image": "IMAGE", "imagePullPolicy": "Never",
                             "command": ["python3", "-c", "import time; time.sleep(3600)"]}]},
}

# Owns a cluster with a real node running one pod, prints the node's layout, then waits
# to be killed. Only the small images: the store slot it lands in may be a cold one.
# Its umask is one a test process once had (0117): the node and its images must not
# inherit it, or the non-root pod cannot enter its own root filesystem.
OWNER = """
import json, os, sys, time
os.umask(0o117)
from dataclasses import asdict
from pathlib import Path
from tools.testenv import assets, images
from tools.testenv.cluster import Cluster, interrupt_on_termination
from tools.testenv.node import NodeSpec
interrupt_on_termination()
built = images.ensure_images()
spec = NodeSpec(built.refs["pause"], built.loader(["pause", "python"]), images.cache_dir())
cluster = Cluster(Path(sys.argv[1]), assets.ensure_binaries(), node_count=1, real_node=spec)
cluster.start()
pod = json.loads(sys.argv[2].replace("IMAGE", built.refs["python"]))
cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
cluster.kubectl("wait", "--for=condition=Ready", "pod/sleeper", "--timeout=180s")
print(json.dumps(asdict(cluster.node.layout)), flush=True)
time.sleep(3600)
"""


def leftovers(layout: nodeconfig.Layout, sysctls_before: dict[str, str],
              *more: Path) -> list[str]:
    """Everything of the node still on this machine (empty after a complete teardown).
    Mounts are counted below the resolved paths of the node's directories and of `more`,
    as the kernel names them, whatever the node's own record says."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            cgroup = (entry / "cgroup").read_text()
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue
        # A zombie has exited and holds nothing; it waits for its (re)parent to reap it,
        # which on a loaded machine can come a moment after the teardown returned.
        if state in ("Z", "X"):
            continue
        if layout.run in cmdline or layout.cgroup in cgroup:
            found.append(f"process {entry.name}: {cmdline[:120]}")
    dirs = (layout.run, layout.store, layout.sockets, layout.socket_root, *map(str, more))
    found += [f"mount {m}" for m in nodeclean.mounts_under(*map(os.path.realpath, dirs))]
    if Path(layout.socket_root).exists():
        found.append(f"socket root {layout.socket_root}")
    found += [f"cgroup {h / layout.cgroup}" for h in cgroups.hierarchies()
              if (h / layout.cgroup).exists()]
    if layout.netns.exists():
        found.append(f"netns pin {layout.netns}")
    if Path(layout.sockets).exists():
        found.append(f"socket directory {layout.sockets}")
    if nodeclean.SHIM_SOCKET_DIR.is_dir():
        found += [f"shim socket {s}" for s in nodeclean.SHIM_SOCKET_DIR.iterdir()]
    if nodeclean.CONTAINER_LOG_LINKS.is_dir():
        found += [f"log link {s}" for s in nodeclean.CONTAINER_LOG_LINKS.iterdir()
                  if os.readlink(s).startswith(layout.run)]
    found += [f"sysctl {k} is {v!r}, was {sysctls_before[k]!r}" for k, v in sysctls().items()
              if v != sysctls_before[k]]
    containers = subprocess.run(
        ["ctr", f"--address={layout.containerd_socket}", "containers", "list"],
        capture_output=True, text=True)
    if containers.returncode == 0:
        found.append("containerd still answers")
    return found


def sysctls() -> dict[str, str]:
    return {name: Path("/proc/sys", name).read_text().strip()
            for name in nodeconfig.KUBELET_SYSCTLS}


@contextlib.contextmanager
def owner_of_a_node(plane: Path) -> Iterator[tuple[subprocess.Popen[bytes], nodeconfig.Layout]]:
    """A process that starts a control plane with a real node and keeps it; killed at the end
    if the test has not ended it."""
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(plane), json.dumps(SLEEPER)],
        stdout=subprocess.PIPE, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline()
        assert line, f"the owner exited with {owner.wait()} before its node was up"
        yield owner, nodeconfig.Layout(**json.loads(line))
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def test_up_and_down_from_a_long_symlinked_home_leave_no_mount_nor_anything(
    tmp_path: Path, node_images: images.ImageSet
) -> None:
    """Issue 34 item 5: `python -m tools.testenv up --real-node` and `down` as a user runs
    them, from a HOME that is long and reached through a symlink. Once, `down` left 26
    mounts (containers' root filesystems included): teardown looked for them by the
    symlinked path, and the kernel names resolved ones. The umask is one a shell once had
    (0117): the node and its images must not inherit it."""
    home = long_symlinked_dir(tmp_path)
    cache = home / ".cache" / "weightcache" / "testenv"
    cache.mkdir(parents=True)
    # The built binaries and images, reached through links (building them again takes
    # minutes); the run itself, its state and the node's store slot live under the HOME.
    binaries = assets.ensure_binaries()
    (cache / "images").symlink_to(images.cache_dir())
    (cache / assets.pin_key()).symlink_to(assets.pinned_bin_dir().parent)
    env = {k: v for k, v in os.environ.items()
           if k not in ("XDG_CACHE_HOME", "WEIGHTCACHE_TESTENV_CACHE")}
    env.update(HOME=str(home), PYTHONPATH=str(REPO_ROOT))
    name = f"home-{os.getpid()}"

    def testenv(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tools.testenv", *args, f"--name={name}"],
                              env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=600, umask=0o117)

    before = sysctls()
    up = testenv("up", "--real-node", "--images=pause,python")
    state = cache / "runs" / name / "cluster" / "node" / "node.json"
    try:
        assert up.returncode == 0, up.stderr[-4000:]
        layout = nodeconfig.Layout(**json.loads(state.read_text())["layout"])
        assert layout.run == os.path.realpath(layout.run)
        # kubelet's root is short whatever the HOME: the longest socket it dials fits.
        registration = layout.kubelet_root / "plugins_registry" / "weightcache.dev-reg.sock"
        assert len(str(registration).encode()) <= 107
        kubeconfig = shlex.split(up.stdout.splitlines()[0].removeprefix("export "))[0]
        kubectl = [str(binaries["kubectl"]), kubeconfig.replace("KUBECONFIG=", "--kubeconfig=")]
        pod = json.dumps(SLEEPER).replace("IMAGE", node_images.refs["python"])
        subprocess.run([*kubectl, "apply", "-f", "-"], input=pod, text=True, check=True,
                       capture_output=True)
        subprocess.run([*kubectl, "wait", "--for=condition=Ready", "pod/sleeper",
                        "--timeout=180s"], check=True, capture_output=True)
        running = leftovers(layout, before, home)
        assert [m for m in running if m.startswith("mount ")], "the node should be running now"
    finally:
        down = testenv("down")
    assert down.returncode == 0, down.stderr[-4000:]
    assert leftovers(layout, before, home) == []
    assert nodeclean.stored_containers(layout) == []


def test_a_sigkilled_owner_is_cleaned_up_by_the_guard(tmp_path: Path) -> None:
    before = sysctls()
    plane = long_symlinked_dir(tmp_path) / "plane"
    with owner_of_a_node(plane) as (owner, layout):
        owner.kill()  # no atexit, no signal handler, no fixture teardown
        owner.wait()
    eventually("the guard tears the node down",
               lambda: not leftovers(layout, before, plane) or None, bound=180)
    assert leftovers(layout, before, plane) == []
    assert nodeclean.stored_containers(layout) == []
