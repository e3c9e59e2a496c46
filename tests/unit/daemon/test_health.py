"""The probes' decisions and the load-progress clock (pure, with an injected clock)."""

from __future__ import annotations

import pytest

from weightcache.daemon.health import (
    MIN_READ_PROGRESS,
    LoadProgress,
    Probe,
    liveness,
    process_read_bytes,
    readiness,
)


def live(state: str = "loading", died: bool = False, idle: float = 0.0) -> Probe:
    return liveness(
        state=state, server_died=died, phase="loading from disk", idle_seconds=idle,
        stall_seconds=120,
    )  # fmt: skip


def test_liveness_fails_only_for_a_stalled_load_or_a_dead_accept_loop() -> None:
    assert live(idle=120) == Probe(200, "ok\n")
    assert live(idle=121) == Probe(
        503, "stuck: no progress for 121 s while loading from disk (limit 120 s)\n"
    )
    assert live(state="ready", idle=10_000).code == 200  # idle only counts while loading
    assert live(state="ready", died=True) == Probe(503, "socket server stopped accepting\n")


@pytest.mark.parametrize(
    ("state", "accepting", "expected"),
    [
        ("ready", True, Probe(200, "ready\n")),
        ("ready", False, Probe(503, "not accepting connections\n")),
        ("loading", True, Probe(503, "not ready\n")),
        ("error", True, Probe(503, "not ready\n")),
    ],
)
def test_readiness(state, accepting, expected) -> None:
    assert readiness(state=state, accepting=accepting) == expected


def test_progress_is_a_phase_or_enough_bytes_read() -> None:
    now, read = [0.0], [0]
    progress = LoadProgress(lambda: now[0], lambda: read[0])
    now[0] = 10
    assert progress.idle_seconds() == 10
    read[0] += MIN_READ_PROGRESS - 1  # probes reading /proc themselves are not progress
    now[0] = 20
    assert progress.idle_seconds() == 20
    read[0] += 1
    now[0] = 30
    assert progress.idle_seconds() == 0
    now[0] = 45
    assert progress.idle_seconds() == 15
    progress.mark("re-adopting")
    assert progress.idle_seconds() == 0 and progress.phase == "re-adopting"


def test_without_read_accounting_nothing_is_reported_idle() -> None:
    now = [0.0]
    progress = LoadProgress(lambda: now[0], lambda: None)
    now[0] = 1e6
    assert progress.idle_seconds() == 0


def test_reading_a_file_shows_in_process_read_bytes(tmp_path) -> None:
    path = tmp_path / "data"
    path.write_bytes(bytes(2 * MIN_READ_PROGRESS))
    before = process_read_bytes()
    assert before is not None
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 16):
            pass
    assert process_read_bytes() - before >= 2 * MIN_READ_PROGRESS
