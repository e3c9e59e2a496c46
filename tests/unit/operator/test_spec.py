from __future__ import annotations

import copy
import hashlib

import pytest

from weightcache_operator.spec import (
    GpuSpec,
    LabelSelector,
    Requirement,
    SpecError,
    parse_spec,
    spec_hash,
)

MINIMAL = {"model": {"path": "/models/minilm"}}


def test_minimal_spec_gets_defaults() -> None:
    spec = parse_spec(MINIMAL)
    assert spec.device == "cuda"
    assert spec.transport == "auto"
    assert spec.gpus == GpuSpec(per_node=1, tp_size=1)
    assert spec.model.dtype == "auto"
    assert spec.socket_dir == "/var/run/weightcache"
    assert spec.engine.selector is None
    assert spec.engine.byte_tolerance == 0.01
    assert (spec.sidecar.run_as_user, spec.sidecar.run_as_group) == (65533, 65533)
    assert spec.slots == 1


def test_slots_follow_gpus_per_node_and_cpu_has_one() -> None:
    assert (
        parse_spec({**MINIMAL, "gpus": {"perNode": 8, "tpSize": 4, "shardPlan": "llama"}}).slots
        == 8
    )
    assert parse_spec({**MINIMAL, "device": "cpu", "transport": "memfd"}).slots == 1


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({}, "spec.model"),
        ({"model": {}}, "spec.model"),
        ({"model": {"path": "/a", "pvc": {"claimName": "x"}}}, "spec.model"),
        ({"model": {"path": "relative/dir"}}, "spec.model.path"),
        ({"model": {"path": "/models/../etc"}}, "spec.model.path"),
        ({"model": {"pvc": {}}}, "spec.model.pvc.claimName"),
        ({"model": {"pvc": {"claimName": "Bad_Name"}}}, "spec.model.pvc.claimName"),
        ({"model": {"pvc": {"claimName": "ok", "subPath": "/abs"}}}, "spec.model.pvc.subPath"),
        ({**MINIMAL, "transport": "nccl"}, "spec.transport"),
        ({**MINIMAL, "device": "tpu"}, "spec.device"),
        ({**MINIMAL, "gpus": {"perNode": -1}}, "spec.gpus.perNode"),
        ({**MINIMAL, "gpus": {"perNode": 0}}, "spec.gpus.perNode"),
        ({**MINIMAL, "gpus": {"perNode": True}}, "spec.gpus.perNode"),
        ({**MINIMAL, "gpus": {"perNode": 6, "tpSize": 4}}, "spec.gpus.perNode"),
        ({**MINIMAL, "gpus": {"perNode": 2, "tpSize": 2}}, "spec.gpus.shardPlan"),
        (
            {**MINIMAL, "gpus": {"perNode": 2, "tpSize": 2, "shardPlan": "gpt"}},
            "spec.gpus.shardPlan",
        ),
        ({**MINIMAL, "device": "cpu", "transport": "vmm_fd"}, "spec.transport"),
        ({**MINIMAL, "device": "cuda", "transport": "memfd"}, "spec.transport"),
        ({**MINIMAL, "device": "cpu", "gpus": {"perNode": 2}}, "spec.gpus"),
        ({**MINIMAL, "socketDir": "run/wc"}, "spec.socketDir"),
        (
            {**MINIMAL, "sidecar": {"resources": {"requests": {"memory": "1GB"}}}},
            "spec.sidecar.resources.requests.memory",
        ),
        (
            {**MINIMAL, "sidecar": {"resources": {"limits": {"cpu": "-1"}}}},
            "spec.sidecar.resources.limits.cpu",
        ),
        ({**MINIMAL, "sidecar": {"httpPort": 80}}, "spec.sidecar.httpPort"),
        ({**MINIMAL, "sidecar": {"imagePullPolicy": "Sometimes"}}, "spec.sidecar.imagePullPolicy"),
        ({**MINIMAL, "gpuAccess": {"mode": "dra"}}, "spec.gpuAccess.claim"),
        ({**MINIMAL, "gpuAccess": {"resourceName": "nvidia.com/"}}, "spec.gpuAccess.resourceName"),
        ({**MINIMAL, "engine": {"byteTolerance": 1.5}}, "spec.engine.byteTolerance"),
        ({**MINIMAL, "engine": {"expectedBytes": 0}}, "spec.engine.expectedBytes"),
        (
            {
                **MINIMAL,
                "engine": {"selector": {"matchExpressions": [{"key": "a", "operator": "In"}]}},
            },
            "spec.engine.selector.matchExpressions[0].values",
        ),
        (
            {**MINIMAL, "engine": {"selector": {"matchLabels": {"a": 1}}}},
            "spec.engine.selector.matchLabels[...]",
        ),
        ({**MINIMAL, "placement": {"tolerations": {"key": "x"}}}, "spec.placement.tolerations"),
        (
            {**MINIMAL, "sidecar": {"allowedPeers": {"uids": [-1]}}},
            "spec.sidecar.allowedPeers.uids",
        ),
        ({**MINIMAL, "sidecar": {"allowedPeers": {"gids": "0"}}}, "spec.sidecar.allowedPeers.gids"),
        # Root as a peer would let any root process on the node map the weights.
        ({**MINIMAL, "sidecar": {"allowedPeers": {"uids": [0]}}}, "spec.sidecar.allowedPeers.uids"),
        ({**MINIMAL, "sidecar": {"allowedPeers": {"gids": [0]}}}, "spec.sidecar.allowedPeers.gids"),
        # An empty selector would hold every gated pod of the namespace.
        ({**MINIMAL, "engine": {"selector": {}}}, "spec.engine.selector"),
        ({**MINIMAL, "engine": {"selector": {"matchLabels": {}}}}, "spec.engine.selector"),
        ({**MINIMAL, "rollout": {"maxUnavailable": 0}}, "spec.rollout.maxUnavailable"),
        ({**MINIMAL, "rollout": {"maxUnavailable": "0%"}}, "spec.rollout.maxUnavailable"),
        ({**MINIMAL, "rollout": {"maxUnavailable": "101%"}}, "spec.rollout.maxUnavailable"),
        ({**MINIMAL, "rollout": {"maxUnavailable": "5"}}, "spec.rollout.maxUnavailable"),
        ({**MINIMAL, "rollout": {"maxUnavailable": True}}, "spec.rollout.maxUnavailable"),
        ({**MINIMAL, "rollout": {"maxUnavailable": 2**31}}, "spec.rollout.maxUnavailable"),
        ({**MINIMAL, "rollout": {"strategy": "Fast"}}, "spec.rollout.strategy"),
        ({**MINIMAL, "rollout": {"strategy": "nodebynode"}}, "spec.rollout.strategy"),
    ],
)
def test_invalid_specs_name_the_field(raw: dict, field: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(raw)
    assert str(err.value).startswith((field + ":", field + "[")), str(err.value)


@pytest.mark.parametrize("value", [1, 50, "1%", "25%", "100%"])
def test_rollout_takes_a_count_or_a_percentage(value: int | str) -> None:
    parsed = parse_spec({**MINIMAL, "rollout": {"maxUnavailable": value}})
    assert parsed.rollout.max_unavailable == value


def test_integer_quantities_are_accepted_as_strings() -> None:
    spec = parse_spec({**MINIMAL, "sidecar": {"resources": {"requests": {"cpu": 2}}}})
    assert spec.sidecar.resources.requests == {"cpu": 2}


def test_hash_is_stable_and_ignores_defaults_being_explicit() -> None:
    explicit = {
        "model": {"path": "/models/minilm", "dtype": "auto"},
        "device": "cuda",
        "gpus": {"perNode": 1, "tpSize": 1},
        "transport": "auto",
    }
    assert spec_hash(parse_spec(MINIMAL)) == spec_hash(parse_spec(explicit))
    # The canonical form is part of the contract: changing it would make every
    # running daemon look stale after an operator upgrade.
    canonical = (
        '{"device":"cuda","gpus":{"perNode":1,"tpSize":1},"model":{"dtype":"auto",'
        '"path":"/models/minilm","pvc":null,"revision":null},"transport":"auto"}'
    )
    assert spec_hash(parse_spec(MINIMAL)) == hashlib.sha256(canonical.encode()).hexdigest()


@pytest.mark.parametrize(
    "change",
    [
        {"model": {"path": "/models/other"}},
        {"model": {"path": "/models/minilm", "revision": "abc"}},
        {"model": {"path": "/models/minilm", "dtype": "bfloat16"}},
        {"gpus": {"perNode": 2}},
        {"gpus": {"perNode": 2, "tpSize": 2, "shardPlan": "llama"}},
        {"transport": "vmm_fd"},
        {"model": {"pvc": {"claimName": "models", "subPath": "minilm"}}},
    ],
)
def test_hash_changes_with_what_decides_the_weights(change: dict) -> None:
    assert spec_hash(parse_spec({**MINIMAL, **change})) != spec_hash(parse_spec(MINIMAL))


@pytest.mark.parametrize(
    "change",
    [
        {"engine": {"byteTolerance": 0.2, "expectedBytes": 5}},
        {"sidecar": {"image": "other:2", "resources": {"limits": {"memory": "1Gi"}}}},
        {"placement": {"nodeSelector": {"pool": "gpu"}}},
        {"socketDir": "/run/other"},
        # How fast the daemons roll is no part of which weights they hold.
        {"rollout": {"maxUnavailable": "10%"}},
    ],
)
def test_hash_ignores_gate_and_pod_plumbing(change: dict) -> None:
    assert spec_hash(parse_spec({**MINIMAL, **change})) == spec_hash(parse_spec(MINIMAL))


def test_parse_does_not_mutate_input() -> None:
    raw = {**MINIMAL, "placement": {"tolerations": [{"key": "a", "operator": "Exists"}]}}
    before = copy.deepcopy(raw)
    parse_spec(raw)
    assert raw == before


@pytest.mark.parametrize(
    ("selector", "labels", "matches"),
    [
        (LabelSelector(), {}, True),
        (LabelSelector({"app": "e"}), {"app": "e", "x": "y"}, True),
        (LabelSelector({"app": "e"}), {"app": "f"}, False),
        (LabelSelector(match_expressions=(Requirement("t", "In", ("a", "b")),)), {"t": "b"}, True),
        (LabelSelector(match_expressions=(Requirement("t", "In", ("a",)),)), {}, False),
        (LabelSelector(match_expressions=(Requirement("t", "NotIn", ("a",)),)), {}, True),
        (LabelSelector(match_expressions=(Requirement("t", "NotIn", ("a",)),)), {"t": "a"}, False),
        (LabelSelector(match_expressions=(Requirement("t", "Exists"),)), {"t": ""}, True),
        (LabelSelector(match_expressions=(Requirement("t", "DoesNotExist"),)), {"t": ""}, False),
    ],
)
def test_selector_semantics(selector: LabelSelector, labels: dict, matches: bool) -> None:
    assert selector.matches(labels) is matches


def test_selector_is_parsed() -> None:
    spec = parse_spec(
        {
            **MINIMAL,
            "engine": {
                "selector": {
                    "matchLabels": {"app": "engine"},
                    "matchExpressions": [{"key": "tier", "operator": "Exists"}],
                }
            },
        }
    )
    assert spec.engine.selector is not None
    assert spec.engine.selector.matches({"app": "engine", "tier": "x"})
    assert not spec.engine.selector.matches({"app": "engine"})
