"""Model rollouts the operator drives: what to evict now.

`make_room` (`spec.rollout.strategy: Auto`): the DaemonSet replaces each node's
daemon; the new one keeps the old weights the engines there map and loads the
new generation beside them where the device has room. Where it has not, it
reports `waitingForRoom`, and the engine pods on that node bound to an older
generation are evicted (the Eviction API: PodDisruptionBudgets decide): once
no engine holds the old weights, the daemon drops them (30 s later) and loads.

`plan` (`NodeByNode`) follows.

For GPUs that cannot hold two generations: a node's daemon pod of an older
generation is replaced only once no engine pod there still runs an older
generation, so the new weights never load beside the old engines' mappings.
The DaemonSet's update strategy is `OnDelete` (render.update_strategy); this
module decides, from the indices alone, which engine pods and which daemon
pods the operator evicts in this pass. The decision is stateless and
deterministic, so a restarted operator continues where the last one stopped:

- A node is *in flight* while it has a terminating engine pod of an older
  generation or a terminating old daemon pod (it was started), or while its
  daemon pods are all of the current generation but not all Ready (the new one
  loads). At most `maxUnavailable` nodes are in flight.
- Free places go to the nodes still on an older generation, by name.
- On a started node, every engine pod bound to an older generation is evicted
  (the Eviction API: PodDisruptionBudgets decide, a refusal holds the node);
  once none is left, not even terminating (its memory is freed when its
  processes exit), the old daemon pod is evicted, and the DaemonSet controller
  makes the new one.

Only engine pods the cache gates and that carry its binding to another
generation are "retiring" (the caller decides that, reconcile.py): an unbound
pod is judged by the current spec and never evicted.

`recreated` (both strategies): a controller whose pod template carries the
binding to the old generation (a selector-gated engine's) makes each evicted
pod again, bound to that generation, on that node: while a Deployment's own
rolling update keeps its old ReplicaSet, forever. Such pods are not evicted
again; the status says which controller holds the node and what to change.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from weightcache.report import ReportError, decode_pod_reports

from .views import DaemonPodView, EnginePodView

# Event reasons on the cache, and the Progressing reasons while a rollout runs.
EVICTED = "Evicted"
EVICTION_BLOCKED = "EvictionBlocked"
ROLLING_NODE_BY_NODE = "RollingNodeByNode"
MAKING_ROOM = "MakingRoom"
ROOM_HELD = "RoomHeld"
EVICTIONS_UNDONE = "EvictionsUndone"
# How long a node's daemon may wait for room with no engine pod there the operator could
# evict before the status says who must act: the daemon drops kept weights 30 s after the
# last engine lets go, so a shorter wait is a rollout still moving.
ROOM_HELD_SECONDS = 120.0


@dataclass(frozen=True)
class Plan:
    """One pass's evictions and what the rollout is doing."""

    # Engine pods bound to an older generation, on nodes being rolled.
    evict_engines: tuple[EnginePodView, ...] = ()
    # Old daemon pods whose nodes have no such engine pod left.
    evict_daemons: tuple[DaemonPodView, ...] = ()
    # Nodes in flight after this pass (started, or their new daemon loading), by name.
    rolling: tuple[str, ...] = ()
    # Nodes still on an older generation and not started yet.
    waiting: int = 0


@dataclass(frozen=True)
class Progress:
    """What a node-by-node rollout's last pass did (the status's Progressing condition)."""

    rolling: tuple[str, ...] = ()
    waiting: int = 0
    # The pass's refused evictions ("namespace/name: why").
    blocked: tuple[str, ...] = ()
    # The strategy that drives it: NodeByNode, or Auto (making room where daemons wait).
    strategy: str = "NodeByNode"
    # Auto: nodes whose daemon has waited for room ROOM_HELD_SECONDS with nothing to evict.
    held: tuple[str, ...] = ()
    # Controllers that re-create the pods evicted from a node, bound to the old
    # generation ("Kind/name on node N re-creates its pods bound to G").
    undone: tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        return bool(self.rolling or self.waiting or self.blocked or self.held or self.undone)


def unavailable_budget(max_unavailable: int | str, nodes: int) -> int:
    """`maxUnavailable` as a node count, a percentage rounded up as the DaemonSet
    controller rounds it; at least 1."""
    if isinstance(max_unavailable, str):
        percent = int(max_unavailable.rstrip("%"))
        return max(1, math.ceil(nodes * percent / 100))
    return max(1, max_unavailable)


