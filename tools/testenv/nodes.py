"""Fake GPU nodes: the Node objects kwok manages, labelled as NVIDIA's GPU operator would."""

from __future__ import annotations

from typing import Any

from tools.testenv.assets import K8S_VERSION

# kwok manages exactly the nodes carrying this annotation (see cluster.kwok_args).
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_NODE_ANNOTATION_VALUE = "fake"

GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_GPU_PRODUCT = "NVIDIA-H200"


def node_names(count: int, prefix: str = "kwok-gpu-") -> list[str]:
    if count < 1:
        raise ValueError(f"need at least one node, got {count}")
    return [f"{prefix}{i}" for i in range(count)]


def gpu_node(name: str, gpus: int = 8, product: str = DEFAULT_GPU_PRODUCT) -> dict[str, Any]:
    """A Node that looks to the scheduler like one 8-GPU server with the device plugin running."""
    if gpus < 0:
        raise ValueError(f"gpus must be >= 0, got {gpus}")
    resources = {
        "cpu": "32",
        "memory": "256Gi",
        "ephemeral-storage": "1Ti",
        "pods": "110",
        GPU_RESOURCE: str(gpus),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {
                KWOK_NODE_ANNOTATION: KWOK_NODE_ANNOTATION_VALUE,
                "node.alpha.kubernetes.io/ttl": "0",
            },
            "labels": {
                "kubernetes.io/arch": "amd64",
                "kubernetes.io/os": "linux",
                "kubernetes.io/hostname": name,
                "type": "kwok",
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": product,
                "nvidia.com/gpu.count": str(gpus),
            },
        },
        "spec": {},
        "status": {
            "capacity": resources,
            "allocatable": dict(resources),
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "kubeletVersion": K8S_VERSION,
            },
        },
    }
