"""The mutating admission webhook for one-label engine pods, on kopf's admission support.

`python -m weightcache_operator run --webhook-port 9443 --webhook-cert ... --webhook-key ...`
imports this module, which registers the handler; kopf serves it over HTTPS
at `/inject` with the given certificate (the chart's, made by Helm or
cert-manager; it re-reads the files when they change). The chart owns the
MutatingWebhookConfiguration (objectSelector on the label, `failurePolicy:
Fail`), so the operator never writes webhook configurations: kopf's
`settings.admission.managed` stays off.

What is added, and when a pod is refused, is decided in inject.py (pure).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from . import inject, views

WEBHOOK_ID = "inject"


@dataclass(frozen=True)
class WebhookConfig:
    port: int
    certfile: str
    keyfile: str

    def server(self) -> kopf.WebhookServer:
        return kopf.WebhookServer(addr="0.0.0.0", port=self.port, certfile=self.certfile,
                                  pkeyfile=self.keyfile)


# No kopf filter on labels: kopf admits a pod that no handler's filters match as it came,
# so a pod the configuration sends but a filter skipped (once: any `managed-by` but the
# operator's, such as Helm's) would start ungated. Every pod sent is decided below.
@kopf.on.mutate("v1", "pods", id=WEBHOOK_ID, operations=["CREATE"], side_effects=False)
async def inject_engine_pod(
    body: kopf.Body, spec: kopf.Spec, namespace: str, patch: kopf.Patch, memo: kopf.Memo,
    **_: Any,
) -> None:
    meta = body.get("metadata") or {}
    labels = meta.get("labels") or {}
    if not inject.asks(labels):
        return
    try:
        want = inject.wanted(namespace, labels, meta.get("annotations") or {})
        # The apiserver's copy, not the watch's: the pod is bound to the cache's generation
        # of this moment, and a spec edited a moment ago (one `kubectl apply` of the cache
        # and its engines) may not have reached the watch yet; a pod bound to the older
        # one would wait for weights no daemon will hold again.
        try:
            body = await memo.reconciler.kube.read_cache(want.namespace, want.name)
        except ApiException as exc:
            raise inject.Refused(f"reading WeightCache {want.namespace}/{want.name}: "
                                 f"{exc.status} {exc.reason}", 503) from None
        cache = views.cache_view(body) if body is not None else None
        injection = inject.decide(namespace, want, cache)
        bindings = inject.added_annotations(meta.get("annotations") or {}, injection)
    except inject.Refused as refused:
        raise kopf.AdmissionError(str(refused), code=refused.code) from None
    for key, value in bindings.items():
        patch.meta.annotations[key] = value
    current = dict(spec)
    for key, value in inject.mutated_spec(current, injection).items():
        if current.get(key) != value:
            patch.spec[key] = value
