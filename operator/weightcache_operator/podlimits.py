"""What the operator keeps of an engine pod, and the limits that bound it (pure).

Anyone who may create a pod can make it a gated engine pod, so what the
operator holds per pod is bounded before it is kept: of the pod's metadata it
keeps its labels (a cache's `spec.engine.selector` reads them, the one-label
form its `weightcache.dev/cache`), its binding annotations
(`weights.weightcache.dev/<namespace>.<name>`, one per cache that gates it)
and the namespace its `weightcache.dev/cache-namespace` annotation names;
nothing else. Labels are kept whole within LIMITS rather than only those some
cache's selector names: a view does not depend on which caches exist when it
is built, so a cache created later judges every pod by its own selector.

A pod past a limit is refused by the webhook at admission (`violation` names
the limit), and one that got past it (relabelled after admission, or created
where the webhook is off) keeps nothing in its view but why: its gate is closed
naming the limit, and no cache counts it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import names


@dataclass(frozen=True)
class Limits:
    labels: int
    label_bytes: int
    bindings: int


# Generous for a real engine pod (a Deployment's, Helm's and a service mesh's labels come
# to 10 to 30), small enough that 100,000 pods at the limits stay within a few GiB.
LIMITS = Limits(labels=64, label_bytes=16 * 1024, bindings=16)

# Longer values name nothing the operator compares them with (a spec hash is 64 hex
# digits, a namespace at most 63 characters): kept cut to this, still naming nothing.
MAX_VALUE_CHARS = 65
# A controller's "Kind/name" as the index keeps it (a name is at most 253 characters).
MAX_OWNER_CHARS = 320
# A gate condition's message as the index keeps it; the operator's own stay far below.
MAX_MESSAGE_CHARS = 4096

# The gate's reason for a pod past the limits.
OVER_LIMITS = "PodOverLimits"

WHY = "a gated engine pod is kept in the weightcache operator's memory (docs/design.md)"


def label_bytes(labels: Mapping[str, Any]) -> int:
    """The labels' keys and values, in UTF-8 bytes."""
    return sum(len(str(k).encode()) + len(str(v).encode()) for k, v in labels.items())


def bindings_of(annotations: Mapping[str, Any]) -> list[str]:
    return [k for k in annotations if str(k).startswith(names.BINDING_PREFIX)]


def violation(labels: Mapping[str, Any], annotations: Mapping[str, Any],
              limits: Limits = LIMITS) -> str | None:
    """Why a pod is past the limits (the first limit it passes, named), or None."""
    if len(labels) > limits.labels:
        return (f"{len(labels)} labels, over the limit of {limits.labels} labels: {WHY}")
    size = label_bytes(labels)
    if size > limits.label_bytes:
        return (f"labels of {size} bytes, over the limit of {limits.label_bytes} bytes of "
                f"labels: {WHY}")
    bindings = len(bindings_of(annotations))
    if bindings > limits.bindings:
        return (f"{bindings} {names.BINDING_PREFIX}* annotations, over the limit of "
                f"{limits.bindings} (one per WeightCache that gates the pod): {WHY}")
    return None


def cut(value: Any, chars: int = MAX_VALUE_CHARS) -> str:
    return str(value)[:chars]
