"""Start, use and stop one local control plane: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and kwok with fake GPU nodes, and on
request one real node (node.py: kubelet, containerd, runc).

Everything listens on loopback ports chosen free at start; every process sits
in one process group owned by the Cluster (see procs.py), so stop() — or the
owner's death — leaves nothing running and nothing listening. The real node
has its own teardown (and a guard for the owner's death).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tools.testenv import kubeconfig, nodes, pki
from tools.testenv.apiclient import ApiClient, ApiError
from tools.testenv.node import NodeSpec, RealNode
from tools.testenv.nodeconfig import egress_selector_config
from tools.testenv.procs import ProcessGroup, free_ports

SERVICE_CIDR = "10.96.0.0/16"
# The first address of SERVICE_CIDR: the `kubernetes` Service's ClusterIP.
SERVICE_IP = "10.96.0.1"
# Fake pod and node addresses kwok hands out; no traffic ever goes to them.
POD_CIDR = "10.244.0.1/16"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
STAGES_FILE = Path(__file__).resolve().parent / "kwok" / "stages.yaml"
# A kwok pod that tolerates this key (any effect) is Ready only while each of its containers
# has a report annotation saying Ready, as a daemon's readiness probe answers (stages.yaml).
READINESS_FROM_REPORTS = "kwok.weightcache.dev/readiness-from-reports"
# kwok renews each node's lease every quarter of this. The node controller's grace
# period follows it (lease + 10 s: 50 s, the controller's default, for 40 s).
NODE_LEASE_SECONDS = 40


class StartupError(RuntimeError):
    pass


# What a component answers while it is still starting.
_STARTUP_RETRY = (OSError, ApiError, KeyError, ValueError)


@dataclass(frozen=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int

    @classmethod
    def pick(cls) -> Ports:
        return cls(*free_ports(5))


def etcd_args(data_dir: Path, ports: Ports) -> list[str]:
    client = f"http://127.0.0.1:{ports.etcd_client}"
    peer = f"http://127.0.0.1:{ports.etcd_peer}"
    return [
        "--name=testenv",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=testenv={peer}",
        # Throwaway data: fsync only slows tests on a shared disk.
        "--unsafe-no-fsync",
        "--log-level=warn",
    ]


def apiserver_args(
    certs: pki.Pki, ports: Ports, cert_dir: Path, egress_config: Path | None = None
) -> list[str]:
    """Flags of the API server; `egress_config` routes its connections to nodes (a real
    node's kubelet: logs, exec) through the node's bridge."""
    args = [
        f"--etcd-servers=http://127.0.0.1:{ports.etcd_client}",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        f"--secure-port={ports.apiserver}",
        f"--cert-dir={cert_dir}",
        f"--tls-cert-file={certs.apiserver.cert}",
        f"--tls-private-key-file={certs.apiserver.key}",
        f"--client-ca-file={certs.ca.cert}",
        "--authorization-mode=RBAC",
        "--enable-admission-plugins=NodeRestriction,OwnerReferencesPermissionEnforcement",
        f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
        f"--service-account-key-file={certs.service_account_pub}",
        f"--service-account-signing-key-file={certs.service_account_key}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--allow-privileged=true",
        "--profiling=false",
        # Towards kubelets (only a real node has one): mutual TLS with the cluster CA.
        f"--kubelet-client-certificate={certs.apiserver_kubelet_client.cert}",
        f"--kubelet-client-key={certs.apiserver_kubelet_client.key}",
        f"--kubelet-certificate-authority={certs.ca.cert}",
        "--kubelet-preferred-address-types=InternalIP",
        # There is no kube-proxy: a Service-referenced admission webhook (the chart's)
        # is dialled at its endpoint's pod IP, through the egress to the node, not at
        # a ClusterIP nothing answers.
        "--enable-aggregator-routing=true",
    ]
    if egress_config is not None:
        args.append(f"--egress-selector-config-file={egress_config}")
    return args


def controller_manager_args(
    certs: pki.Pki, ports: Ports, config: Path, cert_dir: Path,
    node_lease_seconds: int = NODE_LEASE_SECONDS,
) -> list[str]:
    return [
        f"--kubeconfig={config}",
        f"--authentication-kubeconfig={config}",
        f"--authorization-kubeconfig={config}",
        "--bind-address=127.0.0.1",
        f"--secure-port={ports.controller_manager}",
        f"--cert-dir={cert_dir}",
        "--leader-elect=false",
        # Each controller acts as its own ServiceAccount, as in kubeadm clusters.
        "--use-service-account-credentials=true",
        f"--service-account-private-key-file={certs.service_account_key}",
        f"--root-ca-file={certs.ca.cert}",
        f"--cluster-signing-cert-file={certs.ca.cert}",
        f"--cluster-signing-key-file={certs.ca.key}",
        "--controllers=*",
        f"--node-monitor-grace-period={node_lease_seconds + 10}s",
        "--profiling=false",
    ]


def scheduler_args(ports: Ports, config: Path, cert_dir: Path) -> list[str]:
    return [
        f"--kubeconfig={config}",
        f"--authentication-kubeconfig={config}",
        f"--authorization-kubeconfig={config}",
        "--bind-address=127.0.0.1",
        f"--secure-port={ports.scheduler}",
        f"--cert-dir={cert_dir}",
        "--leader-elect=false",
        "--profiling=false",
    ]


def kwok_args(config: Path, node_lease_seconds: int = NODE_LEASE_SECONDS) -> list[str]:
    return [
        f"--kubeconfig={config}",
        f"--config={STAGES_FILE}",
        "--manage-all-nodes=false",
        "--manage-nodes-with-annotation-selector="
        f"{nodes.KWOK_NODE_ANNOTATION}={nodes.KWOK_NODE_ANNOTATION_VALUE}",
        f"--cidr={POD_CIDR}",
        f"--node-lease-duration-seconds={node_lease_seconds}",
    ]


@dataclass(frozen=True)
class Endpoint:
    """What a client needs to reach the cluster; also the `up` state file's content."""

    run_dir: str
    server: str
    kubeconfig: str
    ca: str
    bin_dir: str
    node_names: list[str]
    pgid: int
    ports: dict[str, int]
    real_node: str | None = None


class Cluster:
    """One control plane. Use as a context manager, or start()/stop()."""

    def __init__(
        self,
        run_dir: Path,
        binaries: Mapping[str, Path],
        node_count: int = 2,
        gpus_per_node: int = 8,
        gpu_product: str = nodes.DEFAULT_GPU_PRODUCT,
        real_node: NodeSpec | None = None,
        node_lease_seconds: int = NODE_LEASE_SECONDS,
    ) -> None:
        """`node_lease_seconds`: longer leases spare the apiserver the renewals of a large
        kwok fleet (1,000 nodes at 40 s renew 100 times a second), at the price of noticing a
        vanished node later; the scale benchmark takes a long one."""
        self.run_dir = run_dir
        self.node_lease_seconds = node_lease_seconds
        self.binaries = dict(binaries)
        self.node_names = nodes.node_names(node_count)
        self.gpus_per_node = gpus_per_node
        self.gpu_product = gpu_product
        self.group = ProcessGroup()
        self.ports: Ports | None = None
        self.certs: pki.Pki | None = None
        self.kubeconfig = run_dir / "admin.kubeconfig"
        self._api: ApiClient | None = None
        self.real_node_spec = real_node
        self.node: RealNode | None = None
        if real_node is not None:
            self.node = RealNode(run_dir / "node", real_node.store_cache, self.binaries,
                                 real_node.pause_image, real_node.load_images,
                                 name=real_node.name, cluster_ip=SERVICE_IP)

    @property
    def real_node_name(self) -> str:
        if self.real_node_spec is None:
            raise RuntimeError("this cluster has no real node (Cluster(real_node=NodeSpec(...)))")
        return self.real_node_spec.name

    # -- lifecycle -----------------------------------------------------------

    @property
    def server(self) -> str:
        if self.ports is None:
            raise RuntimeError("cluster not started")
        return f"https://127.0.0.1:{self.ports.apiserver}"

    @property
    def ca(self) -> Path:
        if self.certs is None:
            raise RuntimeError("cluster not started")
        return self.certs.ca.cert

    @property
    def api(self) -> ApiClient:
        if self._api is None:
            raise RuntimeError("cluster not started")
        return self._api

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 180.0, attempts: int = 3) -> None:
        """Start everything and wait until nodes are Ready; on failure nothing is left running.

        Ports are free when picked but not reserved; if another process takes
        one before a component binds it, start again on new ports.
        """
        for attempt in range(1, attempts + 1):
            atexit.register(self.stop)
            try:
                self._start(time.monotonic() + timeout)
                return
            except StartupError as e:
                self.stop()
                if "address already in use" not in str(e) or attempt == attempts:
                    raise
                self.group = ProcessGroup()
                shutil.rmtree(self.run_dir / "etcd", ignore_errors=True)
            except BaseException:
                self.stop()
                raise

    def _start(self, deadline: float) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        logs = self.run_dir / "logs"
        logs.mkdir(exist_ok=True)
        self.ports = ports = Ports.pick()
        self.certs = certs = pki.generate(self.run_dir / "pki", SERVICE_IP)
        ca_pem = certs.ca.cert.read_bytes()

        def config_for(name: str, pair: pki.KeyPair) -> Path:
            user = kubeconfig.client_cert_user(pair.cert, pair.key)
            return kubeconfig.write(
                self.run_dir / f"{name}.kubeconfig", kubeconfig.render(self.server, ca_pem, user)
            )

        config_for("admin", certs.admin)
        kcm_config = config_for("controller-manager", certs.controller_manager)
        scheduler_config = config_for("scheduler", certs.scheduler)
        self._api = ApiClient(self.server, certs.ca.cert, certs.admin.cert, certs.admin.key)

        self._spawn("etcd", etcd_args(self.run_dir / "etcd", ports))
        self._wait(
            "etcd healthy",
            deadline,
            lambda: _http_json(f"http://127.0.0.1:{ports.etcd_client}/health")["health"] == "true",
        )

        egress = None
        if self.node is not None:
            egress = self.run_dir / "egress-selector.json"
            egress.write_text(json.dumps(egress_selector_config(self.node.egress_socket)))
        self._spawn(
            "kube-apiserver", apiserver_args(certs, ports, self.run_dir / "apiserver", egress)
        )
        self._wait("kube-apiserver ready", deadline, lambda: self.api.get("/readyz") == "ok")

        self._spawn(
            "kube-controller-manager",
            controller_manager_args(certs, ports, kcm_config, self.run_dir / "controller-manager",
                                    self.node_lease_seconds),
        )
        self._spawn(
            "kube-scheduler", scheduler_args(ports, scheduler_config, self.run_dir / "scheduler")
        )
        self._spawn("kwok", kwok_args(self.kubeconfig, self.node_lease_seconds))
        for node in self.node_names:
            self.api.post(
                "/api/v1/nodes", nodes.gpu_node(node, self.gpus_per_node, self.gpu_product)
            )

        self._wait(
            "kube-controller-manager healthy", deadline, lambda: _healthz(ports.controller_manager)
        )
        self._wait("kube-scheduler healthy", deadline, lambda: _healthz(ports.scheduler))
        for node in self.node_names:
            self._wait(
                f"node {node} Ready (kwok)",
                deadline,
                lambda n=node: _node_ready(self.api.get(f"/api/v1/nodes/{n}")),
            )
        # Pods in a namespace are admitted only once its `default` ServiceAccount exists.
        self._wait(
            "ServiceAccount default/default (controller-manager)",
            deadline,
            lambda: self.api.get("/api/v1/namespaces/default/serviceaccounts/default"),
        )
        if self.node is not None:
            self.node.start(self.api, certs.ca, ports.apiserver)

    def stop(self) -> None:
        """Idempotent: stop every component; when it returns, none is running."""
        try:
            if self.node is not None:
                self.node.stop()
        finally:
            if self.group.pgid is not None:
                self.group.stop()
                atexit.unregister(self.stop)

    def _spawn(self, name: str, args: list[str]) -> None:
        binary = self.binaries[name]
        self.group.spawn(name, [str(binary), *args], self.run_dir / "logs" / f"{name}.log")

    def _wait(self, what: str, deadline: float, check: Callable[[], Any]) -> None:
        self.group.wait_for(what, deadline, check, _STARTUP_RETRY, StartupError)

    def log_tail(self, name: str, lines: int = 40) -> str:
        return self.group.log_tail(name, lines)

    # -- using the cluster ---------------------------------------------------

    def endpoint(self) -> Endpoint:
        assert self.ports is not None and self.group.pgid is not None
        return Endpoint(
            run_dir=str(self.run_dir),
            server=self.server,
            kubeconfig=str(self.kubeconfig),
            ca=str(self.ca),
            bin_dir=str(self.binaries["kubectl"].parent),
            node_names=self.node_names,
            pgid=self.group.pgid,
            ports=asdict(self.ports),
            real_node=self.real_node_spec.name if self.real_node_spec else None,
        )

    def env(self) -> dict[str, str]:
        """Environment for a child process (kubectl, helm, the operator) to use this cluster."""
        path = os.pathsep.join([str(self.binaries["kubectl"].parent), os.environ.get("PATH", "")])
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PATH": path}

    def mint_token(
        self,
        namespace: str,
        service_account: str,
        expiration_seconds: int = 3600,
        audiences: list[str] | None = None,
    ) -> str:
        """A bound token for the ServiceAccount from the TokenRequest API (the SA must exist)."""
        spec: dict[str, Any] = {"expirationSeconds": expiration_seconds}
        if audiences:
            spec["audiences"] = audiences
        review = self.api.post(
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
        )
        return review["status"]["token"]

    def service_account_kubeconfig(
        self, namespace: str, service_account: str, path: Path | None = None,
        expiration_seconds: int = 3600,
    ) -> Path:
        """Write a kubeconfig that authenticates as system:serviceaccount:<namespace>:<name>."""
        token = self.mint_token(namespace, service_account, expiration_seconds)
        path = path or self.run_dir / f"sa-{namespace}-{service_account}.kubeconfig"
        config = kubeconfig.render(self.server, self.ca.read_bytes(), kubeconfig.token_user(token))
        return kubeconfig.write(path, config)

    def kubectl(
        self,
        *args: str,
        kubeconfig_path: Path | None = None,
        input: str | None = None,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        return self._run("kubectl", args, kubeconfig_path, input, check)

    def helm(
        self, *args: str, kubeconfig_path: Path | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return self._run("helm", args, kubeconfig_path, None, check)

    def _run(
        self,
        tool: str,
        args: tuple[str, ...],
        kubeconfig_path: Path | None,
        input: str | None,
        check: bool,
    ) -> subprocess.CompletedProcess[str]:
        config = kubeconfig_path or self.kubeconfig
        result = subprocess.run(
            [str(self.binaries[tool]), f"--kubeconfig={config}", *args],
            input=input,
            capture_output=True,
            text=True,
            env=self.env(),
            timeout=120,
        )
        if check and result.returncode != 0:
            raise subprocess.CalledProcessError(
                result.returncode, result.args, result.stdout, result.stderr
            )
        return result


def _http_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=2) as resp:
        return json.loads(resp.read())


# The controller-manager and scheduler serve /healthz with a self-signed
# certificate they make themselves; the check is liveness on loopback only.
_UNVERIFIED = ssl._create_unverified_context()


def _healthz(port: int) -> bool:
    try:
        with urllib.request.urlopen(
            f"https://127.0.0.1:{port}/healthz", context=_UNVERIFIED, timeout=2
        ) as r:
            return r.read() == b"ok"
    except urllib.error.HTTPError:
        return False


def _node_ready(node: dict[str, Any]) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in node.get("status", {}).get("conditions", [])
    )


def interrupt_on_termination() -> None:
    """Turn SIGTERM/SIGHUP into KeyboardInterrupt so `finally`/fixture teardown runs."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            signal.signal(sig, handler)


def load_state(path: Path) -> Endpoint:
    return Endpoint(**json.loads(path.read_text()))
