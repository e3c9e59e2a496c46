"""The engine Deployment of `make demo-k8s` and the real-node tests: the additions
docs/engine-pod.md asks of every engine pod."""

from __future__ import annotations

from pathlib import Path

from tools import engine_pod


def test_the_engine_pins_the_daemons_uid() -> None:
    """Issue 25 item 13: without WEIGHTCACHE_DAEMON_UIDS an engine trusts whoever owns the
    socket directory; wherever the daemon's uid is known it is pinned."""
    deployment = engine_pod.engine_deployment(
        namespace="team", name="engine", cache="minilm", image="engine:1", node="n1",
        socket_root=Path("/var/run/weightcache"), model_dir=Path("/models/m"), version="v1",
        daemon_gid=65533, daemon_uid=4242)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["WEIGHTCACHE_DAEMON_UIDS"] == "4242"
    assert pod["securityContext"]["runAsUser"] != 4242  # an engine's uid is its own
    assert pod["securityContext"]["runAsGroup"] == 65533


def test_a_selector_gated_engine_carries_the_label_the_operator_watches() -> None:
    """Issue 43: the operator watches only pods labelled `weightcache.dev/gated=true`; the
    hostPath engine is gated by its cache's selector, with no webhook to add the label."""
    from weightcache_operator import names

    assert (engine_pod.GATED_LABEL, engine_pod.GATE_CONDITION, engine_pod.CACHE_LABEL) == (
        names.GATED_LABEL, names.GATE_CONDITION, names.CACHE_LABEL)
    deployment = engine_pod.engine_deployment(
        namespace="team", name="engine", cache="minilm", image="engine:1", node="n1",
        socket_root=Path("/var/run/weightcache"), model_dir=Path("/models/m"), version="v1",
        daemon_gid=65533)
    template = deployment["spec"]["template"]
    assert template["metadata"]["labels"][names.GATED_LABEL] == names.GATED_VALUE
    assert template["spec"]["readinessGates"] == [{"conditionType": names.GATE_CONDITION}]
