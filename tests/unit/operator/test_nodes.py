from __future__ import annotations

import re

from weightcache_operator import names, nodes
from weightcache_operator.spec import DNS_SUBDOMAIN_RE

# Kubernetes' rule for the name part of a label key.
LABEL_NAME_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def test_label_patch_adds_and_removes_only_differences() -> None:
    assert nodes.label_patch(frozenset(), frozenset({"ns.minilm"})) == {
        "weightcache.dev/ns.minilm": "Ready"
    }
    assert nodes.label_patch(frozenset({"ns.minilm", "ns.llama"}), frozenset({"ns.llama"})) == {
        "weightcache.dev/ns.minilm": None
    }
    assert nodes.label_patch(frozenset({"a"}), frozenset({"a"})) == {}


def test_label_change_only_where_the_node_disagrees() -> None:
    key = "weightcache.dev/minilm"
    assert nodes.label_change("minilm", True, True) == {}
    assert nodes.label_change("minilm", False, False) == {}
    assert nodes.label_change("minilm", True, False) == {key: "Ready"}
    assert nodes.label_change("minilm", False, True) == {key: None}


def test_orphans_are_labels_without_a_cache() -> None:
    assert nodes.orphans(frozenset({"a", "b"}), ["b", "c"]) == frozenset({"a"})
    assert nodes.orphans(frozenset(), ["b"]) == frozenset()


def test_label_names_are_unique_per_namespace_and_fit_a_label_key() -> None:
    assert names.node_label_key("team", "minilm") == "weightcache.dev/team.minilm"
    # Same-named caches in different namespaces never share a label.
    assert names.node_label_name("a", "minilm") != names.node_label_name("b", "minilm")
    longest = names.node_label_name("n" * 63, "c" * 63)
    other = names.node_label_name("n" * 63, "c" * 62 + "d")
    assert len(longest) == 63 and longest != other
    assert LABEL_NAME_RE.match(longest) and LABEL_NAME_RE.match(other)
    for ns, name in [("n" * 63, "x." + "c" * 60), ("a", "b"), ("ns-1", "a" * 61)]:
        label = names.node_label_name(ns, name)
        assert len(label) <= 63 and LABEL_NAME_RE.match(label), label


def test_a_crafted_name_cannot_take_a_hashed_label() -> None:
    """Issue 25 item 11: in one namespace, `team.` + 60 y (hashed) and a 58-character name
    spelling that hash out once mapped to the same label, so either cache could set or drop
    the other's. Both names are valid cache names (DNS subdomains, at most 63 characters)."""
    hashed = names.node_label_name("team", "y" * 60)
    assert len(hashed) == 63
    head, digest = hashed[len("team."):-17], hashed[-16:]
    crafted = f"{head}-{digest}"
    assert len(crafted) == 58 and DNS_SUBDOMAIN_RE.match(crafted)
    assert names.node_label_name("team", crafted) != hashed
    assert LABEL_NAME_RE.match(hashed)
