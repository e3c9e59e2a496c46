import os
from pathlib import Path

import pytest

from tools.testenv import node


def test_store_slots_are_exclusive_and_fall_back_to_a_private_root(tmp_path: Path) -> None:
    held = [node.acquire_store(tmp_path / "cache", tmp_path / "run") for _ in range(3)]
    stores = [store for store, _ in held]
    assert stores[:node.STORE_SLOTS] == [tmp_path / "cache" / f"containerd-{i}"
                                         for i in range(node.STORE_SLOTS)]
    assert stores[node.STORE_SLOTS] == tmp_path / "run" / "store"
    assert held[node.STORE_SLOTS][1] is None
    # A released slot is free again.
    os.close(held[0][1])
    assert node.acquire_store(tmp_path / "cache", tmp_path / "run")[0] == stores[0]


def test_a_machine_that_cannot_run_containers_is_told_what_is_missing(
    monkeypatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(node.hostpkgs, "missing_packages", lambda: ["containerd", "runc"])
    missing = node.missing_prerequisites()
    assert any(m.startswith("root") for m in missing)
    assert any("containerd (the container runtime" in m and "runc (" in m for m in missing)
    real = node.RealNode(tmp_path, tmp_path / "cache", {}, "pause", lambda ctr, log: None)
    with pytest.raises(node.NodeUnavailable, match="cannot run the real node; missing: root"):
        real.start(api=None, ca=None, apiserver_port=0)  # type: ignore[arg-type]
    assert not (tmp_path / "cache").exists()  # refused before touching anything


def test_the_layout_names_resolved_paths(tmp_path: Path) -> None:
    """Issue 34 item 5: with a run directory reached through a symlink, teardown looked for
    the node's mounts by the symlinked path, and the kernel names resolved ones: `down`
    left 26 mounts. Every directory of the layout is resolved."""
    real = tmp_path / "real"
    (real / "run").mkdir(parents=True)
    (tmp_path / "link").symlink_to(real)
    link = tmp_path / "link"
    layout = node.resolved_layout(link / "run", link / "store", link / "t", link / "sr",
                                  name="real-0", cgroup="c", cluster_ip="10.96.0.1")
    assert (layout.run, layout.store) == (str(real / "run"), str(real / "store"))
    assert (layout.sockets, layout.socket_root) == (str(real / "t"), str(real / "sr"))
    assert layout.kubelet_root == real / "t" / "kubelet"
