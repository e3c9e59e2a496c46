"""The CSI plugin over a real gRPC server on a Unix socket, with real bind mounts.

These run as root, as the plugin's container does: the mounts, the ownership
checks and the symlink refusals are the kernel's. The cache objects come from
a plain dict where the plugin would ask the API server (tests/k8s has that part).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from weightcache_csi import mounts
from weightcache_csi.access import EPHEMERAL, POD_NAME, POD_NAMESPACE
from weightcache_csi.server import Node, serve
from weightcache_csi.stubs import csi_pb2, csi_pb2_grpc

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root, as the plugin's container")

HOST_ROOT = "/var/run/weightcache"
DAEMON = 65533


class Plugin:
    def __init__(self, tmp: Path, caches: dict[tuple[str, str], dict[str, Any]]) -> None:
        self.root = tmp / "sockets"
        self.root.mkdir()
        self.root.chmod(0o755)
        self.endpoint = str(tmp / "csi.sock")
        self.pods = tmp / "pods"
        self.caches = caches
        self.server: grpc.Server | None = None
        self.channel: grpc.Channel | None = None
        self.start()

    def start(self) -> None:
        node = Node("real-0", {HOST_ROOT: str(self.root)},
                    lambda ns, name: self.caches.get((ns, name)))
        self.server = serve(self.endpoint, node)
        self.channel = grpc.insecure_channel(f"unix://{self.endpoint}")
        self.node = csi_pb2_grpc.NodeStub(self.channel)
        self.identity = csi_pb2_grpc.IdentityStub(self.channel)

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.server is not None:
            self.server.stop(grace=None).wait()

    def cache_dir(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(mode=0o750)
        os.chown(path, DAEMON, DAEMON)
        return path

    def publish(self, volume: str, cache: str, namespace: str = "team",
                readonly: bool = False) -> Path:
        target = self.pods / f"{namespace}-{volume}" / "mount"
        self.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
            volume_id=volume, target_path=str(target), readonly=readonly,
            volume_capability=csi_pb2.VolumeCapability(
                mount=csi_pb2.VolumeCapability.MountVolume(),
                access_mode=csi_pb2.VolumeCapability.AccessMode(mode=1)),
            volume_context={"cache": cache, POD_NAMESPACE: namespace, POD_NAME: "engine-0",
                            EPHEMERAL: "true"},
        ), timeout=10)
        return target

    def unpublish(self, volume: str, target: Path) -> None:
        self.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
            volume_id=volume, target_path=str(target)), timeout=10)


@pytest.fixture
def plugin(tmp_path: Path) -> Iterator[Plugin]:
    caches = {("team", "minilm"): {"metadata": {"namespace": "team", "name": "minilm"},
                                   "spec": {"socketDir": HOST_ROOT}}}
    p = Plugin(tmp_path, caches)
    yield p
    p.stop()
    for point in sorted(mounts.mount_points(), reverse=True):
        if point.startswith(str(tmp_path)):
            mounts.unpublish(point)


def listening(path: Path) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    return server


def options_of(target: Path) -> set[str]:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" ")
        if fields[4] == str(target):
            return set(fields[5].split(","))
    raise AssertionError(f"{target} is not mounted")


def test_identity_names_the_driver_and_is_ready(plugin: Plugin) -> None:
    info = plugin.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=10)
    assert info.name == "weightcache.dev"
    assert plugin.identity.Probe(csi_pb2.ProbeRequest(), timeout=10).ready.value is True
    caps = plugin.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest(), timeout=10)
    assert list(caps.capabilities) == []  # no staging: kubelet publishes directly
    assert plugin.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=10).node_id == "real-0"


def test_publish_binds_the_caches_directory_and_unpublish_is_idempotent(plugin: Plugin) -> None:
    directory = plugin.cache_dir("team.minilm")
    daemon = listening(directory / "cpu.sock")
    target = plugin.publish("csi-1", "minilm")
    assert os.stat(target).st_ino == directory.stat().st_ino
    assert {"nosuid", "nodev", "noexec", "rw"} <= options_of(target)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as engine:
        engine.connect(str(target / "cpu.sock"))  # the daemon's socket, through the volume
        accepted, _ = daemon.accept()
        accepted.close()
    assert plugin.publish("csi-1", "minilm") == target  # again: nothing new, no error
    assert sum(p == str(target) for p in mounts.mount_points()) == 1
    plugin.unpublish("csi-1", target)
    assert not mounts.is_mounted(str(target)) and not target.exists()
    plugin.unpublish("csi-1", target)  # again: nothing to do, no error
    assert (directory / "cpu.sock").exists()
    daemon.close()


def test_a_read_only_volume_is_mounted_read_only(plugin: Plugin) -> None:
    plugin.cache_dir("team.minilm")
    target = plugin.publish("csi-ro", "minilm", readonly=True)
    assert "ro" in options_of(target)


def refused(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def test_another_namespace_is_refused_and_nothing_is_mounted(plugin: Plugin) -> None:
    plugin.cache_dir("team.minilm")
    error = refused(lambda: plugin.publish("csi-2", "team/minilm", namespace="intruder"))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "namespace intruder may not use WeightCache team/minilm" in error.details()
    assert not any("intruder" in p for p in mounts.mount_points())
    plugin.caches[("team", "minilm")]["spec"]["engine"] = {"namespaces": ["intruder"]}
    target = plugin.publish("csi-2", "team/minilm", namespace="intruder")
    assert mounts.is_mounted(str(target))


def test_a_missing_cache_or_directory_is_refused_naming_why(plugin: Plugin) -> None:
    error = refused(lambda: plugin.publish("csi-3", "nope"))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "WeightCache team/nope does not exist" in error.details()
    error = refused(lambda: plugin.publish("csi-3", "minilm"))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "has not prepared it on this node" in error.details()


def test_a_symlink_in_place_of_the_caches_directory_is_refused_not_followed(
    plugin: Plugin, tmp_path: Path
) -> None:
    victim = tmp_path / "etc"
    victim.mkdir()
    (victim / "shadow").write_text("secret\n")
    (plugin.root / "team.minilm").symlink_to(victim)
    error = refused(lambda: plugin.publish("csi-4", "minilm"))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "refusing to follow" in error.details()
    assert not any(str(tmp_path / "pods") in p for p in mounts.mount_points())


def test_a_socket_root_others_may_write_is_refused(plugin: Plugin) -> None:
    plugin.cache_dir("team.minilm")
    plugin.root.chmod(0o777)
    error = refused(lambda: plugin.publish("csi-5", "minilm"))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "writable by root alone" in error.details()


def test_a_path_in_the_volume_attributes_is_refused(plugin: Plugin) -> None:
    plugin.cache_dir("team.minilm")
    for cache in ("../../etc", "team.minilm/..", "/etc"):
        error = refused(lambda c=cache: plugin.publish("csi-6", c))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, cache
        assert "volumeAttributes.cache" in error.details()


def test_a_plugin_restart_leaves_published_mounts_and_connections(plugin: Plugin) -> None:
    directory = plugin.cache_dir("team.minilm")
    daemon = listening(directory / "cpu.sock")
    target = plugin.publish("csi-7", "minilm")
    engine = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    engine.connect(str(target / "cpu.sock"))
    served, _ = daemon.accept()
    plugin.stop()
    plugin.start()
    assert mounts.is_mounted(str(target))
    served.sendall(b"still here")
    assert engine.recv(16) == b"still here"
    second = plugin.publish("csi-8", "minilm")  # a new engine pod mounts again
    assert os.stat(second).st_ino == directory.stat().st_ino
    plugin.unpublish("csi-7", target)
    assert not target.exists()
    for s in (engine, served, daemon):
        s.close()
