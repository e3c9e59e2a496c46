"""The engine pods' index and how their changes are judged (podwatch.py), events fed by hand;
stop() against a real HTTP server whose watch never ends.

The watch itself (a list in pages, then a watch, at the apiserver, by label) runs
against the real apiserver in tests/k8s/test_webhook.py and tests/k8s/test_tenants.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from kubernetes import client

from weightcache_operator import podwatch, views


def view(uid: str, node: str | None = "n1", version: str = "1", ns: str = "team",
         **fields: Any) -> views.EnginePodView:
    return views.EnginePodView(ns, f"pod-{uid}", uid, {"app": "e"}, node, None, False,
                               resource_version=version, **fields)


def test_the_index_keys_pods_by_namespace_and_node_and_follows_a_move() -> None:
    index = podwatch.EnginePodIndex()
    index.put(view("a", None))
    index.put(view("b", "n1"))
    assert dict(index) == {("team", None): (view("a", None),), ("team", "n1"): (view("b"),)}
    index.put(view("a", "n1", "2"))  # scheduled
    assert set(index) == {("team", "n1")} and index.pods == 2
    assert {v.uid for v in index.get(("team", "n1"), ())} == {"a", "b"}
    assert index.remove("a") == view("a", "n1", "2")
    assert index.remove("a") is None
    assert index.get(("team", None)) is None and index.pods == 1


class Judge:
    def __init__(self) -> None:
        self.seen: list[podwatch.Change] = []
        self.gate = asyncio.Event()

    async def __call__(self, change: podwatch.Change) -> None:
        self.seen.append(change)
        await self.gate.wait()


def test_nothing_is_judged_before_kopfs_indices_are_filled_then_each_pod_once() -> None:
    async def scenario() -> list[podwatch.Change]:
        judge = Judge()
        judge.gate.set()
        watch = podwatch.EnginePodWatch(None, judge)  # type: ignore[arg-type]
        watch._resync({"a": view("a"), "b": view("b")})
        watch._deliver("MODIFIED", view("a", version="2"))
        await asyncio.sleep(0)
        assert judge.seen == []
        watch.judge()
        watch.judge()
        while watch._tasks:
            await asyncio.sleep(0)
        return judge.seen

    seen = asyncio.run(scenario())
    assert sorted((c.uid, c.view.resource_version) for c in seen if c.view) == [
        ("a", "2"), ("b", "1")]


def test_events_during_a_judgement_collapse_into_one_more_from_the_latest_view() -> None:
    async def scenario() -> list[podwatch.Change]:
        judge = Judge()
        watch = podwatch.EnginePodWatch(None, judge)  # type: ignore[arg-type]
        watch.judge()
        watch._deliver("ADDED", view("a"))
        await asyncio.sleep(0)
        for version in range(2, 50):  # a churn of patches while the first is judged
            watch._deliver("MODIFIED", view("a", version=str(version)))
        judge.gate.set()
        while watch._tasks:
            await asyncio.sleep(0)
        return judge.seen

    seen = asyncio.run(scenario())
    assert [c.view.resource_version for c in seen if c.view] == ["1", "49"]


def test_a_pod_that_leaves_the_watch_is_judged_once_as_gone_with_its_last_view() -> None:
    async def scenario() -> list[podwatch.Change]:
        judge = Judge()
        judge.gate.set()
        watch = podwatch.EnginePodWatch(None, judge)  # type: ignore[arg-type]
        watch.judge()
        watch._deliver("ADDED", view("a"))
        watch._deliver("ADDED", view("b"))
        watch._deliver("ADDED", view("c"))
        while watch._tasks:
            await asyncio.sleep(0)
        judge.seen.clear()
        gate_open = replace(view("a", version="3"), gate=views.Condition("True", "R", "m"))
        watch._deliver("DELETED", gate_open)  # its label removed: the watch says deleted
        watch._deliver("DELETED", view("zzz"))  # never indexed (not gated): nothing
        # A fresh list (the watch expired) without b: b left while the watch was away.
        watch._resync({"c": view("c")})
        while watch._tasks:
            await asyncio.sleep(0)
        assert watch.index.uids() == {"c"}
        return judge.seen

    seen = asyncio.run(scenario())
    assert sorted((c.uid, c.view, c.gone.resource_version if c.gone else None)
                  for c in seen) == [("a", None, "3"), ("b", None, "1")]


def test_the_pods_the_watch_cannot_see_are_found_by_the_caches_own_selectors() -> None:
    """At start, gated pods without the watch's label (admitted before it existed) are
    looked up by each cache's selector and the one-label form, at the apiserver."""
    from weightcache_operator.spec import LabelSelector, Requirement

    selector = LabelSelector(
        match_labels={"app": "engine", "tier": "gpu"},
        match_expressions=(Requirement("track", "In", ("a", "b")),
                           Requirement("canary", "NotIn", ("yes",)),
                           Requirement("model", "Exists", ()),
                           Requirement("draining", "DoesNotExist", ())))
    assert podwatch.selector_string(selector) == (
        "app=engine,tier=gpu,track in (a,b),canary notin (yes),model,!draining")
    assert podwatch.unwatched_queries([("team", selector), ("other", None)]) == [
        (None, "weightcache.dev/cache,weightcache.dev/gated!=true,"
               "app.kubernetes.io/component!=daemon"),
        ("team", "app=engine,tier=gpu,track in (a,b),canary notin (yes),model,!draining,"
                 "weightcache.dev/gated!=true")]


