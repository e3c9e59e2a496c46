"""The operator's watch of engine pods: only pods labelled `weightcache.dev/gated`, chosen by
the apiserver.

kopf serves one label selector per resource, and its pod watch is the daemon
pods' (handlers.py), so engine pods come through this watch of their own: a
list in pages, then a watch from the list's resourceVersion, both with the
label selector `weightcache.dev/gated=true`. No other pod of the cluster ever
reaches the operator; of each pod that does, the index keeps only its bounded
view (views.engine_pod_view, podlimits.py), built as the event is read.

Changes are judged per pod, at most one judgement of a pod at a time and at
most CONCURRENCY in all; events that arrive meanwhile collapse into one more
judgement from the index's latest view. Nothing is judged before `judge()` is
called, once kopf's own indices (caches, DaemonSets, daemon pods, nodes) are
filled: a pod judged from half a picture would be closed for nothing.

A pod that leaves the watch without being deleted (its label removed) is
reported once as gone, with its last view: the operator no longer sees it, so
it closes its gate (handlers.py); a pod it does not watch is never reported
resident.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from . import names, views
from .spec import LabelSelector

log = logging.getLogger(__name__)

SELECTOR = f"{names.GATED_LABEL}={names.GATED_VALUE}"
# Pods per page of the list: a page is held whole while it is read, parsed. A pod may reach
# the apiserver's 1.5 MiB object limit, and a pod of many tiny labels parses to up to ~9
# times its JSON in Python objects (measured), so a page is at most ~55 MB however the pods
# are made.
PAGE = 4
# The server ends a watch after this long (the client waits a little longer); it is then
# resumed from the last resourceVersion seen.
WATCH_SECONDS = 300
CONCURRENCY = 32
MAX_BACKOFF_SECONDS = 30.0

Key = tuple[str, "str | None"]
# Pods the watch cannot see: without the label, or with another value.
UNWATCHED = f"{names.GATED_LABEL}!={names.GATED_VALUE}"


def selector_string(selector: LabelSelector) -> str:
    """A cache's `spec.engine.selector` as an apiserver label selector."""
    parts = [f"{k}={v}" for k, v in sorted(selector.match_labels.items())]
    for req in selector.match_expressions:
        values = ",".join(req.values)
        parts.append({"In": f"{req.key} in ({values})", "NotIn": f"{req.key} notin ({values})",
                      "Exists": req.key, "DoesNotExist": f"!{req.key}"}[req.operator])
    return ",".join(parts)


def unwatched_queries(caches: Iterable[tuple[str, LabelSelector | None]]
                      ) -> list[tuple[str | None, str]]:
    """(namespace or None for all, label selector) finding every pod a cache would gate
    that the watch cannot see: one-label pods cluster-wide (but the daemons, which carry the
    cache label too), and each cache's selected pods in its namespace."""
    queries: list[tuple[str | None, str]] = [
        (None, f"{names.CACHE_LABEL},{UNWATCHED},"
               f"{names.COMPONENT_LABEL}!={names.DAEMON_COMPONENT}")]
    queries.extend((namespace, f"{selector_string(selector)},{UNWATCHED}")
                   for namespace, selector in caches if selector is not None)
    return queries


class EnginePodIndex(Mapping[Key, tuple[views.EnginePodView, ...]]):
    """Engine pod views by (namespace, node), as state.State reads a kopf index."""

    def __init__(self) -> None:
        self._by_key: dict[Key, dict[str, views.EnginePodView]] = {}
        self._key_of: dict[str, Key] = {}

    def __getitem__(self, key: Key) -> tuple[views.EnginePodView, ...]:
        return tuple(self._by_key[key].values())

    def __iter__(self) -> Iterator[Key]:
        return iter(list(self._by_key))

    def __len__(self) -> int:
        return len(self._by_key)

    @property
    def pods(self) -> int:
        return len(self._key_of)

    def uids(self) -> set[str]:
        return set(self._key_of)

    def view(self, uid: str) -> views.EnginePodView | None:
        key = self._key_of.get(uid)
        return None if key is None else self._by_key[key].get(uid)

    def put(self, view: views.EnginePodView) -> None:
        self.remove(view.uid)
        key = (view.namespace, view.node)
        self._by_key.setdefault(key, {})[view.uid] = view
        self._key_of[view.uid] = key

    def remove(self, uid: str) -> views.EnginePodView | None:
        key = self._key_of.pop(uid, None)
        if key is None:
            return None
        bucket = self._by_key[key]
        view = bucket.pop(uid)
        if not bucket:
            del self._by_key[key]
        return view


