"""The registration stand-in as kubelet's plugin watcher sees it, over real Unix sockets."""

from __future__ import annotations

import threading
from pathlib import Path

import grpc

from weightcache_csi.registrar import driver_name, serve_registration
from weightcache_csi.server import Node, serve
from weightcache_csi.stubs import registration_pb2, registration_pb2_grpc


def test_kubelet_learns_the_driver_and_its_endpoint_and_a_refusal_ends_the_registrar(
    tmp_path: Path,
) -> None:
    plugin = serve(str(tmp_path / "csi.sock"), Node("n", {}, lambda ns, name: None))
    failed = threading.Event()
    try:
        name = driver_name(str(tmp_path / "csi.sock"), timeout=10)
        assert name == "weightcache.dev"
        server, socket_path = serve_registration(
            name, "/var/lib/kubelet/plugins/weightcache.dev/csi.sock", str(tmp_path), failed)
        assert socket_path == str(tmp_path / "weightcache.dev-reg.sock")
        with grpc.insecure_channel(f"unix://{socket_path}") as channel:
            kubelet = registration_pb2_grpc.RegistrationStub(channel)
            info = kubelet.GetInfo(registration_pb2.InfoRequest(), timeout=10)
            assert (info.type, info.name, info.endpoint, list(info.supported_versions)) == (
                "CSIPlugin", "weightcache.dev",
                "/var/lib/kubelet/plugins/weightcache.dev/csi.sock", ["1.0.0"])
            kubelet.NotifyRegistrationStatus(
                registration_pb2.RegistrationStatus(plugin_registered=True), timeout=10)
            assert not failed.is_set()
            kubelet.NotifyRegistrationStatus(registration_pb2.RegistrationStatus(
                plugin_registered=False, error="version mismatch"), timeout=10)
            assert failed.is_set()
        server.stop(grace=None)
    finally:
        plugin.stop(grace=None)
