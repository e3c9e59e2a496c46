from __future__ import annotations

from weightcache_operator.conditions import condition, merge_conditions

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z"


def test_transition_time_kept_while_status_holds() -> None:
    old = [{**condition("Ready", True, "Ready", "old"), "lastTransitionTime": T0}]
    merged = merge_conditions(old, [condition("Ready", True, "Ready", "new message")], T1)
    assert merged == [
        {
            "type": "Ready",
            "status": "True",
            "reason": "Ready",
            "message": "new message",
            "lastTransitionTime": T0,
        }
    ]


def test_transition_time_moves_when_status_flips_or_is_new() -> None:
    old = [{**condition("Ready", True, "Ready", ""), "lastTransitionTime": T0}]
    merged = merge_conditions(
        old,
        [condition("Ready", False, "X", ""), condition("Degraded", False, "AsExpected", "")],
        T1,
    )
    assert [c["lastTransitionTime"] for c in merged] == [T1, T1]


def test_condition_shape() -> None:
    assert condition("A", False, "R", "m", observedGeneration=3) == {
        "type": "A",
        "status": "False",
        "reason": "R",
        "message": "m",
        "observedGeneration": 3,
    }
