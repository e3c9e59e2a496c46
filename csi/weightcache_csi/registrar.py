"""Kubelet plugin registration for a CSI driver: a stand-in for node-driver-registrar.

    python -m weightcache_csi register --csi-address /csi/csi.sock \\
        --kubelet-registration-path /var/lib/kubelet/plugins/weightcache.dev/csi.sock \\
        [--plugin-registration-path /registration]

The chart runs the upstream `node-driver-registrar` image beside the plugin.
Where that image cannot be had (the local test environment builds everything
from Go modules, and the registrar's module is not served by the Go module
proxy there), this does the same job with the same flags: it asks the plugin
for its name (`GetPluginInfo` over `--csi-address`), then serves kubelet's
`pluginregistration.Registration` on `<plugin-registration-path>/<driver>-reg.sock`,
answering `GetInfo` with the driver's name, its endpoint as kubelet sees it
and CSI version 1.0.0; it exits non-zero when kubelet reports the registration
failed, so the pod restarts it. Stubs: tools/csi_stubs.py, from k8s.io/kubelet's
api.proto at the control plane's pin.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from concurrent import futures
from typing import Any

import grpc

from .stubs import csi_pb2, csi_pb2_grpc, registration_pb2, registration_pb2_grpc

log = logging.getLogger(__name__)

CSI_PLUGIN = "CSIPlugin"
SUPPORTED_VERSIONS = ("1.0.0",)


def driver_name(csi_address: str, timeout: float = 60.0) -> str:
    """The plugin's name, once it answers on its socket."""
    with grpc.insecure_channel(f"unix://{csi_address}") as channel:
        grpc.channel_ready_future(channel).result(timeout=timeout)
        info = csi_pb2_grpc.IdentityStub(channel).GetPluginInfo(
            csi_pb2.GetPluginInfoRequest(), timeout=timeout)
    return str(info.name)


class Registration(registration_pb2_grpc.RegistrationServicer):
    def __init__(self, name: str, endpoint: str, failed: threading.Event) -> None:
        self.name, self.endpoint, self.failed = name, endpoint, failed

    def GetInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        return registration_pb2.PluginInfo(type=CSI_PLUGIN, name=self.name,
                                           endpoint=self.endpoint,
                                           supported_versions=list(SUPPORTED_VERSIONS))

    def NotifyRegistrationStatus(self, request: Any, context: grpc.ServicerContext) -> Any:
        if request.plugin_registered:
            log.info("kubelet registered %s at %s", self.name, self.endpoint)
        else:
            log.error("kubelet refused %s: %s", self.name, request.error)
            self.failed.set()
        return registration_pb2.RegistrationStatusResponse()


def serve_registration(name: str, endpoint: str, registration_dir: str,
                       failed: threading.Event) -> tuple[grpc.Server, str]:
    """Serve kubelet's Registration for `name` at `<registration_dir>/<name>-reg.sock`."""
    socket_path = os.path.join(registration_dir, f"{name}-reg.sock")
    try:
        os.unlink(socket_path)
    except FileNotFoundError:
        pass
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    registration_pb2_grpc.add_RegistrationServicer_to_server(
        Registration(name, endpoint, failed), server)
    server.add_insecure_port(f"unix://{socket_path}")
    server.start()
    return server, socket_path


def run(csi_address: str, kubelet_registration_path: str, registration_dir: str) -> int:
    name = driver_name(csi_address)
    done, failed = threading.Event(), threading.Event()
    server, socket_path = serve_registration(name, kubelet_registration_path, registration_dir,
                                             failed)
    log.info("registration socket %s for %s (endpoint %s)", socket_path, name,
             kubelet_registration_path)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    threading.Thread(target=lambda: (failed.wait(), done.set()), daemon=True).start()
    done.wait()
    server.stop(grace=2).wait()
    try:
        os.unlink(socket_path)
    except FileNotFoundError:
        pass
    return 1 if failed.is_set() else 0
