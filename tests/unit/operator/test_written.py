"""What the operator wrote vs a watch index that lags it (written.py)."""

from __future__ import annotations

from weightcache_operator.written import Written


def test_the_index_stands_until_something_is_written() -> None:
    written: Written[str] = Written()
    assert written.current("pod", "closed", "1") == "closed"


def test_our_write_stands_while_the_index_shows_the_version_it_was_decided_on() -> None:
    written: Written[str] = Written()
    written.record("pod", "open", "1")
    assert written.current("pod", "closed", "1") == "open"  # the watch has not caught up


def test_a_newer_version_in_the_index_is_the_truth_again() -> None:
    written: Written[str] = Written()
    written.record("pod", "open", "1")
    assert written.current("pod", "open", "2") == "open"  # our write landed
    assert written.current("pod", "closed", "3") == "closed"  # someone else changed it


def test_an_object_without_a_version_is_taken_as_the_index_shows_it() -> None:
    written: Written[str] = Written()
    written.record("pod", "open", "")
    assert written.current("pod", "closed", "") == "closed"


def test_forgotten_keys_are_gone() -> None:
    written: Written[str] = Written()
    written.record("pod", "open", "1")
    written.forget("pod")
    assert written.current("pod", "closed", "1") == "closed" and len(written) == 0
