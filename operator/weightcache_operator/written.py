"""What the operator last wrote, so that a lagging watch index causes no repeated write.

The indices show our own writes a watch round trip later (seconds, on a busy
apiserver). A pass that runs in between sees the old value and, comparing with
the index alone, writes the same value again; at fleet scale every report
change then costs several identical writes. So each write is remembered with
the resourceVersion of the object it was decided on: while the index still
shows that version, the value stands as we wrote it (our write is in flight);
once the index shows a newer version, the index is the truth again (our write
landed, someone else edited, or our write was lost), and a pass writes only
when the decision differs from that current value.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

V = TypeVar("V")


@dataclass
class Written(Generic[V]):
    _values: dict[Hashable, tuple[V, str]] = field(default_factory=dict)

    def current(self, key: Hashable, observed: V, version: str) -> V:
        """The value as it stands: ours while the index still shows the version we wrote over.

        An object without a version (``""``) is taken as the index shows it.
        """
        remembered = self._values.get(key)
        if remembered is not None and version and remembered[1] == version:
            return remembered[0]
        return observed

    def record(self, key: Hashable, desired: V, version: str) -> None:
        """`desired` was written, decided on the object at `version`."""
        self._values[key] = (desired, version)

    def last(self, key: Hashable) -> V | None:
        """What was last written for `key`, whatever version it was decided on."""
        remembered = self._values.get(key)
        return remembered[0] if remembered is not None else None

    def forget(self, key: Hashable) -> None:
        self._values.pop(key, None)

    def __len__(self) -> int:
        return len(self._values)
