"""The webhook (webhook.py): its AdmissionReview answers with a stand-in apiserver read, and
its HTTPS server on loopback with a certificate made here.

tests/k8s/test_webhook.py runs it behind a real apiserver; here the rules that a
real apiserver shows only by a race (the binding is the generation the apiserver
holds now, never a watch's, which may lag an edit) or at a cost (a pod past the
limits), and the server's own bounds.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import ssl
from pathlib import Path
from typing import Any

import aiohttp

from tools.testenv import pki
from tools.testenv.procs import free_ports
from weightcache_operator import inject, names, podlimits, views, webhook
from weightcache_operator.spec import parse_spec, spec_hash

V1 = {"model": {"path": "/models/m"}, "device": "cpu"}
V2 = {"model": {"path": "/models/m2"}, "device": "cpu"}


class Apiserver:
    def __init__(self, spec: dict[str, Any] | None, error: int | None = None) -> None:
        self.spec, self.error, self.reads = spec, error, 0

    async def __call__(self, namespace: str, name: str) -> views.CacheView | None:
        self.reads += 1
        if self.error is not None:
            raise inject.Refused(f"reading WeightCache {namespace}/{name}: {self.error}",
                                 self.error)
        if self.spec is None:
            return None
        return views.cache_view({"metadata": {"name": name, "namespace": namespace,
                                              "uid": "u", "generation": 2}, "spec": self.spec})


def pod(labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
        gated: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "engine", "image": "e:1"}]}
    if gated:
        spec["readinessGates"] = [{"conditionType": names.GATE_CONDITION}]
    meta: dict[str, Any] = {"name": "e", "namespace": "team"}
    if labels is not None:
        meta["labels"] = labels
    if annotations is not None:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def request(obj: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "r-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                        "operation": "CREATE", "namespace": "team", "object": obj}}


def patched(obj: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    """`obj` with the answer's JSON patch applied (its only operation is `add`)."""
    out = copy.deepcopy(obj)
    if "patch" not in response:
        return out
    assert response["patchType"] == "JSONPatch"
    for op in json.loads(base64.b64decode(response["patch"])):
        assert op["op"] == "add"
        *parents, last = [p.replace("~1", "/").replace("~0", "~")
                          for p in op["path"].split("/")[1:]]
        target = out
        for part in parents:
            target = target[part]
        target[last] = op["value"]
    return out


def answer(apiserver: Apiserver, obj: dict[str, Any]) -> dict[str, Any]:
    review = asyncio.run(webhook.review(request(obj), apiserver))
    assert review["response"]["uid"] == "r-1"
    return review["response"]


def test_the_binding_is_the_apiservers_generation_not_the_watchs() -> None:
    apiserver = Apiserver(V2)
    obj = pod({names.CACHE_LABEL: "wc"}, {})
    response = answer(apiserver, obj)
    assert apiserver.reads == 1 and response["allowed"]
    after = patched(obj, response)
    assert after["metadata"]["annotations"] == {
        names.binding_key("team", "wc"): spec_hash(parse_spec(V2))}
    assert after["metadata"]["labels"] == {names.CACHE_LABEL: "wc",
                                           names.GATED_LABEL: names.GATED_VALUE}
    assert [g["conditionType"] for g in after["spec"]["readinessGates"]] == [
        names.GATE_CONDITION]
    # A binding the pod brings is kept.
    brought = {names.binding_key("team", "wc"): spec_hash(parse_spec(V1))}
    obj = pod({names.CACHE_LABEL: "wc"}, brought)
    assert patched(obj, answer(Apiserver(V2), obj))["metadata"]["annotations"] == brought


def test_a_cache_the_apiserver_cannot_give_refuses_the_pod() -> None:
    missing = answer(Apiserver(None), pod({names.CACHE_LABEL: "wc"}))
    assert not missing["allowed"] and "does not exist" in missing["status"]["message"]
    unreadable = answer(Apiserver(V1, error=503), pod({names.CACHE_LABEL: "wc"}))
    assert unreadable["status"]["code"] == 503
    assert "reading WeightCache team/wc" in unreadable["status"]["message"]


def test_a_selector_gated_pod_gets_the_watch_label_and_nothing_else() -> None:
    """A pod listing the gate itself (its cache's selector matches it) is marked for the
    operator's watch; no cache is read, nothing else is added."""
    apiserver = Apiserver(V1)
    obj = pod({"app": "engine"}, gated=True)
    after = patched(obj, answer(apiserver, obj))
    assert apiserver.reads == 0
    assert after["metadata"]["labels"] == {"app": "engine",
                                           names.GATED_LABEL: names.GATED_VALUE}
    assert after["spec"] == obj["spec"]
    # No labels at all; a label already there: nothing twice.
    bare = pod(gated=True)
    assert patched(bare, answer(apiserver, bare))["metadata"]["labels"] == {
        names.GATED_LABEL: names.GATED_VALUE}
    marked = pod({names.GATED_LABEL: names.GATED_VALUE}, gated=True)
    assert "patch" not in answer(apiserver, marked)
    # A pod that is nobody's engine passes as it came.
    plain = pod({"app": "web"})
    assert answer(apiserver, plain) == {"uid": "r-1", "allowed": True}


