"""Pod shapes: equal for a template and the pods made from it, different for any change of
what the pod may do."""

from __future__ import annotations

import copy

import pytest

from weightcache_operator import render
from weightcache_operator.policy import HostPaths, Policy
from weightcache_operator.shape import pod_shape, shape_digest
from weightcache_operator.spec import parse_spec, spec_hash

SPEC = parse_spec({"model": {"path": "/models/m"}, "device": "cpu", "sidecar": {"image": "s:1"},
                   "engine": {"selector": {"matchLabels": {"app": "e"}}}})
POLICY = Policy(setup_image="op:1", daemon_namespace="wc-system",
                allowed_host_paths=HostPaths(("/var/run/weightcache",), ("/models",)))


def template() -> dict:
    ds = render.render_daemonset(render.CacheRef("team", "wc", "uid", 1), SPEC, spec_hash(SPEC),
                                 POLICY, operator_uid=65532)
    return ds["spec"]["template"]["spec"]


def as_stored(spec: dict) -> dict:
    """What the API server keeps of a pod made from `spec`: the ServiceAccount token volume
    and mounts added, fields defaulted."""
    pod = copy.deepcopy(spec)
    pod["volumes"].append({"name": "kube-api-access-x7k2p", "projected": {"sources": []}})
    for container in pod["containers"] + pod["initContainers"]:
        container["terminationMessagePath"] = "/dev/termination-log"
        container["imagePullPolicy"] = "IfNotPresent"
        container.setdefault("volumeMounts", []).append({
            "name": "kube-api-access-x7k2p", "readOnly": True,
            "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"})
    pod.update(dnsPolicy="ClusterFirst", restartPolicy="Always", schedulerName="default-scheduler",
               nodeName="node-a", serviceAccount=pod["serviceAccountName"])
    return pod


def test_a_template_and_the_pods_made_from_it_have_one_shape() -> None:
    rendered = template()
    assert shape_digest(as_stored(rendered)) == shape_digest(rendered)
    # Arguments, environment and probes are not privileges.
    changed = copy.deepcopy(rendered)
    changed["containers"][0]["args"].append("--dtype")
    changed["containers"][0]["env"].append({"name": "X", "value": "1"})
    assert shape_digest(changed) == shape_digest(rendered)


def _host_pid(p: dict) -> None:
    p["hostPID"] = True


def _root(p: dict) -> None:
    p["securityContext"]["runAsUser"] = 0


def _privileged(p: dict) -> None:
    p["containers"][0]["securityContext"]["privileged"] = True


def _capability(p: dict) -> None:
    p["containers"][0]["securityContext"]["capabilities"]["add"] = ["SYS_ADMIN"]


def _image(p: dict) -> None:
    p["containers"][0]["image"] = "evil:1"


def _command(p: dict) -> None:
    p["containers"][0]["command"] = ["sh", "-c", "cat /etc/shadow"]


def _host_path(p: dict) -> None:
    p["volumes"].append({"name": "root", "hostPath": {"path": "/"}})
    p["containers"][0]["volumeMounts"].append({"name": "root", "mountPath": "/host"})


def _account(p: dict) -> None:
    p["serviceAccountName"] = "cluster-admin"


def _init_args(p: dict) -> None:
    p["initContainers"][0]["args"] = ["/etc"]


def _container(p: dict) -> None:
    p["containers"].append({"name": "sidecar", "image": "evil:1"})


@pytest.mark.parametrize("change", [_host_pid, _root, _privileged, _capability, _image, _command,
                                    _host_path, _account, _init_args, _container])
def test_every_change_of_privilege_changes_the_shape(change) -> None:
    rendered = template()
    edited = copy.deepcopy(rendered)
    change(edited)
    assert shape_digest(edited) != shape_digest(rendered)
    assert pod_shape(edited) != pod_shape(rendered)
