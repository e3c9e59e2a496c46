import pytest

from tools.testenv import nodes


def test_gpu_node_is_managed_by_kwok_and_advertises_its_gpus() -> None:
    node = nodes.gpu_node("kwok-gpu-0", gpus=4, product="NVIDIA-H200")
    meta = node["metadata"]
    assert meta["annotations"][nodes.KWOK_NODE_ANNOTATION] == nodes.KWOK_NODE_ANNOTATION_VALUE
    assert meta["labels"]["nvidia.com/gpu.present"] == "true"
    assert meta["labels"]["nvidia.com/gpu.product"] == "NVIDIA-H200"
    assert meta["labels"]["kubernetes.io/hostname"] == "kwok-gpu-0"
    assert node["status"]["capacity"]["nvidia.com/gpu"] == "4"
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "4"


def test_node_names_are_distinct_and_count_is_checked() -> None:
    assert nodes.node_names(3) == ["kwok-gpu-0", "kwok-gpu-1", "kwok-gpu-2"]
    with pytest.raises(ValueError, match="at least one node"):
        nodes.node_names(0)
    with pytest.raises(ValueError, match="gpus must be >= 0"):
        nodes.gpu_node("n", gpus=-1)
