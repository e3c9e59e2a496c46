"""Render the daemon DaemonSet for a WeightCache (pure: spec in, manifest out)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from weightcache.report import NODE_NAME_ENV, SPEC_HASH_ENV

from . import names
from .policy import Policy, PolicyError, check_spec
from .spec import WeightCacheSpec

# Short on purpose: the daemon binds <root>/<ns>.<name>/gpu-<uuid>.sock inside
# the container and a Unix socket path must fit in 107 bytes.
CONTAINER_SOCKET_ROOT = "/run/wc"
# Where the set-up step sees spec.socketDir (the init container only).
SETUP_SOCKET_ROOT = "/host/socket-root"
CONTAINER_MODEL_DIR = "/weightcache/model"
MAX_SOCKET_PATH_BYTES = 107
# "gpu-" + "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" + ".sock"
LONGEST_SOCKET_NAME = len("gpu-GPU-00000000-0000-0000-0000-000000000000.sock")
CLAIM_NAME = "gpus"


class RenderError(ValueError):
    """The spec cannot be turned into a DaemonSet; the message says what to change."""


class PolicyViolation(RenderError):
    """The spec asks for something the cluster's cache policy forbids."""


@dataclass(frozen=True)
class CacheRef:
    namespace: str
    name: str
    uid: str
    generation: int


def selector_labels(cache_namespace: str, cache_name: str) -> dict[str, str]:
    """Labels that select a cache's daemon pods; fixed for the DaemonSet's life."""
    return {
        names.CACHE_LABEL: cache_name,
        names.CACHE_NAMESPACE_LABEL: cache_namespace,
        names.COMPONENT_LABEL: names.DAEMON_COMPONENT,
        names.MANAGED_BY_LABEL: names.MANAGER,
    }


def render_hash(manifest: dict[str, Any]) -> str:
    """Digest of what the operator would apply, bookkeeping annotations excluded."""
    body = json.loads(json.dumps(manifest))
    annotations = body["metadata"].get("annotations", {})
    annotations.pop(names.RENDER_HASH_ANNOTATION, None)
    annotations.pop(names.GENERATION_ANNOTATION, None)
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def update_strategy(spec: WeightCacheSpec) -> dict[str, Any]:
    """How the DaemonSet replaces its pods when the weights change: itself, at
    `maxUnavailable` (Auto, Surge), or never (NodeByNode: the operator evicts each node's
    daemon pod once the engines there that run older weights are gone, rollout.py)."""
    if spec.rollout.strategy == "NodeByNode":
        return {"type": "OnDelete"}
    return {"type": "RollingUpdate",
            "rollingUpdate": {"maxUnavailable": spec.rollout.max_unavailable}}


def render_daemonset(
    cache: CacheRef, spec: WeightCacheSpec, spec_hash: str, policy: Policy, operator_uid: int
) -> dict[str, Any]:
    """The DaemonSet for `spec`, in the policy's daemon namespace; `RenderError`
    (`PolicyViolation`) says why there is none.

    It lives in the daemon namespace, not the cache's, so that only that namespace
    needs Pod Security `privileged`. Owner references cannot cross namespaces: the
    cache's uid travels as an annotation, and the operator's finalizer deletes the
    DaemonSet when the cache goes.
    """
    try:
        image = check_spec(spec, policy, operator_uid, cache.namespace)
    except PolicyError as exc:
        raise PolicyViolation(str(exc)) from None
    # check_spec refuses a policy without either
    assert policy.setup_image is not None and policy.daemon_namespace is not None
    cache_dir = _cache_dir(cache)
    socket_path = f"{CONTAINER_SOCKET_ROOT}/{cache_dir}/" + "x" * LONGEST_SOCKET_NAME
    if len(socket_path.encode()) > MAX_SOCKET_PATH_BYTES:
        budget = MAX_SOCKET_PATH_BYTES - (len(socket_path) - len(cache_dir)) - 1
        raise RenderError(
            f"the daemon's socket path would be {len(socket_path.encode())} bytes, over the "
            f"{MAX_SOCKET_PATH_BYTES}-byte Unix socket limit: namespace and name together "
            f"must be at most {budget} characters"
        )

    labels = {
        **selector_labels(cache.namespace, cache.name),
        "app.kubernetes.io/name": "weightcache-daemon",
        "app.kubernetes.io/instance": cache.name,
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": policy.daemon_service_account,
        "automountServiceAccountToken": True,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": spec.sidecar.run_as_user,
            "runAsGroup": spec.sidecar.run_as_group,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "initContainers": [_socket_dir_init(spec, policy.setup_image, cache_dir, cache.uid)],
        "containers": [
            _daemon_container(spec, image, spec_hash, cache, slot) for slot in range(spec.slots)
        ],
        "volumes": _volumes(spec),
    }
    # CUDA IPC handles only open in the exporting process's PID and IPC
    # namespaces; the fd-based transports need neither.
    if spec.transport == "torch_ipc":
        pod_spec["hostPID"] = True
        pod_spec["hostIPC"] = True
    if spec.placement.node_selector:
        pod_spec["nodeSelector"] = dict(spec.placement.node_selector)
    if spec.placement.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.placement.tolerations]
    if spec.placement.affinity:
        pod_spec["affinity"] = dict(spec.placement.affinity)
    if spec.placement.priority_class_name:
        pod_spec["priorityClassName"] = spec.placement.priority_class_name
    if spec.device == "cuda" and spec.gpu_access.mode == "dra":
        claim = {"name": CLAIM_NAME}
        ref = spec.gpu_access.claim
        if ref.resource_claim_name:
            claim["resourceClaimName"] = ref.resource_claim_name
        else:
            claim["resourceClaimTemplateName"] = ref.resource_claim_template_name
        pod_spec["resourceClaims"] = [claim]

    manifest: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {
            "name": names.daemonset_name(cache.namespace, cache.name),
            "namespace": policy.daemon_namespace,
            "labels": labels,
            "annotations": {
                names.GENERATION_ANNOTATION: str(cache.generation),
                names.CACHE_UID_ANNOTATION: cache.uid,
            },
        },
        "spec": {
            "selector": {"matchLabels": selector_labels(cache.namespace, cache.name)},
            "updateStrategy": update_strategy(spec),
            "revisionHistoryLimit": 5,
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {names.SPEC_HASH_ANNOTATION: spec_hash},
                },
                "spec": pod_spec,
            },
        },
    }
    manifest["metadata"]["annotations"][names.RENDER_HASH_ANNOTATION] = render_hash(manifest)
    return manifest


