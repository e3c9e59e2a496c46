"""The CSI Identity and Node services of driver `weightcache.dev`, over gRPC on a Unix socket.

Only inline ephemeral volumes (the CSIDriver says `volumeLifecycleModes:
[Ephemeral]`, `attachRequired: false`, `podInfoOnMount: true`): kubelet calls
NodePublishVolume when an engine pod starts and NodeUnpublishVolume when it
goes; there is no controller, no staging, no capacity. A refusal is a gRPC
error whose code and message kubelet shows as the pod's `FailedMount` event.
The plugin keeps no state: a restart leaves every published mount (they
live in kubelet's pods directory, not in the plugin) and every engine's
connection to its daemon untouched, and unpublish works on whatever it finds.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from concurrent import futures
from typing import Any

import grpc

from weightcache_operator import names

from . import access, mounts
from .stubs import csi_pb2, csi_pb2_grpc

log = logging.getLogger(__name__)

VERSION = "0.1.0"
# A cache object by (namespace, name), None when it does not exist; may raise
# access.Refused (e.g. UNAVAILABLE when the API server cannot be asked).
CacheLookup = Callable[[str, str], Mapping[str, Any] | None]


class Identity(csi_pb2_grpc.IdentityServicer):
    def GetPluginInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        return csi_pb2.GetPluginInfoResponse(name=names.CSI_DRIVER, vendor_version=VERSION)

    def GetPluginCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        # No CONTROLLER_SERVICE: nothing to provision or attach.
        return csi_pb2.GetPluginCapabilitiesResponse()

    def Probe(self, request: Any, context: grpc.ServicerContext) -> Any:
        return csi_pb2.ProbeResponse(ready={"value": True})


class Node(csi_pb2_grpc.NodeServicer):
    """`socket_roots`: each socket directory the cluster allows (host path) -> where this
    process sees it."""

    def __init__(self, node_id: str, socket_roots: Mapping[str, str], lookup: CacheLookup
                 ) -> None:
        self.node_id = node_id
        self.socket_roots = {access._norm(k): v for k, v in socket_roots.items()}
        self.lookup = lookup

    def NodePublishVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            if not request.volume_id or not request.target_path:
                raise access.Refused("INVALID_ARGUMENT", "volume_id and target_path are required")
            if not request.volume_capability.HasField("mount"):
                raise access.Refused("INVALID_ARGUMENT",
                                     f"{names.CSI_DRIVER} volumes are filesystem mounts, not block")
            wanted = access.parse_request(dict(request.volume_context))
            cache = self.lookup(wanted.cache_namespace, wanted.cache_name)
            target = access.decide(wanted, cache, frozenset(self.socket_roots))
            root = self.socket_roots[target.socket_dir]
            try:
                mounted = mounts.publish(root, target.name, request.target_path,
                                         request.readonly)
            except mounts.MountError as exc:
                raise access.Refused("FAILED_PRECONDITION", str(exc)) from None
            except OSError as exc:
                raise access.Refused("INTERNAL", f"mounting {target.name}: {exc}") from None
        except access.Refused as refused:
            log.warning("refused volume %s at %s: %s", request.volume_id, request.target_path,
                        refused)
            context.abort(getattr(grpc.StatusCode, refused.code), str(refused))
        log.info("%s %s/%s for pod %s/%s at %s", "published" if mounted else "already published",
                 target.socket_dir, target.name, wanted.pod_namespace, wanted.pod_name,
                 request.target_path)
        return csi_pb2.NodePublishVolumeResponse()

    def NodeUnpublishVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        if not request.volume_id or not request.target_path:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "volume_id and target_path are required")
        try:
            was = mounts.unpublish(request.target_path)
        except OSError as exc:
            context.abort(grpc.StatusCode.INTERNAL, f"unmounting {request.target_path}: {exc}")
        log.info("%s %s", "unpublished" if was else "nothing mounted at", request.target_path)
        return csi_pb2.NodeUnpublishVolumeResponse()

    def NodeGetCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        # No STAGE_UNSTAGE_VOLUME, no stats, no expansion.
        return csi_pb2.NodeGetCapabilitiesResponse()

    def NodeGetInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        return csi_pb2.NodeGetInfoResponse(node_id=self.node_id)


def serve(endpoint: str, node: Node, workers: int = 4) -> grpc.Server:
    """Start serving both services on the Unix socket `endpoint` (a stale one is replaced)."""
    try:
        os.unlink(endpoint)
    except FileNotFoundError:
        pass
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    csi_pb2_grpc.add_IdentityServicer_to_server(Identity(), server)
    csi_pb2_grpc.add_NodeServicer_to_server(node, server)
    server.add_insecure_port(f"unix://{endpoint}")
    server.start()
    return server
