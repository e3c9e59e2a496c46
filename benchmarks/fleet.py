"""The scale harness's view of the fleet and its daemons' part.

`FleetView` lists and watches the engine pods, the daemon pods and the nodes
(raw JSON over one admin connection: decoding thousands of pods into client
models would cost the 2-core machine more than the operator under test) and
records when each engine gate and node label took its current value.

`Daemons` writes each daemon's report as the real reporter does: the same
`weightcache.daemon.reporter.device_report` and `report_patch`, the same
`patch_namespaced_pod` merge patch, under the daemon ServiceAccount with a
token bound to the daemon pod (a TokenRequest like the kubelet's projected
token), so the chart's report guard admits each write exactly as it would in a
cluster. Only the response goes unparsed (`_preload_content=False`): a daemon
parses it on its own node, here it would compete with the operator. A report may
keep earlier generations (`Kept`: the status's `retained`, which the reporter
encodes into the report's `retained` list), as a daemon that took them back from
the engines on its node does.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import urllib3
from kubernetes import client as k8s

from tools.testenv.cluster import Cluster
from weightcache.daemon.reporter import device_report, report_patch
from weightcache.protocol import DaemonStatus, RetainedStatus
from weightcache.report import SPEC_HASH_ENV, rfc3339_now
from weightcache_operator import names

MERGE = "application/merge-patch+json"
TOKEN_SECONDS = 6 * 3600


class RawApi:
    """The admin's JSON requests over one pooled TLS connection set."""

    def __init__(self, cluster: Cluster, maxsize: int = 4) -> None:
        assert cluster.certs is not None
        self.server = cluster.server
        self.pool = urllib3.PoolManager(
            maxsize=maxsize, cert_reqs="CERT_REQUIRED", ca_certs=str(cluster.ca),
            cert_file=str(cluster.certs.admin.cert), key_file=str(cluster.certs.admin.key),
        )

    def request(self, method: str, path: str, body: Any = None,
                content_type: str = "application/json", ok: tuple[int, ...] = ()) -> Any:
        data = None if body is None else json.dumps(body).encode()
        resp = self.pool.request(method, self.server + path, body=data, timeout=60.0,
                                 headers={"Content-Type": content_type,
                                          "Accept": "application/json"})
        if resp.status >= 300 and resp.status not in ok:
            raise RuntimeError(f"{method} {path}: HTTP {resp.status}: {resp.data[:500]!r}")
        text = resp.data
        if not text or text[:1] not in (b"{", b"["):
            return text.decode(errors="replace")
        return json.loads(text)

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def lines(self, path: str, timeout: float) -> Iterator[bytes]:
        """A watch stream's events, one JSON line each, until the server ends it."""
        resp = self.pool.request("GET", self.server + path, preload_content=False,
                                 timeout=urllib3.Timeout(connect=10.0, read=timeout))
        try:
            if resp.status != 200:
                raise RuntimeError(f"watch {path}: HTTP {resp.status}: {resp.data[:500]!r}")
            buffer = b""
            # amt=None: each chunk as it arrives (a size would wait for that many bytes).
            for chunk in resp.stream(None):
                buffer += chunk
                *complete, buffer = buffer.split(b"\n")
                yield from (line for line in complete if line.strip())
        finally:
            resp.release_conn()


# --------------------------------------------------------------------------- what the fleet shows


@dataclass
class Gate:
    status: str
    reason: str
    message: str
    # monotonic time the harness saw this value appear
    since: float


@dataclass
class EnginePod:
    name: str
    node: str
    gate: Gate | None = None


@dataclass
class DaemonPod:
    name: str
    uid: str
    node: str | None
    phase: str
    deleting: bool
    spec_hash: str
    controlled: bool
    ready: bool = False