def test_a_gated_pod_past_the_limits_is_refused_naming_the_limit() -> None:
    """Issue 43: 2,700 labels of ~900 KB on a gated pod; or as many binding annotations.
    Refused before anything is read, the message naming the limit; the same pod ungated
    and unmarked is none of the webhook's business (it is never sent)."""
    apiserver = Apiserver(V1)
    labels = {f"tenant.example/k{i:04d}-{'x' * 300}": "v" * 60 for i in range(2700)}
    refused = answer(apiserver, pod(labels, gated=True))
    assert not refused["allowed"] and refused["status"]["code"] == 400
    assert f"over the limit of {podlimits.LIMITS.labels} labels" in refused["status"]["message"]
    heavy = {f"{'d' * 250}{i}.io/{'n' * 63}": "v" * 63 for i in range(60)}
    assert podlimits.label_bytes(heavy) > podlimits.LIMITS.label_bytes
    refused = answer(apiserver, pod(heavy, gated=True))
    assert "bytes of labels" in refused["status"]["message"]
    bindings = {f"{names.BINDING_PREFIX}x{i}": "a" * 64 for i in range(200)}
    refused = answer(apiserver, pod({names.CACHE_LABEL: "wc"}, bindings))
    assert f"over the limit of {podlimits.LIMITS.bindings}" in refused["status"]["message"]
    assert apiserver.reads == 0
    # At the limits (the watch label included), admitted.
    at = {f"k{i}": "v" for i in range(podlimits.LIMITS.labels - 1)}
    assert answer(apiserver, pod(at, gated=True))["allowed"]
    assert not answer(apiserver, pod({**at, "one": "more"}, gated=True))["allowed"]


def test_the_server_answers_over_tls_and_bounds_what_it_reads(tmp_path: Path) -> None:
    ca = pki.issue(pki.CertSpec("webhook-unit-ca", is_ca=True), tmp_path, "ca")
    serving = pki.issue(pki.CertSpec("127.0.0.1", server=True, ip_addresses=("127.0.0.1",)),
                        tmp_path, "serving", ca=ca)
    (port,) = free_ports(1)
    config = webhook.WebhookConfig(port, str(serving.cert), str(serving.key), "127.0.0.1")

    async def scenario() -> tuple[int, dict[str, Any], int, int]:
        stop = asyncio.Event()
        server = asyncio.create_task(webhook.WebhookServer(config, Apiserver(V1)).serve(stop))
        context = ssl.create_default_context(cafile=str(ca.cert))
        url = f"https://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as session:
                for _ in range(100):
                    try:
                        async with session.get(f"{url}/healthz", ssl=context) as health:
                            status = health.status
                            break
                    except aiohttp.ClientConnectorError:
                        await asyncio.sleep(0.05)
                obj = pod({"app": "engine"}, gated=True)
                async with session.post(f"{url}/inject", json=request(obj),
                                        ssl=context) as reply:
                    review = await reply.json()
                huge = b"{" + b" " * (webhook.MAX_REQUEST_BYTES + 1) + b"}"
                async with session.post(f"{url}/inject", data=huge, ssl=context) as too_big:
                    big = too_big.status
                async with session.post(f"{url}/inject", data=b"[1,", ssl=context) as junk:
                    bad = junk.status
        finally:
            stop.set()
            server.cancel()
        return status, review, big, bad

    status, review, big, bad = asyncio.run(scenario())
    assert status == 200
    assert review["kind"] == "AdmissionReview" and review["response"]["allowed"]
    assert "patch" in review["response"]
    assert big == 413 and bad == 400


def test_a_client_trickling_bodies_delays_only_itself(tmp_path: Path) -> None:
    """Security review (issue 43): the webhook's port is open to every pod, and each
    request used to take one of CONCURRENCY slots before its body was read, so four
    connections sending a byte now and then refused every gated pod in the cluster. Here
    a peer (127.0.0.2) holds 3 * CONCURRENCY connections, each promising a body it never
    sends; the apiserver's peer (127.0.0.1) is answered meanwhile, and the trickling
    connections get 408 after READ_SECONDS."""
    ca = pki.issue(pki.CertSpec("webhook-unit-ca", is_ca=True), tmp_path, "ca")
    serving = pki.issue(pki.CertSpec("127.0.0.1", server=True, ip_addresses=("127.0.0.1",)),
                        tmp_path, "serving", ca=ca)
    (port,) = free_ports(1)
    config = webhook.WebhookConfig(port, str(serving.cert), str(serving.key), "127.0.0.1")
    context = ssl.create_default_context(cafile=str(ca.cert))

    async def trickle() -> bytes:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=context, server_hostname="127.0.0.1",
            local_addr=("127.0.0.2", 0))
        writer.write(b"POST /inject HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{")
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 30)
        writer.close()
        return status

    async def scenario() -> tuple[list[bytes], float, dict[str, Any], int]:
        stop = asyncio.Event()
        server = webhook.WebhookServer(config, Apiserver(V1))
        task = asyncio.create_task(server.serve(stop))
        url = f"https://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as session:
                for _ in range(100):
                    try:
                        async with session.get(f"{url}/healthz", ssl=context):
                            break
                    except aiohttp.ClientConnectorError:
                        await asyncio.sleep(0.05)
                held = [asyncio.create_task(trickle()) for _ in range(3 * webhook.CONCURRENCY)]
                await asyncio.sleep(0.5)
                started = asyncio.get_running_loop().time()
                async with session.post(f"{url}/inject", json=request(pod({"app": "e"},
                                        gated=True)), ssl=context) as reply:
                    answered = await reply.json()
                took = asyncio.get_running_loop().time() - started
                statuses = await asyncio.gather(*held)
            return statuses, took, answered, server._reads.peers()
        finally:
            stop.set()
            task.cancel()

    statuses, took, answered, peers = asyncio.run(scenario())
    assert answered["response"]["allowed"] and "patch" in answered["response"]
    # Answered before any held connection's read deadline could have freed a slot.
    assert took < webhook.READ_SECONDS
    assert statuses == [b"HTTP/1.1 408 Request Timeout\r\n"] * (3 * webhook.CONCURRENCY)
    assert peers == 0
