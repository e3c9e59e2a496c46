"""Fixtures for tests against a real local control plane (tools/testenv).

The `cluster` fixture builds the pinned binaries when they are missing (a cold
build takes minutes, loudly) and starts etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and kwok once per session.
`real_cluster` is a second control plane with one kwok node and one real node
(kubelet + containerd + runc, images built from the repo's Dockerfiles), started
only when a test asks for it. Nothing here skips: a missing toolchain, a machine
that cannot run containers (the error names what is missing) or a failed start
fails the tests.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from tests.k8s.operator_flow import (
    Api,
    OperatorProcess,
    Scene,
    install_crd,
    install_operator_account,
    operator_policy,
)
from tools.testenv import assets, hostpkgs, images
from tools.testenv.cluster import Cluster, interrupt_on_termination
from tools.testenv.node import NodeSpec

OPERATOR_SA = "weightcache-operator"

K8S_TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if K8S_TESTS in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.k8s)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The running control plane: .kubeconfig, .server, .ca, .node_names, .mint_token(ns, sa),
    .service_account_kubeconfig(ns, sa), .kubectl(...), .helm(...), .env()."""
    # A SIGTERMed pytest must still run teardown; a SIGKILLed one takes the
    # components down through PR_SET_PDEATHSIG (tools/testenv/procs.py).
    interrupt_on_termination()
    binaries = assets.ensure_binaries()
    node_count = int(os.environ.get("WEIGHTCACHE_TESTENV_NODES", "2"))
    with Cluster(tmp_path_factory.mktemp("testenv"), binaries, node_count=node_count) as c:
        yield c


@pytest.fixture(scope="session")
def node_images() -> images.ImageSet:
    """The real node's images (built on first use, then cached by their inputs)."""
    hostpkgs.ensure_packages()
    return images.ensure_images()


@pytest.fixture(scope="session")
def real_cluster(
    tmp_path_factory: pytest.TempPathFactory, node_images: images.ImageSet
) -> Iterator[Cluster]:
    """A control plane with one kwok node and the real node `.real_node_name`."""
    interrupt_on_termination()
    base = tmp_path_factory.mktemp("realnode")
    # The image store too is reached through a symlink.
    (base / "cache").symlink_to(images.cache_dir())
    spec = NodeSpec(
        pause_image=node_images.refs["pause"],
        load_images=node_images.loader(),
        store_cache=base / "cache",
    )
    binaries = assets.ensure_binaries()
    with Cluster(long_symlinked_dir(base) / "plane", binaries, node_count=1,
                 real_node=spec) as c:
        yield c


def long_symlinked_dir(base: Path) -> Path:
    """A directory as a user's HOME may be: a long path, reached through a symlink. Every
    real-node test runs its node from one (issue 34: a long HOME made kubelet's CSI
    registration socket 108 bytes, one reached through a symlink broke Bidirectional mount
    propagation and left the containers' mounts behind at teardown)."""
    real = base / "real"
    real.mkdir()
    (base / "home").symlink_to(real)
    long = base / "home" / ("a-long-home-directory-" + "x" * 100)
    long.mkdir()
    return long


@pytest.fixture(scope="session")
def real_api(real_cluster: Cluster) -> Iterator[k8s.ApiClient]:
    """A `kubernetes` client ApiClient for `real_cluster`, as its admin."""
    api = k8s_config.new_client_from_config(config_file=str(real_cluster.kubeconfig))
    yield api
    api.close()


@pytest.fixture
def real_namespace(real_cluster: Cluster) -> Iterator[str]:
    """A fresh namespace of `real_cluster` per test, deleted afterwards (without waiting)."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    real_cluster.kubectl("create", "namespace", name)
    yield name
    real_cluster.kubectl("delete", "namespace", name, "--wait=false")


@pytest.fixture(scope="session")
def k8s_api(cluster: Cluster) -> Iterator[k8s.ApiClient]:
    """A `kubernetes` client ApiClient authenticated as the cluster admin."""
    api = k8s_config.new_client_from_config(config_file=str(cluster.kubeconfig))
    yield api
    api.close()


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards (without waiting)."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false")


@pytest.fixture
def api(k8s_api: k8s.ApiClient) -> Api:
    """Admin reads of what the tests check."""
    return Api(k8s_api)


@pytest.fixture(scope="module")
def operator_home(cluster: Cluster) -> str:
    """A namespace for the module's operator ServiceAccount (the CRD installed)."""
    install_crd(cluster)
    home = f"wc-operator-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", home)
    return home


@pytest.fixture(scope="module")
def operator(cluster: Cluster, operator_home: str, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[OperatorProcess]:
    """The operator as a process, one per test module, under exactly OPERATOR_RULES (and the
    daemon namespace's rules in its home, where it runs the caches' DaemonSets)."""
    kubeconfig = install_operator_account(cluster, operator_home, OPERATOR_SA)
    # Tests here delete daemon pods whose verdicts held and wait for the gates to close; a
    # short carry (a replaced pod's verdict, gate.carried: 120 s by default, tested on the
    # real node and in tests/unit) lets them close within seconds as the carry ends.
    op = OperatorProcess(kubeconfig, tmp_path_factory.mktemp("operator") / "operator.log",
                         operator_policy(operator_home), args=["--carry-seconds", "3"])
    op.start()
    yield op
    op.stop()


@pytest.fixture
def scene(cluster: Cluster, api: Api, namespace: str, operator: OperatorProcess,
          tmp_path: Path) -> Iterator[Scene]:
    """One WeightCache on one kwok node in a fresh namespace; logs printed afterwards."""
    s = Scene(cluster, api, namespace, operator, tmp_path)
    yield s
    s.close()
    for daemon in s.daemons:
        print(f"--- {daemon.log_path}\n{daemon.log_tail()}")
    print(f"--- operator log\n{operator.log_tail()}")
