"""One asyncio lock per object key, alive only while someone holds or awaits it."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Hashable


class KeyedLocks:
    def __init__(self) -> None:
        self._locks: weakref.WeakValueDictionary[Hashable, asyncio.Lock] = (
            weakref.WeakValueDictionary()
        )

    def get(self, key: Hashable) -> asyncio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            lock = asyncio.Lock()
            self._locks[key] = lock
        return lock
