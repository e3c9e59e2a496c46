"""Node label decisions: `weightcache.dev/<cache>=Ready` where weights are verified.

Label keys carry only the cache name, so same-named caches in different
namespaces share a key: a node keeps it while any of them is ready there.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from . import names

_LABEL_NAME_RE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$")


def labelable(cache_name: str) -> bool:
    """Whether the cache name fits in a label key's name part (63 characters)."""
    return bool(_LABEL_NAME_RE.match(cache_name))


def orphans(labelled: frozenset[str], existing: Iterable[str]) -> frozenset[str]:
    """Cache names a node is labelled Ready for although no such cache exists any more."""
    return labelled - frozenset(existing)


def label_change(cache_name: str, ready: bool, observed: Iterable[frozenset[str]]
                 ) -> Mapping[str, str | None]:
    """Merge-patch for one cache's label, empty only if every observation already agrees.

    The observations are the watch index (which lags our own writes) and what
    this operator last wrote (which misses writes by others); patching when
    either disagrees converges from both kinds of staleness.
    """
    if all((cache_name in labels) == ready for labels in observed):
        return {}
    return {names.node_label_key(cache_name): names.NODE_LABEL_READY if ready else None}


def label_patch(current: frozenset[str], desired: frozenset[str]) -> Mapping[str, str | None]:
    """Merge-patch labels turning `current` Ready caches into `desired`; empty when equal."""
    patch: dict[str, str | None] = {}
    for name in sorted(desired - current):
        patch[names.node_label_key(name)] = names.NODE_LABEL_READY
    for name in sorted(current - desired):
        patch[names.node_label_key(name)] = None
    return patch
