"""The operator's writes to the API server (the only I/O besides kopf's watches).

Every write is a patch of exactly the fields the operator owns, run in a worker
thread so the kopf event loop never blocks on the network.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from . import names

MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY = "application/apply-patch+yaml"


def api_message(exc: ApiException) -> str:
    """The apiserver's own explanation (e.g. which RBAC verb was missing), if it sent one."""
    try:
        return str(json.loads(exc.body)["message"])
    except (TypeError, ValueError, KeyError):
        return exc.body or ""


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

    async def restore_daemonset_template(self, namespace: str, name: str, uid: str,
                                         template: Mapping[str, Any]) -> None:
        """Replace the pod template of that DaemonSet (by uid) with `template` whole.

        A server-side apply cannot do it: fields another manager added (a
        `hostPID` set by hand) stay under that manager until someone removes them.
        """
        await asyncio.to_thread(
            self.apps.patch_namespaced_daemon_set, name, namespace,
            [{"op": "test", "path": "/metadata/uid", "value": uid},
             {"op": "replace", "path": "/spec/template", "value": dict(template)}],
            _content_type=JSON_PATCH,
        )

    async def delete_daemonset(self, namespace: str, name: str, uid: str | None) -> None:
        """Delete one DaemonSet (its pods follow, by the garbage collector); with `uid`, only
        that object, never a newer one of the same name."""
        body = client.V1DeleteOptions(
            propagation_policy="Background",
            preconditions=client.V1Preconditions(uid=uid) if uid else None,
        )
        await asyncio.to_thread(self.apps.delete_namespaced_daemon_set, name, namespace,
                                body=body)

    async def evict_pod(self, namespace: str, name: str, uid: str) -> None:
        """Ask the Eviction API to remove that pod (by uid: never a newer one of its name);
        a PodDisruptionBudget that forbids it answers 429."""
        body = client.V1Eviction(
            metadata=client.V1ObjectMeta(name=name, namespace=namespace),
            delete_options=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)),
        )
        await asyncio.to_thread(self.core.create_namespaced_pod_eviction, name, namespace, body)

    async def read_cache(self, namespace: str, name: str) -> dict[str, Any] | None:
        """One WeightCache as the apiserver holds it now; None if there is none. A list
        by name, so the operator needs no `get` beside the `list` its watch needs."""
        found = await asyncio.to_thread(
            self.custom.list_namespaced_custom_object,
            names.GROUP, names.VERSION, namespace, names.PLURAL,
            field_selector=f"metadata.name={name}",
        )
        items = found.get("items") or []
        return dict(items[0]) if items else None

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
                                condition: Mapping[str, Any], uid: str | None = None) -> None:
        # Strategic merge keys pod conditions by type: other conditions stay. With `uid`,
        # only that pod: a uid is immutable, so a newer pod of the name refuses the patch.
        patch: dict[str, Any] = {"status": {"conditions": [dict(condition)]}}
        if uid:
            patch["metadata"] = {"uid": uid}
        await asyncio.to_thread(
            self.core.patch_namespaced_pod_status, name, namespace, patch,
            _content_type=STRATEGIC,
        )

    async def patch_node_labels(self, node: str, labels: Mapping[str, str | None]) -> None:
        await asyncio.to_thread(
            self.core.patch_node, node, {"metadata": {"labels": dict(labels)}},
            _content_type=MERGE,
        )

    def post_event(self, obj: Mapping[str, Any], type: str, reason: str, message: str) -> None:
        # kopf queues the Event and posts it in the background.
        kopf.event(dict(obj), type=type, reason=reason, message=message)