def plan(
    current: str,
    max_unavailable: int | str,
    daemon_pods: Sequence[DaemonPodView],
    retiring: Mapping[str, Sequence[EnginePodView]],
) -> Plan:
    """The evictions of one pass. `daemon_pods`: the cache's own (its DaemonSet's), any
    state; `retiring`: per node, the engine pods there bound to another generation than
    `current` and not finished, terminating ones included."""
    on: dict[str, list[DaemonPodView]] = {}
    for pod in daemon_pods:
        if pod.node:
            on.setdefault(pod.node, []).append(pod)
    in_flight: list[str] = []
    candidates: list[str] = []
    for node in sorted(on):
        pods = on[node]
        old = [p for p in pods if p.spec_hash != current]
        if not old:
            if any(p.terminating or not p.ready for p in pods):
                in_flight.append(node)  # its new daemon loads
            continue
        engines = retiring.get(node, ())
        if any(p.terminating for p in old) or any(e.terminating for e in engines):
            in_flight.append(node)
        else:
            candidates.append(node)
    room = max(0, unavailable_budget(max_unavailable, len(on)) - len(in_flight))
    started = set(candidates[:room])
    evict_engines: list[EnginePodView] = []
    evict_daemons: list[DaemonPodView] = []
    for node in sorted(on):
        old = [p for p in on[node] if p.spec_hash != current]
        if not old or (node not in started and node not in in_flight):
            continue
        engines = retiring.get(node, ())
        live = [e for e in engines if not e.terminating]
        if live:
            evict_engines.extend(sorted(live, key=lambda e: (e.namespace, e.name)))
        elif not engines:
            evict_daemons.extend(p for p in old if not p.terminating)
    return Plan(
        evict_engines=tuple(evict_engines),
        evict_daemons=tuple(evict_daemons),
        rolling=tuple(sorted({*in_flight, *started})),
        waiting=len(candidates) - len(started),
    )


def waits_for_room(pod: DaemonPodView) -> bool:
    """Whether a daemon pod reports, for any of its devices, that its generation waits for
    room beside kept ones (an unreadable report says nothing)."""
    try:
        return any(r.waiting_for_room for r in decode_pod_reports(pod.reports).values())
    except ReportError:
        return False


def make_room(
    current: str,
    daemon_pods: Sequence[DaemonPodView],
    retiring: Mapping[str, Sequence[EnginePodView]],
) -> Plan:
    """Auto's evictions of one pass: on each node whose daemon pod of the `current`
    generation (alive, the cache's own) waits for room, every engine pod there bound to an
    older generation and not terminating yet. `rolling`: those nodes, by name."""
    nodes = sorted({p.node for p in daemon_pods
                    if p.node and not p.terminating and p.spec_hash == current
                    and waits_for_room(p)})
    evict = [e for node in nodes
             for e in sorted(retiring.get(node, ()), key=lambda e: (e.namespace, e.name))
             if not e.terminating]
    return Plan(evict_engines=tuple(evict), rolling=tuple(nodes))


def room_held(
    waiting: Sequence[str],
    retiring: Mapping[str, Sequence[EnginePodView]],
    since: Mapping[str, float],
    now: float,
    after: float = ROOM_HELD_SECONDS,
) -> tuple[tuple[str, ...], dict[str, float]]:
    """Of the nodes whose daemon waits for room (`waiting`), those where it has waited at
    least `after` seconds with no engine pod there bound to an older generation, evicted or
    not: what keeps the old weights is then nothing the operator can evict (an engine
    without this cache's binding, one that left the watch, one past the pod limits, or a
    process outside Kubernetes). Returns them and, per such node, since when it has had
    nothing to evict (the next pass's `since`)."""
    nothing = {node: since.get(node, now) for node in waiting if not retiring.get(node)}
    held = tuple(sorted(n for n, t in nothing.items() if now - t >= after))
    return held, nothing



# (the controller's uid, the older generation its pods are bound to)
ControllerKey = tuple[str, str]
# How long the operator remembers a controller it evicted from once no pod of it bound to
# that generation is seen: an evicted pod may be gone a moment before its copy is made.
FORGET_SECONDS = 60.0


@dataclass(frozen=True)
class EvictedFrom:
    """A controller the operator evicted a pod of, bound to an older generation."""

    # Its pods bound to that generation at the first eviction, scheduled or not.
    before: frozenset[str]
    # When a pod of it bound to that generation was last seen.
    seen: float


def controller_key(pod: EnginePodView, generation: str) -> ControllerKey | None:
    """Whose pods an eviction of `pod` (bound to `generation`) makes again; None for a pod
    without a controller (nobody re-creates it)."""
    return (pod.owner_uid, generation) if pod.owner_uid else None


def by_controller(pods: Iterable[tuple[EnginePodView, str]]
                  ) -> dict[ControllerKey, frozenset[str]]:
    """The uids of `pods` (each with the generation it is bound to) per controller key."""
    out: dict[ControllerKey, set[str]] = {}
    for pod, generation in pods:
        key = controller_key(pod, generation)
        if key is not None:
            out.setdefault(key, set()).add(pod.uid)
    return {k: frozenset(v) for k, v in out.items()}


def recreated(
    present: Mapping[ControllerKey, frozenset[str]],
    evicted_from: Mapping[ControllerKey, EvictedFrom],
    now: float,
    forget_after: float = FORGET_SECONDS,
) -> tuple[frozenset[str], dict[ControllerKey, EvictedFrom]]:
    """Pods made after the operator evicted one of their controller's pods bound to the
    same older generation. `present`: the cache's pods bound to an older generation now,
    per controller key, on any node or none (`by_controller`); `evicted_from`: what the
    operator evicted from. A pod of such a key that was not there at the first eviction
    was made since, bound to the old generation again: evicting it would be undone again.
    Returns their uids, and `evicted_from` as the next pass keeps it: seen now where the
    key has pods, forgotten `forget_after` seconds after it last had any."""
    kept = {k: EvictedFrom(e.before, now) if k in present else e
            for k, e in evicted_from.items()
            if k in present or now - e.seen < forget_after}
    undone = frozenset(uid for k, e in kept.items() if k in present
                       for uid in present[k] - e.before)
    return undone, kept
