"""Fixtures for tests against a real local control plane (tools/testenv).

The `cluster` fixture builds the pinned binaries when they are missing (a cold
build takes minutes, loudly) and starts etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and kwok once per session. Nothing
here skips: a missing toolchain or a failed start fails the tests.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from tools.testenv import assets
from tools.testenv.cluster import Cluster, interrupt_on_termination

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
