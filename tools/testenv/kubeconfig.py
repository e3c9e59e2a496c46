"""Kubeconfig documents for the test cluster's admin and ServiceAccount users."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def render(
    server: str, ca_pem: bytes, user: dict[str, str], name: str = "weightcache-testenv"
) -> dict[str, Any]:
    """One cluster, one user, one current context; credentials embedded so the file stands alone."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": name,
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(ca_pem).decode(),
                },
            }
        ],
        "users": [{"name": name, "user": user}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
        "current-context": name,
    }


def client_cert_user(cert: Path, key: Path) -> dict[str, str]:
    return {"client-certificate-data": _b64(cert), "client-key-data": _b64(key)}


def token_user(token: str) -> dict[str, str]:
    return {"token": token}


def write(path: Path, config: dict[str, Any]) -> Path:
    """Write config (JSON is valid YAML, so kubectl, helm and client-go all read it), mode 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(config, indent=2) + "\n")
    return path
