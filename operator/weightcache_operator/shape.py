"""A daemon pod's shape: the parts of its spec that decide what it may do (pure).

Who a pod runs as and what it can reach: its ServiceAccount, host namespaces,
security contexts, images and commands, volumes and mounts. Two pod specs
with the same shape digest grant the same privileges, whatever their
arguments, environment or probes. The operator compares shapes twice:

- a daemon pod counts for its cache only if its shape is one the operator
  rendered (`gate.controlled_pods`): a pod the DaemonSet controller adopted
  (created by someone else with the daemon's labels) runs what its creator
  chose and counts for nothing;
- a DaemonSet whose live template's shape is not the rendered one was edited
  by hand (`hostPID`, root, `privileged`): the operator restores it
  (`reconcile.apply_daemonset`).

A pod spec from the API server carries what the API server adds: the
ServiceAccount token's projected volume and its mounts (`kube-api-access-*`),
defaulted fields (`terminationMessagePath`, ...). The shape takes only fields
the operator renders, and leaves the token volume out, so a rendered template,
the live DaemonSet and the pods it made all have one shape.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

# The ServiceAccount admission plugin's token volume and where it mounts it.
TOKEN_VOLUME_PREFIX = "kube-api-access-"
TOKEN_MOUNT_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"


def _container(container: Mapping[str, Any], with_args: bool) -> dict[str, Any]:
    mounts = [
        {
            "name": m.get("name"),
            "mountPath": m.get("mountPath"),
            "subPath": m.get("subPath") or "",
            "readOnly": bool(m.get("readOnly")),
            "mountPropagation": m.get("mountPropagation") or "None",
        }
        for m in container.get("volumeMounts") or []
        if m.get("mountPath") != TOKEN_MOUNT_PATH
    ]
    shape = {
        "name": container.get("name"),
        "image": container.get("image"),
        "command": list(container.get("command") or []),
        "securityContext": container.get("securityContext") or {},
        "volumeMounts": sorted(mounts, key=lambda m: str(m["mountPath"])),
        "volumeDevices": container.get("volumeDevices") or [],
    }
    if with_args:  # an init container's arguments say what it does as root
        shape["args"] = list(container.get("args") or [])
    return shape


def pod_shape(pod_spec: Mapping[str, Any]) -> dict[str, Any]:
    """The privilege-deciding parts of a pod spec, normalised as the API server stores them."""
    volumes = [
        dict(v) for v in pod_spec.get("volumes") or []
        if not (str(v.get("name", "")).startswith(TOKEN_VOLUME_PREFIX) and "projected" in v)
    ]
    return {
        "serviceAccountName": pod_spec.get("serviceAccountName") or "default",
        "automountServiceAccountToken": pod_spec.get("automountServiceAccountToken"),
        "hostPID": bool(pod_spec.get("hostPID")),
        "hostIPC": bool(pod_spec.get("hostIPC")),
        "hostNetwork": bool(pod_spec.get("hostNetwork")),
        "hostUsers": pod_spec.get("hostUsers", True),
        "shareProcessNamespace": bool(pod_spec.get("shareProcessNamespace")),
        "securityContext": pod_spec.get("securityContext") or {},
        "initContainers": [_container(c, True) for c in pod_spec.get("initContainers") or []],
        "containers": [_container(c, False) for c in pod_spec.get("containers") or []],
        "ephemeralContainers": len(pod_spec.get("ephemeralContainers") or []),
        "volumes": sorted(volumes, key=lambda v: str(v.get("name"))),
    }


def shape_digest(pod_spec: Mapping[str, Any]) -> str:
    """SHA-256 of :func:`pod_shape`: equal digests, equal privileges."""
    text = json.dumps(pod_shape(pod_spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()
