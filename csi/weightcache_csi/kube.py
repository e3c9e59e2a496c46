"""The plugin's one question to the API server: the WeightCache a volume names (`get`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from weightcache_operator import names

from .access import Refused


class CacheReader:
    def __init__(self, api: Any) -> None:
        from kubernetes import client

        self.custom = client.CustomObjectsApi(api)

    def __call__(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return self.custom.get_namespaced_custom_object(
                names.GROUP, names.VERSION, namespace, names.PLURAL, name, _request_timeout=10)
        except ApiException as exc:
            if exc.status == 404:
                return None
            try:
                message = json.loads(exc.body)["message"]
            except (TypeError, ValueError, KeyError):
                message = exc.reason
            raise Refused("UNAVAILABLE", f"reading WeightCache {namespace}/{name}: "
                          f"{exc.status} {message}") from None