@dataclass(frozen=True)
class Change:
    """A pod to judge: `view` as it stands, or (None) `gone`, its last view, when it left the
    watch (deleted, or its label removed)."""

    uid: str
    view: views.EnginePodView | None
    gone: views.EnginePodView | None = None


class Gone(Exception):
    """The watch's resourceVersion is too old (410): list again."""


class EnginePodWatch:
    def __init__(self, core: client.CoreV1Api, handle: Callable[[Change], Awaitable[None]],
                 page: int = PAGE, concurrency: int = CONCURRENCY) -> None:
        self.core = core
        self.index = EnginePodIndex()
        self._handle = handle
        self._page = page
        self._slots = asyncio.Semaphore(concurrency)
        # uid -> the latest view seen (the last one, for a pod that left the watch).
        self._dirty: dict[str, views.EnginePodView] = {}
        self._running: set[str] = set()
        self._judging = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # The context of the caller of judge() (a kopf handler's: kopf.event needs it): every
        # judgement runs in a copy of it, whichever thread saw the event.
        self._context = contextvars.copy_context()

    # ------------------------------------------------------------------ on the event loop

    async def start(self) -> None:
        """List every engine pod (the index is whole when this returns), then keep watching
        in a thread of its own."""
        found, version = await asyncio.to_thread(self.list_pods)
        self._resync(found)
        loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._watch_forever, args=(loop, version),
                                        name="engine-pod-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the watch at its next line, without waiting for it: the reading thread is a
        daemon, which the process does not wait for. Closing the response from here waited
        for the read the thread is blocked in (a quiet cluster sends nothing for minutes),
        which held kopf's shutdown, and the writes it flushes, until the pod was killed."""
        self._stop.set()

    @property
    def judging(self) -> bool:
        return self._judging

    def judge(self) -> None:
        """From now on, changes are judged (kopf's indices are filled); those seen so far
        first. Called from a kopf handler, whose context every judgement runs in."""
        if self._judging:
            return
        self._judging = True
        self._context = contextvars.copy_context()
        for uid in list(self._dirty):
            self._spawn(uid)

    def _deliver(self, kind: str, view: views.EnginePodView) -> None:
        if kind == "DELETED":
            if self.index.remove(view.uid) is None:
                return
        else:
            self.index.put(view)
        self._dirty[view.uid] = view
        self._spawn(view.uid)

    def _resync(self, found: Mapping[str, views.EnginePodView]) -> None:
        """The index becomes exactly `found` (a fresh list): pods missing from it left."""
        for uid in self.index.uids() - set(found):
            gone = self.index.remove(uid)
            if gone is not None:
                self._dirty[uid] = gone
                self._spawn(uid)
        for uid, view in found.items():
            before = self.index.view(uid)
            self.index.put(view)
            if before is None or before.resource_version != view.resource_version:
                self._dirty[uid] = view
                self._spawn(uid)

    def _spawn(self, uid: str) -> None:
        if not self._judging or uid in self._running:
            return
        self._running.add(uid)
        task = asyncio.get_running_loop().create_task(self._work(uid),
                                                      context=self._context.copy())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _work(self, uid: str) -> None:
        async with self._slots:
            try:
                while uid in self._dirty:
                    last = self._dirty.pop(uid)
                    current = self.index.view(uid)
                    try:
                        await self._handle(Change(uid, current, None if current else last))
                    except Exception:
                        log.exception("judging engine pod %s/%s failed", last.namespace,
                                      last.name)
            finally:
                self._running.discard(uid)

    # ------------------------------------------------------------------ in the watch thread

    def list_pods(self) -> tuple[dict[str, views.EnginePodView], str]:
        """Every gated pod with the label, in pages, as bounded views; and the list's
        resourceVersion. A page whose continue token expired starts the list again."""
        while True:
            found: dict[str, views.EnginePodView] = {}
            token: str | None = None
            try:
                while True:
                    page = self._get(dict(limit=self._page, _continue=token))
                    for obj in page.get("items") or []:
                        if views.has_gate(obj):
                            view = views.engine_pod_view(obj)
                            found[view.uid] = view
                    meta = page.get("metadata") or {}
                    token, version = meta.get("continue"), str(meta.get("resourceVersion"))
                    del page
                    if not token:
                        return found, version
            except ApiException as exc:
                if exc.status != 410:
                    raise

    def unwatched_open(self, queries: Iterable[tuple[str | None, str]]
                       ) -> list[views.EnginePodView]:
        """The gated pods those queries find whose gate stands open (an operator before
        the label, or one that did not see it removed, opened it); in pages, bounded views."""
        found: dict[str, views.EnginePodView] = {}
        for namespace, selector in queries:
            token: str | None = None
            while True:
                page = self._get(dict(limit=self._page, _continue=token), selector, namespace)
                for obj in page.get("items") or []:
                    if views.has_gate(obj):
                        view = views.engine_pod_view(obj)
                        if view.gate is not None and view.gate.status == "True":
                            found[view.uid] = view
                token = (page.get("metadata") or {}).get("continue")
                del page
                if not token:
                    break
        return list(found.values())

    def _get(self, params: dict[str, Any], selector: str = SELECTOR,
             namespace: str | None = None) -> dict[str, Any]:
        kwargs = dict(label_selector=selector, _preload_content=False,
                      _request_timeout=(10, 120),
                      **{k: v for k, v in params.items() if v is not None})
        response = (self.core.list_namespaced_pod(namespace, **kwargs) if namespace
                    else self.core.list_pod_for_all_namespaces(**kwargs))
        try:
            return json.loads(response.data)
        finally:
            response.release_conn()

    def _watch_forever(self, loop: asyncio.AbstractEventLoop, version: str) -> None:
        backoff = 1.0
        while not self._stop.is_set():
            try:
                version = self._watch(loop, version)
                backoff = 1.0
            except Gone:
                log.info("engine pod watch expired at %s: listing again", version)
                try:
                    found, version = self.list_pods()
                except Exception as exc:  # noqa: BLE001 - retried below
                    log.warning("listing engine pods failed: %s", exc)
                    time.sleep(backoff)
                    backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)
                    continue
                loop.call_soon_threadsafe(self._resync, found)
            except Exception as exc:  # noqa: BLE001 - a broken stream is resumed
                if self._stop.is_set():
                    return
                log.warning("engine pod watch failed (%s): resuming in %.0f s", exc, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)

    def _watch(self, loop: asyncio.AbstractEventLoop, version: str) -> str:
        """One watch request, until the server ends it; the last resourceVersion seen."""
        response = self.core.list_pod_for_all_namespaces(
            label_selector=SELECTOR, watch=True, allow_watch_bookmarks=True,
            resource_version=version, timeout_seconds=WATCH_SECONDS,
            _preload_content=False, _request_timeout=(10, WATCH_SECONDS + 30))
        try:
            for line in iter_resp_lines(response):
                if self._stop.is_set():
                    break
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone()
                    raise RuntimeError(f"watch error: {obj.get('message')}")
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind == "BOOKMARK" or not views.has_gate(obj):
                    continue
                view = views.engine_pod_view(obj)
                del event, obj
                loop.call_soon_threadsafe(self._deliver, kind, view)
        finally:
            response.release_conn()
        return version
