"""The operator's writes to the API server (the only I/O besides kopf's watches).

Every write is a patch of exactly the fields the operator owns, run in a worker
thread so the kopf event loop never blocks on the network.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import Any

from kubernetes import client, config

from . import names

MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY = "application/apply-patch+yaml"


def api_client() -> client.ApiClient:
    """In-cluster credentials inside a pod, else $KUBECONFIG (tests, local runs)."""
    configuration = client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=configuration)
    else:
        # Read $KUBECONFIG now: the client library reads it once, at import.
        config.load_kube_config(os.environ.get("KUBECONFIG"), client_configuration=configuration)
    return client.ApiClient(configuration)


class Kube:
    def __init__(self, api: client.ApiClient) -> None:
        self.core = client.CoreV1Api(api)
        self.apps = client.AppsV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    async def apply_daemonset(self, manifest: Mapping[str, Any]) -> None:
        meta = manifest["metadata"]
        await asyncio.to_thread(
            self.apps.patch_namespaced_daemon_set,
            meta["name"], meta["namespace"], dict(manifest),
            field_manager=names.MANAGER, force=True, _content_type=APPLY,
        )

    async def replace_cache_status(self, namespace: str, name: str,
                                   status: Mapping[str, Any]) -> None:
        # JSON-patch "add" replaces the whole status, so fields the new status
        # no longer has are dropped (a merge patch would keep them).
        await asyncio.to_thread(
            self.custom.patch_namespaced_custom_object_status,
            names.GROUP, names.VERSION, namespace, names.PLURAL, name,
            [{"op": "add", "path": "/status", "value": dict(status)}],
            _content_type=JSON_PATCH,
        )

    async def set_pod_condition(self, namespace: str, name: str,
                                condition: Mapping[str, Any]) -> None:
        # Strategic merge keys pod conditions by type: other conditions stay.
        await asyncio.to_thread(
            self.core.patch_namespaced_pod_status,
            name, namespace, {"status": {"conditions": [dict(condition)]}},
            _content_type=STRATEGIC,
        )

    async def patch_node_labels(self, node: str, labels: Mapping[str, str | None]) -> None:
        await asyncio.to_thread(
            self.core.patch_node, node, {"metadata": {"labels": dict(labels)}},
            _content_type=MERGE,
        )
