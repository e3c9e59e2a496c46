import base64
import json
from pathlib import Path

from tools.testenv import kubeconfig


def test_render_embeds_ca_and_selects_its_own_context() -> None:
    config = kubeconfig.render("https://127.0.0.1:6443", b"CA PEM", kubeconfig.token_user("tok"))
    (cluster,) = config["clusters"]
    assert cluster["cluster"]["server"] == "https://127.0.0.1:6443"
    assert base64.b64decode(cluster["cluster"]["certificate-authority-data"]) == b"CA PEM"
    assert config["users"][0]["user"] == {"token": "tok"}
    assert config["current-context"] == config["contexts"][0]["name"]


def test_client_cert_user_embeds_both_files(tmp_path: Path) -> None:
    (tmp_path / "c.crt").write_bytes(b"CERT")
    (tmp_path / "c.key").write_bytes(b"KEY")
    user = kubeconfig.client_cert_user(tmp_path / "c.crt", tmp_path / "c.key")
    assert base64.b64decode(user["client-certificate-data"]) == b"CERT"
    assert base64.b64decode(user["client-key-data"]) == b"KEY"


def test_write_is_private_and_parseable(tmp_path: Path) -> None:
    config = kubeconfig.render("https://x", b"", kubeconfig.token_user("secret"))
    path = kubeconfig.write(tmp_path / "sub" / "k.kubeconfig", config)
    assert path.stat().st_mode & 0o777 == 0o600
    assert json.loads(path.read_text()) == config
