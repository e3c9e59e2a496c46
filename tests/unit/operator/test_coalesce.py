"""One run per key per interval: the first at once, the rest folded (coalesce.py)."""

from __future__ import annotations

import asyncio

from weightcache_operator.coalesce import Coalescer


def test_requests_while_a_run_is_due_fold_into_one_trailing_run() -> None:
    runs: list[int] = []
    state = {"value": 0}

    async def job() -> None:
        runs.append(state["value"])

    async def burst() -> None:
        c = Coalescer(interval=0.01)
        c.request("k", job)
        await asyncio.sleep(0)  # the first request runs at once
        for value in range(1, 50):
            state["value"] = value
            c.request("k", job)
        c.request("other", job)
        await c.flush()
        assert not c.pending_any()

    asyncio.run(burst())
    # One leading run, one for "other", one trailing run that sees the last value.
    assert sorted(runs) == [0, 49, 49]


def test_a_failing_job_is_run_again() -> None:
    attempts: list[int] = []

    async def flaky() -> None:
        attempts.append(1)
        if len(attempts) < 3:
            raise RuntimeError("apiserver said no")

    async def go() -> None:
        c = Coalescer(interval=0, retry=0)
        c.request("k", flaky)
        await c.flush()

    asyncio.run(go())
    assert len(attempts) == 3