@dataclass
class FleetView:
    """Engine gates, daemon pods and node labels as the watches last showed them."""

    namespace: str
    engine_selector: str
    label_key: str
    # Where the daemon pods run (the operator's daemon namespace).
    daemon_namespace: str
    engines: dict[str, EnginePod] = field(default_factory=dict)
    daemons: dict[str, DaemonPod] = field(default_factory=dict)
    # node -> (carries the cache's Ready label, monotonic time it took that value)
    labels: dict[str, tuple[bool, float]] = field(default_factory=dict)
    # Gate values the watch delivered (each a distinct (status, reason, message)).
    gate_changes: int = 0
    # Engine pod -> how often the watch delivered its gate going from True to anything else
    # (every closing, also one that opened again before the harness's next poll).
    closings: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on_engine(self, kind: str, pod: dict[str, Any], now: float) -> None:
        meta = pod["metadata"]
        name = meta["name"]
        if kind == "DELETED":
            self.engines.pop(name, None)
            return
        entry = self.engines.setdefault(name, EnginePod(name, pod["spec"].get("nodeName") or ""))
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if cond.get("type") == names.GATE_CONDITION:
                value = (cond.get("status", ""), cond.get("reason", ""), cond.get("message", ""))
                if entry.gate is None or (entry.gate.status, entry.gate.reason,
                                          entry.gate.message) != value:
                    if entry.gate is not None and entry.gate.status == "True" != value[0]:
                        self.closings[name] = self.closings.get(name, 0) + 1
                    entry.gate = Gate(*value, since=now)
                    self.gate_changes += 1

    def on_daemon(self, kind: str, pod: dict[str, Any], now: float) -> None:
        meta = pod["metadata"]
        if kind == "DELETED":
            self.daemons.pop(meta["name"], None)
            return
        spec = pod.get("spec") or {}
        env = {e["name"]: e.get("value", "") for e in spec["containers"][0].get("env") or []}
        owner = next((r for r in meta.get("ownerReferences") or [] if r.get("controller")), {})
        self.daemons[meta["name"]] = DaemonPod(
            name=meta["name"], uid=meta["uid"], node=spec.get("nodeName"),
            phase=(pod.get("status") or {}).get("phase") or "Pending",
            deleting=meta.get("deletionTimestamp") is not None,
            spec_hash=env.get(SPEC_HASH_ENV, ""),
            controlled=owner.get("kind") == "DaemonSet",
            ready=any(c.get("type") == "Ready" and c.get("status") == "True"
                      for c in (pod.get("status") or {}).get("conditions") or []),
        )

    def on_node(self, kind: str, node: dict[str, Any], now: float) -> None:
        name = node["metadata"]["name"]
        if kind == "DELETED":
            self.labels.pop(name, None)
            return
        labels = node["metadata"].get("labels") or {}
        has = labels.get(self.label_key) == names.NODE_LABEL_READY
        if name not in self.labels or self.labels[name][0] != has:
            self.labels[name] = (has, now)

    def running_daemons(self) -> dict[str, DaemonPod]:
        """Node -> its live daemon pod made by the DaemonSet (the newest name wins a tie)."""
        with self.lock:
            pods = [p for p in self.daemons.values()
                    if p.controlled and p.node and not p.deleting and p.phase == "Running"]
        return {p.node: p for p in sorted(pods, key=lambda p: p.name) if p.node}


class Watcher:
    """List, then watch, one collection; relist when the watch expires. One thread each."""

    def __init__(self, api: RawApi, path: str, handle: Callable[[str, dict, float], None],
                 lock: threading.Lock) -> None:
        self.api, self.path, self.handle, self.lock = api, path, handle, lock
        self.synced = threading.Event()
        self.stopping = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"watch {path}")

    def start(self) -> Watcher:
        self.thread.start()
        return self

    def _run(self) -> None:
        sep = "&" if "?" in self.path else "?"
        try:
            while not self.stopping:
                listing = self.api.get(self.path)
                now = time.monotonic()
                with self.lock:
                    for item in listing["items"]:
                        self.handle("ADDED", item, now)
                self.synced.set()
                version = listing["metadata"]["resourceVersion"]
                while not self.stopping:
                    query = (f"{sep}watch=1&allowWatchBookmarks=true&timeoutSeconds=300"
                             f"&resourceVersion={version}")
                    expired = False
                    for line in self.api.lines(self.path + query, timeout=330):
                        event = json.loads(line)
                        kind, obj = event["type"], event["object"]
                        if kind == "ERROR":
                            expired = True
                            break
                        version = obj["metadata"]["resourceVersion"]
                        if kind != "BOOKMARK":
                            with self.lock:
                                self.handle(kind, obj, time.monotonic())
                    if expired:
                        break
        except BaseException as exc:  # surfaced by FleetWatch.check
            if not self.stopping:  # a stopping control plane ends every stream
                self.error = exc
                raise


class FleetWatch:
    """The three watches feeding one FleetView."""

    def __init__(self, api: RawApi, view: FleetView) -> None:
        ns = view.namespace
        daemon_selector = f"{names.MANAGED_BY_LABEL}={names.MANAGER}"
        self.view = view
        self.watchers = [
            Watcher(api, f"/api/v1/namespaces/{ns}/pods?labelSelector={view.engine_selector}",
                    view.on_engine, view.lock),
            Watcher(api, f"/api/v1/namespaces/{view.daemon_namespace}/pods"
                    f"?labelSelector={daemon_selector}",
                    view.on_daemon, view.lock),
            Watcher(api, "/api/v1/nodes", view.on_node, view.lock),
        ]

    def start(self) -> None:
        for w in self.watchers:
            w.start()
        for w in self.watchers:
            if not w.synced.wait(120):
                self.check()
                raise RuntimeError(f"watch {w.path} never listed")

    def check(self) -> None:
        for w in self.watchers:
            if w.error is not None:
                raise RuntimeError(f"watch {w.path} failed: {w.error!r}")

    def stop(self) -> None:
        for w in self.watchers:
            w.stopping = True


# --------------------------------------------------------------------------- the daemons' part


