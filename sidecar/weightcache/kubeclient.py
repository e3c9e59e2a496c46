"""The Kubernetes API client the daemon's reporter and the operator share (torch-free)."""

from __future__ import annotations

import os
from typing import Any


def api_client() -> Any:
    """A `kubernetes` ApiClient: in-cluster credentials inside a pod, else $KUBECONFIG."""
    from kubernetes import client, config

    configuration = client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=configuration)
    else:
        # Read $KUBECONFIG now: the client library reads it once, at import.
        config.load_kube_config(os.environ.get("KUBECONFIG"), client_configuration=configuration)
    return client.ApiClient(configuration)
