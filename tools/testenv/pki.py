"""Certificates and keys for the test control plane, made with the openssl CLI.

`cryptography` is not a project dependency; Debian always ships openssl. All
keys are ECDSA P-256: generation is instant and every component accepts it.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Names the apiserver's serving certificate must cover: loopback, and the
# in-cluster names a client configured for the `kubernetes` Service uses.
APISERVER_DNS_NAMES = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)


APISERVER_KUBELET_CLIENT = "weightcache-testenv-apiserver-kubelet-client"


@dataclass(frozen=True)
class CertSpec:
    """What one certificate says: subject, usage and subject alternative names."""

    common_name: str
    organization: str | None = None
    is_ca: bool = False
    server: bool = False
    client: bool = False
    dns_names: tuple[str, ...] = ()
    ip_addresses: tuple[str, ...] = ()


@dataclass(frozen=True)
class KeyPair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    """Paths of everything the control plane's components read."""

    ca: KeyPair
    apiserver: KeyPair
    admin: KeyPair
    controller_manager: KeyPair
    scheduler: KeyPair
    # The API server's client certificate towards kubelets (logs, exec, port-forward).
    apiserver_kubelet_client: KeyPair
    service_account_key: Path
    service_account_pub: Path


def openssl_config(spec: CertSpec) -> str:
    """The openssl `req` config for spec, self-contained so no system defaults leak in."""
    dn = [f"CN = {spec.common_name}"]
    if spec.organization:
        dn.insert(0, f"O = {spec.organization}")
    if spec.is_ca:
        ext = [
            "basicConstraints = critical, CA:TRUE",
            "keyUsage = critical, keyCertSign, cRLSign, digitalSignature",
        ]
    else:
        usages = [u for u, on in (("serverAuth", spec.server), ("clientAuth", spec.client)) if on]
        if not usages:
            raise ValueError(f"certificate {spec.common_name!r} is neither CA, server nor client")
        ext = [
            "basicConstraints = critical, CA:FALSE",
            "keyUsage = critical, digitalSignature, keyEncipherment",
            f"extendedKeyUsage = {', '.join(usages)}",
        ]
    sans = [f"DNS:{n}" for n in spec.dns_names] + [f"IP:{ip}" for ip in spec.ip_addresses]
    if sans:
        ext.append(f"subjectAltName = {', '.join(sans)}")
    return "\n".join(
        ["[req]", "distinguished_name = dn", "prompt = no", "[dn]", *dn, "[ext]", *ext, ""]
    )


def _openssl(*args: str) -> None:
    if shutil.which("openssl") is None:
        raise RuntimeError("testenv: the openssl CLI is not on PATH (apt-get install openssl)")
    result = subprocess.run(["openssl", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {result.stderr.strip()}")


def issue(
    spec: CertSpec, out: Path, name: str, ca: KeyPair | None = None, days: int = 365
) -> KeyPair:
    """Write a new key and a certificate for spec, signed by ca (self-signed when None)."""
    pair = KeyPair(cert=out / f"{name}.crt", key=out / f"{name}.key")
    with tempfile.NamedTemporaryFile("w", suffix=".cnf") as config:
        config.write(openssl_config(spec))
        config.flush()
        signer = ["-CA", str(ca.cert), "-CAkey", str(ca.key)] if ca else []
        _openssl(
            "req",
            "-x509",
            "-new",
            "-config",
            config.name,
            "-extensions",
            "ext",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(pair.key),
            "-out",
            str(pair.cert),
            "-days",
            str(days),
            *signer,
        )
    pair.key.chmod(0o600)
    return pair


def generate(out: Path, service_ip: str) -> Pki:
    """Create a fresh CA, serving and client certificates, and the service-account key pair."""
    out.mkdir(parents=True, exist_ok=True)
    ca = issue(CertSpec("weightcache-testenv-ca", is_ca=True), out, "ca", days=3650)
    apiserver = issue(
        CertSpec(
            "kube-apiserver",
            server=True,
            dns_names=APISERVER_DNS_NAMES,
            ip_addresses=("127.0.0.1", service_ip),
        ),
        out,
        "apiserver",
        ca,
    )
    # Identities the apiserver's default RBAC bindings already know.
    admin = issue(
        CertSpec("weightcache-testenv-admin", "system:masters", client=True), out, "admin", ca
    )
    kcm = issue(
        CertSpec("system:kube-controller-manager", client=True), out, "controller-manager", ca
    )
    scheduler = issue(CertSpec("system:kube-scheduler", client=True), out, "scheduler", ca)
    kubelet_client = issue(
        CertSpec(APISERVER_KUBELET_CLIENT, client=True), out, "apiserver-kubelet-client", ca
    )
    sa_key, sa_pub = out / "sa.key", out / "sa.pub"
    _openssl(
        "genpkey",
        "-algorithm",
        "EC",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-out",
        str(sa_key),
    )
    sa_key.chmod(0o600)
    _openssl("pkey", "-in", str(sa_key), "-pubout", "-out", str(sa_pub))
    return Pki(ca, apiserver, admin, kcm, scheduler, kubelet_client, sa_key, sa_pub)


@dataclass(frozen=True)
class NodePki:
    client: KeyPair
    serving: KeyPair


def generate_node(out: Path, ca: KeyPair, node_name: str, node_ip: str) -> NodePki:
    """A kubelet's client certificate (the identity RBAC's system:node role expects) and
    its serving certificate (verified by the API server against the cluster CA)."""
    out.mkdir(parents=True, exist_ok=True)
    client = issue(
        CertSpec(f"system:node:{node_name}", "system:nodes", client=True),
        out,
        "kubelet-client",
        ca,
    )
    serving = issue(
        CertSpec(node_name, server=True, dns_names=(node_name,), ip_addresses=(node_ip,)),
        out,
        "kubelet-serving",
        ca,
    )
    return NodePki(client, serving)
