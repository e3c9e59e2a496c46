"""The CSI gRPC stubs, generated from the pinned spec's csi.proto by `python -m tools.csi_stubs`.

They are not committed; `make venv` (and the image builds) generate them.
"""

from __future__ import annotations

try:
    from ._generated import csi_pb2, csi_pb2_grpc
except ImportError as exc:  # pragma: no cover - a checkout where nobody ran the generator
    raise ImportError(
        "weightcache_csi: the CSI stubs are missing; generate them with "
        "`python -m tools.csi_stubs` (make csi-stubs)"
    ) from exc

__all__ = ["csi_pb2", "csi_pb2_grpc"]