class QuietApiserver(BaseHTTPRequestHandler):
    """Lists no pods; a watch gets one bookmark, then nothing until `closing` (a quiet
    cluster: the next event may be minutes away)."""

    watches = 0
    watching = threading.Event()
    closing = threading.Event()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        watch = "watch=true" in self.path.lower()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if not watch:
            body = json.dumps({"kind": "PodList", "metadata": {"resourceVersion": "7"},
                               "items": []}).encode()
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        QuietApiserver.watches += 1
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        line = json.dumps({"type": "BOOKMARK", "object": {
            "metadata": {"resourceVersion": "8"}}}).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
        self.wfile.flush()
        self.watching.set()
        self.closing.wait(60)
        self.wfile.write(b"0\r\n\r\n")  # the server ends the watch

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def quiet_apiserver() -> Iterator[client.CoreV1Api]:
    QuietApiserver.watches = 0
    QuietApiserver.watching.clear()
    QuietApiserver.closing.clear()
    server = ThreadingHTTPServer(("127.0.0.1", 0), QuietApiserver)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config = client.Configuration()
    config.host = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield client.CoreV1Api(client.ApiClient(config))
    finally:
        QuietApiserver.closing.set()
        server.shutdown()
        server.server_close()


def test_stop_returns_at_once_on_a_quiet_watch_and_nothing_watches_again(
    quiet_apiserver: client.CoreV1Api,
) -> None:
    """kopf's shutdown calls stop() on the event loop: it must not wait for the watch's
    next event (closing the response there did, up to a whole watch, and the operator did
    not exit on SIGTERM). The reading thread, which the process does not wait for, ends
    when the stream does, without watching again."""
    async def scenario() -> threading.Thread:
        watch = podwatch.EnginePodWatch(quiet_apiserver, Judge())
        await watch.start()
        assert QuietApiserver.watching.wait(10), "the watch never reached the server"
        stopping = threading.Thread(target=watch.stop, daemon=True)
        stopping.start()
        stopping.join(10)
        assert not stopping.is_alive(), "stop() waited for the blocked read"
        assert watch._thread is not None and watch._thread.daemon
        return watch._thread

    reader = asyncio.run(scenario())
    QuietApiserver.closing.set()
    reader.join(10)
    assert not reader.is_alive(), "the watch thread reads on"
    assert QuietApiserver.watches == 1
