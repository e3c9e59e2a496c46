"""Node label decisions: `weightcache.dev/<namespace>.<name>=Ready` where weights are verified.

One label per cache (`names.node_label_name`): caches of the same name in
different namespaces never share one. Functions here take label name parts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from . import names


def orphans(labelled: frozenset[str], existing: Iterable[str]) -> frozenset[str]:
    """Label names a node carries although no live cache has them any more."""
    return labelled - frozenset(existing)


def label_change(label: str, ready: bool, labelled: bool) -> Mapping[str, str | None]:
    """Merge-patch for one cache's label; empty when the node already says `ready`.

    `labelled` is what stands (reconcile.py tells a lagging index apart, written.py).
    """
    if labelled == ready:
        return {}
    return {names.NODE_LABEL_PREFIX + label: names.NODE_LABEL_READY if ready else None}


def label_patch(current: frozenset[str], desired: frozenset[str]) -> Mapping[str, str | None]:
    """Merge-patch labels turning `current` Ready caches into `desired`; empty when equal."""
    patch: dict[str, str | None] = {}
    for name in sorted(desired - current):
        patch[names.NODE_LABEL_PREFIX + name] = names.NODE_LABEL_READY
    for name in sorted(current - desired):
        patch[names.NODE_LABEL_PREFIX + name] = None
    return patch
