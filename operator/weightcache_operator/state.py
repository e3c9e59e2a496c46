"""What the operator knows of the cluster: its watch indices, and the questions it asks them.

kopf fills the indices (handlers.py) with small views (views.py); in tests
they are plain dicts of lists. Nothing here writes or blocks.

Daemon and engine pods are indexed by node, because one report changes one
node: the pass it triggers asks for that node's pods, in constant time,
whatever the size of the fleet. Questions about a whole cache or namespace
(a status, a resync) scan the index's keys, which is linear but rare.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from . import gate, names, views

# kopf.Index is a mapping from key to a collection of values.
Index = Mapping[Any, Iterable[Any]]


@dataclass(frozen=True)
class State:
    caches: Index  # namespace -> CacheView
    daemonsets: Index  # (namespace, cache) -> DaemonSetView
    daemon_pods_index: Index  # (namespace, cache, node or None) -> DaemonPodView
    engine_pods_index: Index  # (namespace, node or None) -> EnginePodView
    nodes: Index  # node name -> NodeView
    # Where caches' DaemonSets live (the policy's daemonNamespace).
    daemon_namespace: str = ""

    def cache(self, namespace: str, name: str) -> views.CacheView | None:
        return next((c for c in self.caches.get(namespace, []) if c.name == name), None)

    def live_caches(
        self, namespace: str | None = None, exclude: str | None = None
    ) -> list[views.CacheView]:
        spaces = [namespace] if namespace is not None else list(self.caches)
        return sorted(
            (
                c
                for ns in spaces
                for c in self.caches.get(ns, [])
                if not c.deleting and c.uid != exclude
            ),
            key=lambda c: (c.namespace, c.name),
        )

    def _daemonsets(self, cache: views.CacheView) -> list[views.DaemonSetView]:
        return list(self.daemonsets.get((cache.namespace, cache.name), []))

    def daemonset(self, cache: views.CacheView) -> views.DaemonSetView | None:
        """The cache's own DaemonSet (labels can be copied): in the daemon namespace, by its
        name and the cache's uid; else, until it is migrated, the older one in the cache's
        namespace that the cache owns."""
        wanted = names.daemonset_name(cache.namespace, cache.name)
        current = next((d for d in self._daemonsets(cache)
                        if not d.legacy and d.namespace == self.daemon_namespace
                        and d.name == wanted and d.cache_uid == cache.uid), None)
        return current or self.legacy_daemonset(cache)

    def legacy_daemonset(self, cache: views.CacheView) -> views.DaemonSetView | None:
        """The cache's DaemonSet of the older layout: `weightcache-<name>` in its own
        namespace, controlled by the cache (migrated away by the operator)."""
        wanted = names.legacy_daemonset_name(cache.name)
        return next((d for d in self._daemonsets(cache)
                     if d.legacy and d.namespace == cache.namespace and d.name == wanted
                     and d.controller_uid == cache.uid), None)

    def stale_daemonset(self, cache: views.CacheView) -> views.DaemonSetView | None:
        """A DaemonSet under the cache's name in the daemon namespace made for another
        cache of that name (one deleted while the operator could not clean up)."""
        wanted = names.daemonset_name(cache.namespace, cache.name)
        return next((d for d in self._daemonsets(cache)
                     if not d.legacy and d.namespace == self.daemon_namespace
                     and d.name == wanted and d.cache_uid != cache.uid), None)

    def legacy_pods(self, cache: views.CacheView) -> list[views.DaemonPodView]:
        """Daemon pods of the older layout still running for the cache (in its namespace,
        outside the daemon namespace): they hold the devices' locks until they exit."""
        return [p for key in list(self.daemon_pods_index)
                if key[0] == cache.namespace and key[1] == cache.name
                for p in self.daemon_pods_index.get(key, [])
                if p.namespace == cache.namespace and p.namespace != self.daemon_namespace]

    def daemon_pods(self, cache: views.CacheView) -> list[views.DaemonPodView]:
        """Every daemon pod the cache's own DaemonSet made; look-alikes are ignored."""
        ns, name = cache.namespace, cache.name
        pods = [
            p
            for key in list(self.daemon_pods_index)
            if key[0] == ns and key[1] == name
            for p in self.daemon_pods_index.get(key, [])
        ]
        return gate.controlled_pods(pods, self.daemonset(cache))

    def daemon_pods_on(self, cache: views.CacheView, node: str) -> list[views.DaemonPodView]:
        """The cache's own daemon pods on one node."""
        pods = self.daemon_pods_index.get((cache.namespace, cache.name, node), [])
        return gate.controlled_pods(pods, self.daemonset(cache))

    def engine_pod(self, namespace: str, name: str, node: str | None
                   ) -> views.EnginePodView | None:
        return next(
            (p for p in self.engine_pods_index.get((namespace, node), []) if p.name == name), None
        )

    def engine_pods_on(self, namespace: str, node: str) -> list[views.EnginePodView]:
        return list(self.engine_pods_index.get((namespace, node), []))

    def engine_pods(self, namespace: str) -> list[views.EnginePodView]:
        """Every gated engine pod of a namespace (a scan of the index)."""
        return [
            p
            for key in list(self.engine_pods_index)
            if key[0] == namespace
            for p in self.engine_pods_index.get(key, [])
        ]

    def engine_pods_of(self, namespace: str, name: str, others: tuple[str, ...] | None = None,
                       node: str | None = None) -> list[views.EnginePodView]:
        """The cache's engine pods (on one node, if given): every gated pod of its namespace,
        and the one-label pods naming it in the namespaces `others` (None: every namespace,
        a scan for the rare whole-cache pass; a node's pass names them and reads by key, so
        it costs the same in any fleet)."""
        def pods(ns: str) -> list[views.EnginePodView]:
            return self.engine_pods_on(ns, node) if node is not None else self.engine_pods(ns)

        spaces = ({key[0] for key in list(self.engine_pods_index)} if others is None
                  else set(others))
        return pods(namespace) + [
            p for ns in sorted(spaces - {namespace}) for p in pods(ns)
            if p.cache == name and p.cache_namespace == namespace
        ]

    def node(self, name: str) -> views.NodeView | None:
        return next(iter(self.nodes.get(name, [])), None)

    def all_nodes(self) -> list[views.NodeView]:
        return [n for key in list(self.nodes) for n in self.nodes[key]]

    def nodes_labelled(self, label: str) -> list[str]:
        """Nodes carrying the Ready label `label` (a name part), by name."""
        return sorted(n.name for n in self.all_nodes() if label in n.ready_labels)
