"""The mutating admission webhook, served apart from the operator.

    python -m weightcache_operator webhook --port 9443 --cert tls.crt --key tls.key

The chart runs it as a Deployment of its own (two replicas, a
PodDisruptionBudget, its own ServiceAccount allowed only to list
WeightCaches), so an operator that crashes, is OOM-killed or rolls out takes no
pod creation down with it: admission and reconciliation fail apart. It serves
`/inject` (AdmissionReview v1, JSON patches) and `/healthz` over HTTPS with the
chart's certificate (made by Helm or cert-manager), re-read when the files
change. The chart owns the MutatingWebhookConfiguration; nothing here writes
webhook configurations.

What is added, and when a pod is refused, is decided in inject.py (pure): the
cache is read from the apiserver at each admission (a list by name, a quorum
read), never from a watch.

The port is open to every pod (the chart cannot know the apiserver's address),
so a client may hold connections open: a body must arrive within READ_SECONDS,
at most READS_PER_PEER bodies of one peer address are read at once (the rest
of that peer's wait), and only then does a request take one of the
CONCURRENCY slots that decide. One pod trickling bytes into many connections
delays only its own requests, never the apiserver's. Memory is bounded per
peer: READS_PER_PEER bodies of at most MAX_REQUEST_BYTES.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import signal
import ssl
from collections import defaultdict
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from . import inject, names, views

log = logging.getLogger(__name__)

# A pod is at most 1.5 MiB in etcd; an AdmissionReview of a CREATE carries it once.
MAX_REQUEST_BYTES = 4 * 1024 * 1024
CONCURRENCY = 4
# The apiserver sends an AdmissionReview at once; a body still arriving after this is a
# client holding the connection (docs/security.md, "The webhook").
READ_SECONDS = 2.0
READS_PER_PEER = 8
CERT_CHECK_SECONDS = 30.0
# On SIGTERM, keep answering this long: the Service drops the pod from its endpoints a
# moment after it starts terminating, and requests routed meanwhile must still be served.
DRAIN_SECONDS = 5.0


@dataclass(frozen=True)
class WebhookConfig:
    port: int
    certfile: str
    keyfile: str
    address: str = "0.0.0.0"


class CacheReader:
    """Reads one WeightCache from the apiserver (a list by name: `list` is the only verb
    the webhook's account holds)."""

    def __init__(self, api: client.ApiClient) -> None:
        self.custom = client.CustomObjectsApi(api)

    async def __call__(self, namespace: str, name: str) -> views.CacheView | None:
        try:
            found = await asyncio.to_thread(
                self.custom.list_namespaced_custom_object,
                names.GROUP, names.VERSION, namespace, names.PLURAL,
                field_selector=f"metadata.name={name}", _request_timeout=(5, 10),
            )
        except ApiException as exc:
            raise inject.Refused(f"reading WeightCache {namespace}/{name}: {exc.status} "
                                 f"{exc.reason}", 503) from None
        items = found.get("items") or []
        return views.cache_view(items[0]) if items else None


async def review(body: Mapping[str, Any], read_cache: inject.ReadCache) -> dict[str, Any]:
    """The AdmissionReview answering `body`."""
    request = body.get("request") or {}
    response: dict[str, Any] = {"uid": request.get("uid", ""), "allowed": True}
    try:
        ops = await inject.admit(request, read_cache)
    except inject.Refused as refused:
        meta = (request.get("object") or {}).get("metadata") or {}
        log.info("refused pod %s/%s: %s", request.get("namespace"),
                 meta.get("name") or meta.get("generateName"), refused)
        response.update(allowed=False, status={"code": refused.code, "message": str(refused)})
    else:
        if ops:
            response.update(patchType="JSONPatch",
                            patch=base64.b64encode(json.dumps(ops).encode()).decode())
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "response": response}


class PeerReads:
    """At most `per_peer` reads at once per peer address; the others of that peer wait."""

    def __init__(self, per_peer: int) -> None:
        self.per_peer = per_peer
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._users: defaultdict[str, int] = defaultdict(int)

    @asynccontextmanager
    async def slot(self, peer: str) -> AsyncIterator[None]:
        self._users[peer] += 1
        slots = self._slots.setdefault(peer, asyncio.Semaphore(self.per_peer))
        try:
            async with slots:
                yield
        finally:
            self._users[peer] -= 1
            if not self._users[peer]:
                del self._users[peer], self._slots[peer]

    def peers(self) -> int:
        return len(self._slots)


class WebhookServer:
    def __init__(self, config: WebhookConfig, read_cache: inject.ReadCache) -> None:
        self.config = config
        self.read_cache = read_cache
        self._slots = asyncio.Semaphore(CONCURRENCY)
        self._reads = PeerReads(READS_PER_PEER)
        self._context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._stamps = self._load_certificate()

    def _load_certificate(self) -> tuple[float, float]:
        self._context.load_cert_chain(self.config.certfile, self.config.keyfile)
        return (os.stat(self.config.certfile).st_mtime, os.stat(self.config.keyfile).st_mtime)

    async def _inject(self, request: web.Request) -> web.Response:
        async with self._reads.slot(request.remote or ""):
            try:
                raw = await asyncio.wait_for(request.read(), READ_SECONDS)
            except asyncio.TimeoutError:
                raise web.HTTPRequestTimeout(
                    text=f"the AdmissionReview did not arrive within {READ_SECONDS:g} s"
                ) from None
        async with self._slots:
            try:
                body = json.loads(raw)
            except ValueError:
                raise web.HTTPBadRequest(text="not an AdmissionReview") from None
            return web.json_response(await review(body, self.read_cache))

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_REQUEST_BYTES)
        app.router.add_post("/inject", self._inject)
        app.router.add_get("/healthz", self._healthz)
        return app

    async def serve(self, stop: asyncio.Event | None = None) -> None:
        """Serve until `stop` is set (then DRAIN_SECONDS more) or cancelled; a renewed
        certificate is taken up within CERT_CHECK_SECONDS (new connections get it)."""
        stop = stop or asyncio.Event()
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.config.address, self.config.port,
                           ssl_context=self._context)
        await site.start()
        log.info("webhook serving on %s:%d", self.config.address, self.config.port)
        try:
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), CERT_CHECK_SECONDS)
                except asyncio.TimeoutError:
                    self._reload_if_renewed()
            await asyncio.sleep(DRAIN_SECONDS)
        finally:
            await runner.cleanup()

    def _reload_if_renewed(self) -> None:
        try:
            stamps = (os.stat(self.config.certfile).st_mtime,
                      os.stat(self.config.keyfile).st_mtime)
            if stamps != self._stamps:
                self._stamps = self._load_certificate()
                log.info("webhook certificate reloaded")
        except (OSError, ssl.SSLError) as exc:
            log.warning("webhook certificate not reloaded: %s", exc)


def run(config: WebhookConfig) -> None:
    from weightcache.kubeclient import api_client

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await WebhookServer(config, CacheReader(api_client())).serve(stop)

    asyncio.run(main())