def _hardened() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _socket_dir_init(spec: WeightCacheSpec, setup_image: str, cache_dir: str,
                     cache_uid: str) -> dict[str, Any]:
    # The daemon's socket directory must belong to the daemon's uid, which takes
    # a chown by root. That step runs from the operator's own image, sees only
    # the admin-allowed socket root, and refuses symlinks (weightcache_operator.socketdir).
    # The cache's uid tells a directory made for an earlier cache of this name from its own.
    return {
        "name": "socket-dir",
        "image": setup_image,
        "command": [
            "python",
            "-m",
            "weightcache_operator.socketdir",
            SETUP_SOCKET_ROOT,
            cache_dir,
            str(spec.sidecar.run_as_user),
            str(spec.sidecar.run_as_group),
            cache_uid,
        ],
        "securityContext": {
            **_hardened(),
            "runAsNonRoot": False,
            "runAsUser": 0,
            "runAsGroup": 0,
            "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]},
        },
        "resources": {
            "requests": {"cpu": "10m", "memory": "32Mi"},
            "limits": {"cpu": "100m", "memory": "64Mi"},
        },
        "volumeMounts": [{"name": "socket-root", "mountPath": SETUP_SOCKET_ROOT}],
    }


def _daemon_container(
    spec: WeightCacheSpec, image: str, spec_hash: str, cache: CacheRef, slot: int
) -> dict[str, Any]:
    cpu = spec.device == "cpu"
    port = spec.sidecar.http_port + slot
    if cpu:
        device = "cpu"
    elif spec.gpu_access.mode == "device-plugin":
        # Each container is allocated its own GPU, visible to it as device 0.
        device = "cuda:0"
    else:
        device = f"cuda:{slot}"
    args = [
        "serve",
        "--model",
        CONTAINER_MODEL_DIR,
        "--device",
        device,
        "--socket-dir",
        CONTAINER_SOCKET_ROOT,
        "--cache",
        f"{cache.namespace}.{cache.name}",
        "--transport",
        spec.transport,
        # The pod's one listening port serves /metrics alone; liveness and readiness are
        # exec probes over the peer-checked socket, so no reachable port decides them.
        "--http-address",
        "none",
        "--metrics-address",
        f"0.0.0.0:{port}",
        "--socket-path-file",
        socket_path_file(slot),
        # Engines run with the cache's group as their primary group.
        "--allow-gid",
        str(spec.sidecar.run_as_group),
    ]
    for uid in sorted(set(spec.sidecar.allowed_peers.uids)):
        args += ["--allow-uid", str(uid)]
    for gid in sorted(set(spec.sidecar.allowed_peers.gids)):
        args += ["--allow-gid", str(gid)]
    if spec.rollout.strategy != "Auto":
        # Surge loads beside kept generations regardless; NodeByNode made room first (an
        # unbound engine it leaves must not hold its node's new daemon back).
        args += ["--rollout", "surge"]
    if spec.model.revision:
        args += ["--revision", spec.model.revision]
    if spec.model.dtype != "auto":
        args += ["--dtype", spec.model.dtype]
    if not cpu:
        args += ["--tp-size", str(spec.gpus.tp_size), "--tp-rank", str(slot % spec.gpus.tp_size)]
        if spec.gpus.shard_plan:
            args += ["--shard-plan", spec.gpus.shard_plan]

    env: list[dict[str, Any]] = [
        _field_env("POD_NAME", "metadata.name"),
        _field_env("POD_NAMESPACE", "metadata.namespace"),
        _field_env(NODE_NAME_ENV, "spec.nodeName"),
        {"name": SPEC_HASH_ENV, "value": spec_hash},
        # torch and friends write caches under $HOME; the root fs is read-only.
        {"name": "HOME", "value": "/tmp"},
    ]
    if not cpu:
        env.append({"name": "CUDA_DEVICE_ORDER", "value": "PCI_BUS_ID"})
        if spec.gpu_access.mode == "visible-devices":
            env += [
                {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
                {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"},
            ]

    resources: dict[str, Any] = {}
    # Quantities go out as strings, as the apiserver writes them back.
    for kind, quantities in (("requests", spec.sidecar.resources.requests),
                             ("limits", spec.sidecar.resources.limits)):
        if quantities:
            resources[kind] = {name: str(value) for name, value in quantities.items()}
    if not cpu and spec.gpu_access.mode == "device-plugin":
        resources.setdefault("requests", {})[spec.gpu_access.resource_name] = "1"
        resources.setdefault("limits", {})[spec.gpu_access.resource_name] = "1"
    if not cpu and spec.gpu_access.mode == "dra":
        resources["claims"] = [{"name": CLAIM_NAME}]

    port_name = "metrics" if cpu else f"metrics-{slot}"
    container: dict[str, Any] = {
        "name": "daemon" if cpu else f"daemon-{slot}",
        "image": image,
        "command": ["weightcache-sidecar"],
        "args": args,
        "env": env,
        "ports": [{"name": port_name, "containerPort": port, "protocol": "TCP"}],
        "readinessProbe": {
            "exec": {"command": _probe_command("ready", slot)},
            "periodSeconds": 5,
            "timeoutSeconds": 3,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "exec": {"command": _probe_command("live", slot)},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
        "securityContext": _hardened(),
        "volumeMounts": [
            _model_mount(spec),
            # The cache's directory by subPath: kubelet sets volumes up before the init
            # container creates it, and resolves a subPath at container start without
            # following symlinks out of the volume.
            {
                "name": "socket-root",
                "mountPath": _socket_mount(cache),
                "subPath": _cache_dir(cache),
            },
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    if spec.sidecar.image_pull_policy:
        container["imagePullPolicy"] = spec.sidecar.image_pull_policy
    if resources:
        container["resources"] = resources
    return container


def socket_path_file(slot: int) -> str:
    """Where slot `slot`'s daemon records its socket's path (its name holds the GPU's UUID).

    In the pod's own emptyDir: only its containers (the daemon's uid) write there.
    """
    return f"/tmp/weightcache-socket-{slot}"


def _probe_command(check: str, slot: int) -> list[str]:
    return ["weightcache-sidecar", "probe", check, "--socket-path-file", socket_path_file(slot)]


def _cache_dir(cache: CacheRef) -> str:
    return f"{cache.namespace}.{cache.name}"


def _socket_mount(cache: CacheRef) -> str:
    return f"{CONTAINER_SOCKET_ROOT}/{_cache_dir(cache)}"


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _model_mount(spec: WeightCacheSpec) -> dict[str, Any]:
    mount: dict[str, Any] = {"name": "model", "mountPath": CONTAINER_MODEL_DIR, "readOnly": True}
    if spec.model.pvc is not None and spec.model.pvc.sub_path:
        mount["subPath"] = spec.model.pvc.sub_path
    return mount


def _volumes(spec: WeightCacheSpec) -> list[dict[str, Any]]:
    if spec.model.pvc is not None:
        model = {
            "name": "model",
            "persistentVolumeClaim": {"claimName": spec.model.pvc.claim_name, "readOnly": True},
        }
    else:
        model = {"name": "model", "hostPath": {"path": spec.model.path, "type": "Directory"}}
    root = spec.socket_dir.rstrip("/")
    return [
        model,
        # The admin-allowed root, for the set-up step alone; kubelet creates it
        # (root, 0755) on a new node.
        {"name": "socket-root", "hostPath": {"path": root, "type": "DirectoryOrCreate"}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
    ]
