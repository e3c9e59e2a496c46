"""Requests flowing to every engine pod on the real node, and a record of what the cluster did.

`Traffic` runs two threads for a test module:

- a **watch** on the engines' namespace and one on the daemons' keep the view
  the client sends from and record every engine pod's gate condition and Ready
  transitions, and every daemon container that started (a new pod, or a
  restart of one) and each of its Ready changes;
- a **client**, in the real node's network namespace (where the pods'
  addresses live), sends `GET /embed?s=<i>` round after round to every engine
  pod whose container is ready (attached, bit-equal at start) and which is
  not being deleted, and checks each answer against the digests of a plain
  load of the checkpoint (`/reference`, which every pod must answer alike).

Every request is kept: when, to which pod, whether that pod was Ready (gate
open) when it was sent, and the outcome: `ok`, `failed` (no answer, an error)
or `wrong` (an answer with other bytes). `counts()` folds a window of them.
Nothing here asserts on time; tests read the record.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client as k8s
from kubernetes import watch

from tools.engine_pod import GATE_CONDITION, HTTP_PORT
from tools.testenv import netns
from weightcache_operator import names

ROUND_SECONDS = 0.25
# Long: on two cores shared by everyone an answer may take seconds; a slow answer is
# still an answer (the request's time is kept).
REQUEST_SECONDS = 30.0
SENTENCES = 3


@dataclass(frozen=True)
class PodState:
    name: str
    uid: str
    ip: str | None
    ready: bool  # the pod's Ready condition (the gate included)
    containers_ready: bool  # the engine attached and compared bit-equal (its probe)
    terminating: bool
    gate: str | None
    restarts: int
    daemon: bool  # a pod of the cache's DaemonSet


@dataclass(frozen=True)
class Request:
    at: float  # time.monotonic()
    pod: str
    ready: bool
    outcome: str  # ok | failed | wrong
    detail: str = ""
    seconds: float = 0.0  # until the answer (or the failure)


@dataclass(frozen=True)
class Transition:
    at: float
    pod: str
    kind: str  # gate | ready (engine pods), daemon-start | daemon-ready (daemon pods)
    before: str
    after: str


def _condition(pod: k8s.V1Pod, type_: str) -> str | None:
    for c in (pod.status.conditions or []) if pod.status else []:
        if c.type == type_:
            return c.status
    return None


def pod_state(pod: k8s.V1Pod) -> PodState:
    statuses = (pod.status.container_statuses or []) if pod.status else []
    return PodState(
        name=pod.metadata.name,
        uid=pod.metadata.uid,
        ip=pod.status.pod_ip if pod.status else None,
        ready=_condition(pod, "Ready") == "True",
        containers_ready=_condition(pod, "ContainersReady") == "True",
        terminating=pod.metadata.deletion_timestamp is not None,
        gate=_condition(pod, GATE_CONDITION),
        restarts=sum(s.restart_count for s in statuses),
        daemon=any(r.kind == "DaemonSet" and r.controller
                   for r in pod.metadata.owner_references or []),
    )


@dataclass
class Traffic:
    core: k8s.CoreV1Api
    namespace: str  # the engines' (the cache's)
    daemon_namespace: str  # where the cache's daemon pods run
    cache: str
    netns_path: Any  # the real node's network namespace pin
    engine_selector: dict[str, str]
    requests: list[Request] = field(default_factory=list)
    transitions: list[Transition] = field(default_factory=list)
    # The plain-load digests every engine must answer with (the first pod's /reference).
    reference: list[str] | None = None
    _pods: dict[tuple[str, str], PodState] = field(default_factory=dict)  # (namespace, name)
    _references: dict[str, list[str]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _paused: threading.Event = field(default_factory=threading.Event)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Traffic:
        for target, args, name in ((self._watch, (self.namespace,), "engines"),
                                   (self._watch, (self.daemon_namespace,), "daemons"),
                                   (self._client, (), "client")):
            thread = threading.Thread(target=target, args=args, name=f"traffic-{name}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(REQUEST_SECONDS + 10)

    def pause(self) -> None:
        """Stop sending (the record stays)."""
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    # ------------------------------------------------------------------ reading

    def now(self) -> float:
        return time.monotonic()

    def pods(self) -> list[PodState]:
        with self._lock:
            return list(self._pods.values())

    def counts(self, since: float = 0.0, until: float | None = None) -> dict[str, int]:
        """Requests and transitions in [since, until): sent/failed/wrong in all, the same
        on pods that were Ready, gate closes and opens, Ready losses, daemon starts."""
        until = float("inf") if until is None else until
        with self._lock:
            requests = [r for r in self.requests if since <= r.at < until]
            transitions = [t for t in self.transitions if since <= t.at < until]
        out: Counter[str] = Counter()
        for r in requests:
            out["sent"] += 1
            out[r.outcome] += 1
            if r.ready:
                out["sent_ready"] += 1
                out[f"{r.outcome}_ready"] += 1
        for t in transitions:
            if t.kind == "gate" and t.before == "True":
                out["gate_closed"] += 1
            elif t.kind == "gate" and t.after == "True":
                out["gate_opened"] += 1
            elif t.kind == "ready" and t.before == "True":
                out["ready_lost"] += 1
            elif t.kind == "daemon-start":
                out["daemon_starts"] += 1
            elif t.kind == "daemon-ready" and t.before == "True":
                out["daemon_ready_lost"] += 1
        return {k: out.get(k, 0) for k in (
            "sent", "ok", "failed", "wrong", "sent_ready", "ok_ready", "failed_ready",
            "wrong_ready", "gate_closed", "gate_opened", "ready_lost", "daemon_starts",
            "daemon_ready_lost")}

    def failures(self, since: float = 0.0, until: float | None = None) -> list[Request]:
        until = float("inf") if until is None else until
        with self._lock:
            return [r for r in self.requests if since <= r.at < until and r.outcome != "ok"]

    def gate_changes(self, since: float = 0.0) -> list[Transition]:
        with self._lock:
            return [t for t in self.transitions if t.at >= since and t.kind == "gate"]

    def ready_changes(self, since: float = 0.0) -> list[Transition]:
        with self._lock:
            return [t for t in self.transitions if t.at >= since and t.kind == "ready"]

    def served_since(self, pod: str, since: float) -> int:
        with self._lock:
            return sum(1 for r in self.requests
                       if r.pod == pod and r.at >= since and r.outcome == "ok")

    def wait_for_requests(self, pods: int, per_pod: int = 3, bound: float = 120.0) -> float:
        """Until `pods` distinct pods answered `per_pod` requests each from now; returns now."""
        start = self.now()
        deadline = start + bound
        while time.monotonic() < deadline:
            with self._lock:
                per = Counter(r.pod for r in self.requests if r.at >= start and r.outcome == "ok")
            if sum(1 for n in per.values() if n >= per_pod) >= pods:
                return self.now()
            time.sleep(0.25)
        raise AssertionError(f"never saw {pods} pods answer {per_pod} requests each: {per}")

    # ------------------------------------------------------------------ the watch

    def _is_ours(self, pod: k8s.V1Pod) -> bool:
        labels = pod.metadata.labels or {}
        if pod.metadata.namespace == self.daemon_namespace:
            return (labels.get(names.CACHE_LABEL) == self.cache
                    and labels.get(names.CACHE_NAMESPACE_LABEL) == self.namespace)
        return all(labels.get(k) == v for k, v in self.engine_selector.items())

    def _record(self, new: PodState, old: PodState | None, at: float) -> None:
        if new.daemon:
            if old is None or new.restarts > old.restarts:
                self.transitions.append(Transition(at, new.name, "daemon-start", "", new.uid))
            if old is not None and old.ready != new.ready:
                self.transitions.append(Transition(at, new.name, "daemon-ready", str(old.ready),
                                                   str(new.ready)))
            return
        if old is None:
            return
        if old.gate != new.gate:
            self.transitions.append(Transition(at, new.name, "gate", str(old.gate),
                                               str(new.gate)))
        if old.ready != new.ready:
            self.transitions.append(Transition(at, new.name, "ready", str(old.ready),
                                               str(new.ready)))

    def _apply(self, kind: str, pod: k8s.V1Pod) -> None:
        if not self._is_ours(pod):
            return
        at = self.now()
        key = (pod.metadata.namespace, pod.metadata.name)
        with self._lock:
            old = self._pods.get(key)
            if kind == "DELETED":
                self._pods.pop(key, None)
                return
            new = pod_state(pod)
            if old is not None and old.uid != new.uid:
                old = None
            self._pods[key] = new
            self._record(new, old, at)

    def _watch(self, namespace: str) -> None:
        while not self._stop.is_set():
            try:
                listed = self.core.list_namespaced_pod(namespace)
                seen = set()
                for pod in listed.items:
                    seen.add((namespace, pod.metadata.name))
                    self._apply("MODIFIED", pod)
                with self._lock:
                    for gone in {k for k in self._pods if k[0] == namespace} - seen:
                        self._pods.pop(gone)
                stream = watch.Watch().stream(
                    self.core.list_namespaced_pod, namespace,
                    resource_version=listed.metadata.resource_version, timeout_seconds=5)
                for event in stream:
                    self._apply(event["type"], event["object"])
                    if self._stop.is_set():
                        break
            except Exception:  # noqa: BLE001 - an expired watch or a busy API: list again
                time.sleep(0.5)

    # ------------------------------------------------------------------ the client

    def _targets(self) -> dict[str, PodState]:
        with self._lock:
            return {p.uid: p for p in self._pods.values() if not p.daemon and p.ip
                    and p.containers_ready and not p.terminating}

    def _client(self) -> None:
        """One sender per target pod, started when it becomes one: a slow pod (two cores
        shared by everyone) holds up only its own requests."""
        senders: dict[str, threading.Thread] = {}
        while not self._stop.is_set():
            for uid in self._targets():
                if uid not in senders or not senders[uid].is_alive():
                    senders[uid] = threading.Thread(target=self._send_to, args=(uid,),
                                                    name=f"traffic-{uid[:8]}", daemon=True)
                    senders[uid].start()
            time.sleep(ROUND_SECONDS)
        for sender in senders.values():
            sender.join(REQUEST_SECONDS + 5)

    def _send_to(self, uid: str) -> None:
        """Requests to one pod for as long as it is a target."""
        netns.enter_for_good(self.netns_path)  # this thread only: the pods' addresses
        sentence = 0
        while not self._stop.is_set():
            pod = self._targets().get(uid)
            if pod is None:
                return
            if self._paused.is_set():
                time.sleep(ROUND_SECONDS)
                continue
            if uid not in self._references:
                got = _get(pod.ip, "/reference")
                if not (isinstance(got, dict) and len(got.get("digests", [])) == SENTENCES):
                    time.sleep(ROUND_SECONDS)  # only starting to serve: ask again
                    continue
                with self._lock:
                    self._references[uid] = got["digests"]
                    self.reference = self.reference or got["digests"]
            sentence = (sentence + 1) % SENTENCES
            sent = self.now()
            self._outcome(pod, sent, _get(pod.ip, f"/embed?s={sentence}"), sentence)
            time.sleep(ROUND_SECONDS)

    def _outcome(self, pod: PodState, sent: float, got: Any, sentence: int) -> None:
        reference = self._references[pod.uid]
        if isinstance(got, str):
            outcome, detail = "failed", got
        elif reference != self.reference:
            outcome, detail = "wrong", f"its plain load differs: {reference} != {self.reference}"
        elif got.get("digest") != reference[sentence]:
            outcome, detail = "wrong", f"sentence {sentence}: {got.get('digest')}"
        else:
            outcome, detail = "ok", ""
        with self._lock:
            self.requests.append(Request(sent, pod.name, pod.ready, outcome, detail,
                                         round(self.now() - sent, 3)))


def _get(ip: str | None, path: str) -> dict[str, Any] | str:
    """The JSON answer, or a string saying why there is none."""
    conn = http.client.HTTPConnection(str(ip), HTTP_PORT, timeout=REQUEST_SECONDS)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read()
        if response.status != 200:
            return f"HTTP {response.status}: {body[:200]!r}"
        return json.loads(body)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()


def sample(probe: Callable[[], int], samples: int = 5, pause: float = 0.2) -> int:
    """The least of a few readings: a figure with transient connections left out."""
    values = []
    for _ in range(samples):
        values.append(probe())
        time.sleep(pause)
    return min(values)
