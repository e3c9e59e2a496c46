"""The MiniLM engine Deployments for the real node (`make demo-k8s`, tests/k8s/test_real_*.py).

`labelled_engine_deployment`: the one-label engine (the webhook and the CSI
driver do the rest), as docs/engine-pod.md shows first. `engine_deployment`:
the hostPath fallback, docs/engine-pod.md's additions to an engine Deployment,
with the image of examples/minilm-engine.Dockerfile: the readiness gate with
`maxUnavailable: 0` and the label `weightcache.dev/gated: "true"` the operator
watches, the cache's socket directory mounted read-only and its `engines/`
hand-back directory writable (re-adoption), a uid of the engine's own in the
daemon's group, the daemon's uid pinned (`WEIGHTCACHE_DAEMON_UIDS`: the
engine refuses any other listener before mapping anything), and the
checkpoint mounted for the engine's bit-equality check against a plain load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

GATE_CONDITION = "weightcache.dev/weights-resident"
CACHE_LABEL = "weightcache.dev/cache"
# The label the operator's watch of engine pods selects: a pod gated by a cache's selector
# carries it itself where no webhook adds it (the webhook adds it to every gated pod).
GATED_LABEL = "weightcache.dev/gated"
ENGINE_UID = 1000
# The engine's HTTP port (GET /embed?s=<i>, /reference; examples/minilm_engine_pod.py).
HTTP_PORT = 8080
# The CRD's default spec.sidecar.runAsUser.
DAEMON_UID = 65533


def engine_deployment(
    *,
    namespace: str,
    name: str,
    cache: str,
    image: str,
    node: str,
    socket_root: Path,
    model_dir: Path,
    version: str,
    daemon_gid: int,
    daemon_uid: int = DAEMON_UID,
    replicas: int = 1,
    uid: int = ENGINE_UID,
    labels: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    memory_limit: str = "1536Mi",
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """`labels`: what the pods carry besides `app: <name>` (the cache's engine selector);
    `extra_args` go to the engine's command line; `annotations`: the pods' (a binding to
    the generation they run, `weights.weightcache.dev/<namespace>.<name>`, as the webhook
    would write it)."""
    cache_dir = f"{namespace}.{cache}"
    host_dir = socket_root / cache_dir
    mount = f"/run/weightcache/{cache_dir}"
    selector = {"app": name}
    pod = {
        "nodeSelector": {"kubernetes.io/hostname": node},
        "readinessGates": [{"conditionType": GATE_CONDITION}],
        # The engine answers for 3 s after SIGTERM (clients learn it is going), then stops.
        "terminationGracePeriodSeconds": 15,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": uid,
            "runAsGroup": daemon_gid,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            {
                "name": "engine",
                "image": image,
                "imagePullPolicy": "Never",
                "args": ["--model-dir", "/model", "--interval", "1", "--port", str(HTTP_PORT),
                         *extra_args],
                "ports": [{"name": "http", "containerPort": HTTP_PORT}],
                "env": [
                    {"name": "WEIGHTCACHE_SOCKET", "value": f"{mount}/cpu.sock"},
                    # Without it the engine trusts the socket directory's owner; pinned,
                    # whoever else serves that path is refused before anything is mapped.
                    {"name": "WEIGHTCACHE_DAEMON_UIDS", "value": str(daemon_uid)},
                ],
                # Ready means attached with bit-equal outputs (the engine's HTTP server starts
                # only then); the gate adds "weights verified".
                "readinessProbe": {
                    "httpGet": {"path": "/ready", "port": "http"},
                    "periodSeconds": 2,
                },
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]},
                },
                "resources": {
                    "requests": {"cpu": "100m", "memory": "256Mi"},
                    "limits": {"memory": memory_limit},
                },
                "volumeMounts": [
                    {"name": "weightcache", "mountPath": mount, "readOnly": True},
                    {"name": "weightcache-engines", "mountPath": f"{mount}/engines"},
                    {"name": "model", "mountPath": "/model", "readOnly": True},
                    {"name": "tmp", "mountPath": "/tmp"},
                ],
            }
        ],
        "volumes": [
            {"name": "weightcache", "hostPath": {"path": str(host_dir), "type": "Directory"}},
            {
                "name": "weightcache-engines",
                "hostPath": {"path": str(host_dir / "engines"), "type": "Directory"},
            },
            {"name": "model", "hostPath": {"path": str(model_dir), "type": "Directory"}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}},
        ],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": {**(labels or {}), **selector, GATED_LABEL: "true",
                                        "version": version},
                             **({"annotations": dict(annotations)} if annotations else {})},
                "spec": pod,
            },
        },
    }


def labelled_engine_deployment(
    *,
    namespace: str,
    name: str,
    cache: str,
    image: str,
    node: str,
    version: str,
    replicas: int = 1,
    uid: int = ENGINE_UID,
) -> dict[str, Any]:
    """The same engine as a platform team writes it with the webhook (docs/engine-pod.md):
    the label `weightcache.dev/cache: <cache>` and nothing of weightcache's else; what a
    namespace at Pod Security `restricted` demands of any pod; the checkpoint for the
    comparison from the image itself (no host path). The webhook adds the gate, the CSI
    volume, the socket environment and the daemon's group."""
    labels = {"app": name}
    pod = {
        "nodeSelector": {"kubernetes.io/hostname": node},
        "terminationGracePeriodSeconds": 15,  # the engine drains 3 s, then stops
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": uid,
            "runAsGroup": uid,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            {
                "name": "engine",
                "image": image,
                "imagePullPolicy": "Never",
                "args": ["--interval", "1", "--port", str(HTTP_PORT)],
                "ports": [{"name": "http", "containerPort": HTTP_PORT}],
                "readinessProbe": {
                    "httpGet": {"path": "/ready", "port": "http"},
                    "periodSeconds": 2,
                },
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]},
                },
                "resources": {
                    "requests": {"cpu": "100m", "memory": "256Mi"},
                    "limits": {"memory": "1536Mi"},
                },
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
            }
        ],
        "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": {**labels, CACHE_LABEL: cache, "version": version}},
                "spec": pod,
            },
        },
    }
