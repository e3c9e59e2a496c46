"""Run a job per key at most once per interval, however often it is asked for.

The first request runs at once; requests that arrive while it runs or during
the interval after it fold into one trailing run. A job reads the newest state
when it runs (the watch indices are live), so one run carries every request
before it. A job that raises is logged and run again after `retry` seconds,
never dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

Job = Callable[[], Awaitable[None]]


@dataclass
class Coalescer:
    interval: float
    retry: float = 5.0
    _wanted: dict[Hashable, Job] = field(default_factory=dict)
    _tasks: dict[Hashable, asyncio.Task[None]] = field(default_factory=dict)

    def request(self, key: Hashable, job: Job) -> None:
        self._wanted[key] = job
        if key not in self._tasks:
            self._tasks[key] = asyncio.create_task(self._run(key))

    def pending_any(self) -> bool:
        return bool(self._tasks)

    async def _run(self, key: Hashable) -> None:
        try:
            while key in self._wanted:
                job = self._wanted.pop(key)
                try:
                    await job()
                except Exception as exc:  # kept, never lost: run again after a pause
                    log.warning("%s: %s; again in %ss", key, exc, self.retry)
                    self._wanted.setdefault(key, job)
                    await asyncio.sleep(self.retry)
                    continue
                await asyncio.sleep(self.interval)
        finally:
            self._tasks.pop(key, None)

    async def flush(self) -> None:
        """Wait until every requested job has run (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks.values()), return_exceptions=True)
