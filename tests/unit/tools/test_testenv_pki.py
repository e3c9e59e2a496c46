import subprocess
from pathlib import Path

import pytest

from tools.testenv import pki


def test_config_for_a_serving_cert_names_every_san() -> None:
    text = pki.openssl_config(
        pki.CertSpec(
            "kube-apiserver", server=True, dns_names=("localhost",), ip_addresses=("127.0.0.1",)
        )
    )
    assert "CN = kube-apiserver" in text
    assert "extendedKeyUsage = serverAuth" in text
    assert "subjectAltName = DNS:localhost, IP:127.0.0.1" in text
    assert "CA:FALSE" in text


def test_config_puts_the_organization_before_the_common_name() -> None:
    text = pki.openssl_config(pki.CertSpec("admin", "system:masters", client=True))
    assert text.index("O = system:masters") < text.index("CN = admin")


def test_a_leaf_without_a_usage_is_rejected_by_name() -> None:
    with pytest.raises(ValueError, match="'nobody' is neither CA, server nor client"):
        pki.openssl_config(pki.CertSpec("nobody"))


def _openssl(*args: str) -> str:
    return subprocess.run(["openssl", *args], check=True, capture_output=True, text=True).stdout


def test_generated_chain_verifies_and_carries_identities(tmp_path: Path) -> None:
    certs = pki.generate(tmp_path, "10.96.0.1")
    for pair in (certs.apiserver, certs.admin, certs.controller_manager, certs.scheduler,
                 certs.apiserver_kubelet_client):
        assert (
            _openssl("verify", "-CAfile", str(certs.ca.cert), str(pair.cert)).strip().endswith("OK")
        )
        assert pair.key.stat().st_mode & 0o077 == 0
    serving = _openssl("x509", "-in", str(certs.apiserver.cert), "-noout", "-ext", "subjectAltName")
    assert "IP Address:127.0.0.1" in serving and "IP Address:10.96.0.1" in serving
    assert "DNS:kubernetes.default.svc" in serving
    admin = _openssl("x509", "-in", str(certs.admin.cert), "-noout", "-subject")
    assert "O = system:masters" in admin
    # The service-account public key is the private key's.
    derived = _openssl("pkey", "-in", str(certs.service_account_key), "-pubout")
    assert derived == certs.service_account_pub.read_text()


def test_node_certificates_carry_the_node_identity_and_address(tmp_path: Path) -> None:
    certs = pki.generate(tmp_path / "cluster", "10.96.0.1")
    node = pki.generate_node(tmp_path / "node", certs.ca, "real-0", "10.250.0.1")
    for pair in (node.client, node.serving):
        assert (
            _openssl("verify", "-CAfile", str(certs.ca.cert), str(pair.cert)).strip().endswith("OK")
        )
    client = _openssl("x509", "-in", str(node.client.cert), "-noout", "-subject")
    assert "O = system:nodes" in client and "CN = system:node:real-0" in client
    serving = _openssl("x509", "-in", str(node.serving.cert), "-noout", "-ext", "subjectAltName")
    assert "IP Address:10.250.0.1" in serving and "DNS:real-0" in serving