def gpu_uuid(node: str, slot: int) -> str:
    """A stable, real-shaped GPU UUID per (node, slot)."""
    h = hashlib.sha256(f"{node}/{slot}".encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def fingerprint(spec_hash: str, slot: int) -> str:
    return hashlib.sha256(f"{spec_hash}/{slot}".encode()).hexdigest()


@dataclass(frozen=True)
class Kept:
    """An earlier generation a daemon keeps beside its own (daemon/generations.py: taken
    back from the engines on its node that map it), as its status lists it."""

    spec_hash: str
    preloaded: int
    expected: int


@dataclass(frozen=True)
class Report:
    """One daemon's status to report: what `DaemonStatus` the daemon would hold."""

    pod: DaemonPod
    slot: int
    state: str  # loading | ready | error
    spec_hash: str
    preloaded: int
    expected: int
    # Earlier generations kept on this GPU: each one's fingerprint is the one its own
    # daemon reported for this slot (the same layout, taken back).
    retained: tuple[Kept, ...] = ()
    # DaemonStatus.phase while loading (e.g. report.PHASE_LOADING); None as older daemons.
    phase: str | None = None

    def status(self) -> DaemonStatus:
        ready = self.state == "ready"
        return DaemonStatus(
            state=self.state,  # type: ignore[arg-type]
            pid=100 + self.slot, device=f"cuda:{self.slot}",
            gpu=gpu_uuid(self.pod.node or "", self.slot), transport_backend="vmm_fd",
            preloaded_weights_bytes=self.preloaded, expected_bytes=self.expected,
            fingerprint=fingerprint(self.spec_hash, self.slot) if ready else None,
            load_seconds=42.0 if ready else None, load_source="disk" if ready else None,
            readopted=False, socket=f"/run/wc/gpu-{self.slot}.sock", clients_served=0,
            error=None, phase=self.phase,
            retained=[RetainedStatus(spec_hash=k.spec_hash,
                                     fingerprint=fingerprint(k.spec_hash, self.slot),
                                     plan=None, bytes=k.preloaded, expected_bytes=k.expected)
                      for k in self.retained],
        )


class Daemons:
    """Writes reports into daemon pods with each pod's own bound daemon token."""

    def __init__(self, cluster: Cluster, api: RawApi, namespace: str, account: str,
                 writers: int) -> None:
        self.api, self.namespace, self.account = api, namespace, account
        config = k8s.Configuration()
        config.host = cluster.server
        config.ssl_ca_cert = str(cluster.ca)
        config.connection_pool_maxsize = writers
        # No credentials of its own: every request carries its pod's token.
        self.core = k8s.CoreV1Api(k8s.ApiClient(config))
        self.pool = ThreadPoolExecutor(writers, thread_name_prefix="daemon")
        self.tokens: dict[str, str] = {}
        self.tokens_lock = threading.Lock()
        self.written = 0
        self.failed: dict[str, int] = {}
        self.count_lock = threading.Lock()

    def token(self, pod: DaemonPod) -> str:
        """A token bound to the pod, as the kubelet projects into the daemon's containers."""
        with self.tokens_lock:
            if pod.uid in self.tokens:
                return self.tokens[pod.uid]
        review = self.api.request(
            "POST",
            f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{self.account}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
             "spec": {"expirationSeconds": TOKEN_SECONDS,
                      "boundObjectRef": {"kind": "Pod", "apiVersion": "v1",
                                         "name": pod.name, "uid": pod.uid}}},
        )
        with self.tokens_lock:
            self.tokens[pod.uid] = review["status"]["token"]
            return self.tokens[pod.uid]

    def write(self, report: Report, attempts: int = 5) -> float | None:
        """Write one report now; the monotonic time it landed, or None if the pod is gone."""
        pod = report.pod
        auth = {"in": "header", "type": "api_key", "key": "Authorization",
                "value": f"Bearer {self.token(pod)}"}
        patch = report_patch(device_report(report.status(), report.spec_hash, pod.node or "",
                                           rfc3339_now()))
        delay = 0.2
        for attempt in range(attempts):
            try:
                resp = self.core.patch_namespaced_pod(
                    pod.name, self.namespace, patch, _content_type=MERGE,
                    _request_auth=auth, _preload_content=False,
                )
                resp.release_conn()
                with self.count_lock:
                    self.written += 1
                return time.monotonic()
            except k8s.ApiException as exc:
                if exc.status in (404, 401) and attempt:
                    return None  # the pod (and its token's binding) went
                key = str(exc.status)
            except urllib3.exceptions.HTTPError as exc:
                key = type(exc).__name__
            with self.count_lock:
                self.failed[key] = self.failed.get(key, 0) + 1
            time.sleep(delay)
            delay *= 2
        raise RuntimeError(f"report to {pod.name} failed {attempts} times: {self.failed}")

    def submit(self, report: Report) -> Future[float | None]:
        return self.pool.submit(self.write, report)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
