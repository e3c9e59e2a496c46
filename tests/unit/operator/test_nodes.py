from __future__ import annotations

import pytest

from weightcache_operator import nodes


def test_label_patch_adds_and_removes_only_differences() -> None:
    assert nodes.label_patch(frozenset(), frozenset({"minilm"})) == {
        "weightcache.dev/minilm": "Ready"
    }
    assert nodes.label_patch(frozenset({"minilm", "llama"}), frozenset({"llama"})) == {
        "weightcache.dev/minilm": None
    }
    assert nodes.label_patch(frozenset({"a"}), frozenset({"a"})) == {}


def test_label_change_needs_every_observation_to_agree() -> None:
    key = "weightcache.dev/minilm"
    labelled, bare = frozenset({"minilm"}), frozenset()
    assert nodes.label_change("minilm", True, [labelled, labelled]) == {}
    assert nodes.label_change("minilm", False, [bare, bare]) == {}
    # The index lags a write we made, or someone else edited the node: write again.
    assert nodes.label_change("minilm", True, [bare, labelled]) == {key: "Ready"}
    assert nodes.label_change("minilm", False, [bare, labelled]) == {key: None}
    assert nodes.label_change("minilm", True, [labelled, frozenset({"other"})]) == {key: "Ready"}


def test_orphans_are_labels_without_a_cache() -> None:
    assert nodes.orphans(frozenset({"a", "b"}), ["b", "c"]) == frozenset({"a"})
    assert nodes.orphans(frozenset(), ["b"]) == frozenset()


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("minilm", True),
        ("llama-3.1-70b", True),
        ("a" * 63, True),
        ("a" * 64, False),
        ("-bad", False),
        ("", False),
    ],
)
def test_labelable(name: str, ok: bool) -> None:
    assert nodes.labelable(name) is ok
