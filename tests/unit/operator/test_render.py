from __future__ import annotations

from typing import Any

import msgspec
import pytest

from weightcache.report import SPEC_HASH_ENV
from weightcache_operator import names
from weightcache_operator.policy import HostPaths, ModelSources, Policy, Toleration
from weightcache_operator.render import (
    CONTAINER_SOCKET_ROOT,
    LONGEST_SOCKET_NAME,
    MAX_SOCKET_PATH_BYTES,
    SETUP_SOCKET_ROOT,
    CacheRef,
    PolicyViolation,
    RenderError,
    render_daemonset,
    render_hash,
)
from weightcache_operator.spec import GPU_ACCESS_MODES, parse_spec, spec_hash

REF = CacheRef(namespace="team", name="minilm", uid="uid-1", generation=3)
CPU = {
    "model": {"path": "/models/minilm"},
    "device": "cpu",
    "transport": "memfd",
    "sidecar": {"image": "sidecar:1"},
}
GPU = {
    "model": {"path": "/models/llama"},
    "gpus": {"perNode": 8, "tpSize": 4, "shardPlan": "llama"},
    "transport": "vmm_fd",
    "sidecar": {"image": "sidecar:1"},
}


POLICY = Policy(
    setup_image="operator:1",
    daemon_namespace="weightcache-system",
    allowed_host_paths=HostPaths(
        socket_dirs=("/var/run/weightcache", "/var/run/wc"), model_dirs=("/models", "/m")
    ),
    # Claims are looked up in the daemon namespace: the admin names which.
    allowed_model_claims=("store",),
    allowed_resource_claims=("gpus-template", "node-gpus"),
    # visible-devices (rendered below) needs the images restricted.
    allowed_gpu_access_modes=GPU_ACCESS_MODES,
    allowed_sidecar_image_prefixes=("sidecar", "s", "op-default", "attacker.example/"),
    allowed_priority_classes=("system-node-critical",),
    allowed_tolerations=(Toleration(key="nvidia.com/gpu", operator="Exists"),),
)
OPERATOR_UID = 65532


def render(raw: dict, ref: CacheRef = REF, policy: Policy = POLICY) -> dict[str, Any]:
    spec = parse_spec(raw)
    return render_daemonset(ref, spec, spec_hash(spec), policy, OPERATOR_UID)


def pod(ds: dict[str, Any]) -> dict[str, Any]:
    return ds["spec"]["template"]["spec"]


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def arg(container: dict[str, Any], flag: str) -> str | None:
    args = container["args"]
    return args[args.index(flag) + 1] if flag in args else None


def test_cpu_daemonset_shape() -> None:
    spec = parse_spec(CPU)
    ds = render(CPU)
    assert ds["kind"] == "DaemonSet"
    # In the daemon namespace, never the cache's: only that one needs `privileged`.
    assert ds["metadata"]["name"] == "weightcache-team.minilm"
    assert ds["metadata"]["namespace"] == "weightcache-system"
    # Owner references cannot cross namespaces: the uid names the cache instead.
    assert "ownerReferences" not in ds["metadata"]
    assert ds["metadata"]["annotations"][names.CACHE_UID_ANNOTATION] == "uid-1"
    selector = ds["spec"]["selector"]["matchLabels"]
    template_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= template_labels.items()
    assert selector[names.CACHE_LABEL] == "minilm"
    assert selector[names.CACHE_NAMESPACE_LABEL] == "team"

    (container,) = pod(ds)["containers"]
    assert container["name"] == "daemon"
    assert container["command"] == ["weightcache-sidecar"]
    assert container["args"][0] == "serve"
    assert arg(container, "--device") == "cpu"
    assert arg(container, "--transport") == "memfd"
    assert arg(container, "--cache") == "team.minilm"
    assert arg(container, "--socket-dir") == CONTAINER_SOCKET_ROOT
    # Only /metrics listens on the pod's network; the probes go over the socket.
    assert arg(container, "--http-address") == "none"
    assert arg(container, "--metrics-address") == "0.0.0.0:8470"
    assert container["ports"] == [{"name": "metrics", "containerPort": 8470, "protocol": "TCP"}]
    assert arg(container, "--allow-gid") == "65533"
    assert "--allow-uid" not in container["args"]
    assert arg(container, "--tp-size") is None
    assert arg(container, "--dtype") is None
    assert arg(container, "--revision") is None
    variables = env(container)
    assert variables["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert variables["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert variables[SPEC_HASH_ENV] == spec_hash(spec)
    assert variables["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert pod(ds)["serviceAccountName"] == "weightcache-daemon"
    assert "NVIDIA_VISIBLE_DEVICES" not in variables
    assert ds["spec"]["template"]["metadata"]["annotations"][names.SPEC_HASH_ANNOTATION] == (
        spec_hash(spec)
    )
    path_file = arg(container, "--socket-path-file")
    assert path_file.startswith("/tmp/")  # the pod's own emptyDir
    assert container["readinessProbe"]["exec"]["command"] == [
        "weightcache-sidecar", "probe", "ready", "--socket-path-file", path_file]
    assert container["livenessProbe"]["exec"]["command"] == [
        "weightcache-sidecar", "probe", "live", "--socket-path-file", path_file]
    for probe in ("readinessProbe", "livenessProbe"):
        assert "httpGet" not in container[probe] and "tcpSocket" not in container[probe]


@pytest.mark.parametrize(("rollout", "max_unavailable"),
                         [({}, 1), ({"maxUnavailable": "10%"}, "10%"), ({"maxUnavailable": 4}, 4)])
def test_rollout_pace_reaches_the_daemonset(rollout: dict, max_unavailable: int | str) -> None:
    strategy = render({**GPU, "rollout": rollout})["spec"]["updateStrategy"]
    assert strategy == {"type": "RollingUpdate",
                        "rollingUpdate": {"maxUnavailable": max_unavailable}}
    # The pace is no part of the pod template: changing it replaces no daemon.
    assert (render({**GPU, "rollout": rollout})["spec"]["template"]
            == render(GPU)["spec"]["template"])


def test_volumes_mount_socket_dir_per_cache_and_model_read_only() -> None:
    ds = render({**CPU, "socketDir": "/var/run/wc/"})
    volumes = {v["name"]: v for v in pod(ds)["volumes"]}
    # Only the admin-allowed root is a hostPath volume: kubelet sets volumes up before the
    # init container creates the cache's directory, which the daemon then reaches by subPath
    # (resolved at container start, refusing symlinks that leave the volume).
    assert "sockets" not in volumes
    assert volumes["socket-root"]["hostPath"] == {
        "path": "/var/run/wc", "type": "DirectoryOrCreate"
    }
    assert volumes["model"]["hostPath"] == {"path": "/models/minilm", "type": "Directory"}
    (container,) = pod(ds)["containers"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["model"]["readOnly"] is True
    assert mounts["socket-root"] == {
        "name": "socket-root",
        "mountPath": f"{CONTAINER_SOCKET_ROOT}/team.minilm",
        "subPath": "team.minilm",
    }
    assert "tmp" in mounts  # the root filesystem is read-only


def test_pvc_model_source() -> None:
    ds = render({**CPU, "model": {"pvc": {"claimName": "store", "subPath": "minilm/v2"}}})
    volumes = {v["name"]: v for v in pod(ds)["volumes"]}
    assert volumes["model"] == {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "store", "readOnly": True},
    }
    mounts = {m["name"]: m for m in pod(ds)["containers"][0]["volumeMounts"]}
    assert mounts["model"]["subPath"] == "minilm/v2"


def test_hardened_pod() -> None:
    for raw in (CPU, GPU):
        spec = pod(render(raw))
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == 65533  # not the operator's 65532
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert "hostPID" not in spec and "hostIPC" not in spec and "hostNetwork" not in spec
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["privileged"] is False
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert "runAsUser" not in sc  # inherits the non-root pod user


def test_socket_dir_set_up_runs_from_the_operators_image_only() -> None:
    """The one root step never runs the image the WeightCache names."""
    ds = render({**CPU, "sidecar": {"image": "attacker.example/evil:1", "runAsUser": 4242}})
    (init,) = pod(ds)["initContainers"]
    assert init["image"] == "operator:1"
    sc = init["securityContext"]
    assert sc["runAsUser"] == 0
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert init["command"] == [
        "python", "-m", "weightcache_operator.socketdir", SETUP_SOCKET_ROOT, "team.minilm",
        "4242", "65533", "uid-1",
    ]
    assert init["volumeMounts"] == [{"name": "socket-root", "mountPath": SETUP_SOCKET_ROOT}]
    for container in pod(ds)["containers"]:
        assert container["image"] == "attacker.example/evil:1"
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert "runAsUser" not in container["securityContext"]
    assert pod(ds)["securityContext"]["runAsNonRoot"] is True


def test_one_container_per_gpu_with_tp_ranks_and_ports() -> None:
    containers = pod(render(GPU))["containers"]
    assert [c["name"] for c in containers] == [f"daemon-{i}" for i in range(8)]
    assert [arg(c, "--device") for c in containers] == [f"cuda:{i}" for i in range(8)]
    assert [arg(c, "--tp-rank") for c in containers] == ["0", "1", "2", "3"] * 2
    assert {arg(c, "--tp-size") for c in containers} == {"4"}
    assert {arg(c, "--shard-plan") for c in containers} == {"llama"}
    ports = [c["ports"][0]["containerPort"] for c in containers]
    assert ports == list(range(8470, 8478))
    files = [arg(c, "--socket-path-file") for c in containers]
    assert len(set(files)) == 8
    assert [c["readinessProbe"]["exec"]["command"][-1] for c in containers] == files
    for c in containers:
        assert env(c)["NVIDIA_VISIBLE_DEVICES"] == "all"
        assert env(c)["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert "nvidia.com/gpu" not in c.get("resources", {}).get("limits", {})


def test_device_plugin_requests_one_gpu_per_container() -> None:
    raw = {
        **GPU,
        "gpuAccess": {"mode": "device-plugin", "resourceName": "nvidia.com/gpu.shared"},
        "sidecar": {"image": "s:1", "resources": {"limits": {"memory": "8Gi"}}},
    }
    for c in pod(render(raw))["containers"]:
        assert arg(c, "--device") == "cuda:0"
        assert c["resources"]["limits"] == {"memory": "8Gi", "nvidia.com/gpu.shared": "1"}
        assert c["resources"]["requests"] == {"nvidia.com/gpu.shared": "1"}
        assert "NVIDIA_VISIBLE_DEVICES" not in env(c)


@pytest.mark.parametrize(
    ("claim", "field"),
    [
        ({"resourceClaimTemplateName": "gpus-template"}, "resourceClaimTemplateName"),
        ({"resourceClaimName": "node-gpus"}, "resourceClaimName"),
    ],
)
def test_dra_claim(claim: dict, field: str) -> None:
    spec = pod(render({**GPU, "gpuAccess": {"mode": "dra", "claim": claim}}))
    assert spec["resourceClaims"] == [{"name": "gpus", field: next(iter(claim.values()))}]
    for c in spec["containers"]:
        assert c["resources"]["claims"] == [{"name": "gpus"}]


def test_torch_ipc_needs_host_pid_and_ipc() -> None:
    spec = pod(render({**GPU, "transport": "torch_ipc"}))
    assert spec["hostPID"] is True and spec["hostIPC"] is True


def test_allowed_peers() -> None:
    raw = {
        **CPU,
        "sidecar": {
            "image": "s:1",
            "runAsGroup": 3000,
            "allowedPeers": {"uids": [1000, 1001], "gids": [44]},
        },
    }
    args = pod(render(raw))["containers"][0]["args"]
    pairs = {(flag, args[i + 1]) for i, flag in enumerate(args) if flag.startswith("--allow")}
    assert pairs == {
        ("--allow-gid", "3000"),
        ("--allow-gid", "44"),
        ("--allow-uid", "1000"),
        ("--allow-uid", "1001"),
    }


def test_dtype_revision_and_placement_pass_through() -> None:
    raw = {
        **GPU,
        "model": {"path": "/m/llama", "dtype": "bfloat16", "revision": "r1"},
        "placement": {
            "nodeSelector": {"pool": "h200"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
            "affinity": {"nodeAffinity": {"x": 1}},
            "priorityClassName": "system-node-critical",
        },
    }
    spec = pod(render(raw))
    assert {arg(c, "--dtype") for c in spec["containers"]} == {"bfloat16"}
    assert {arg(c, "--revision") for c in spec["containers"]} == {"r1"}
    assert spec["nodeSelector"] == {"pool": "h200"}
    assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    assert spec["affinity"] == {"nodeAffinity": {"x": 1}}
    assert spec["priorityClassName"] == "system-node-critical"


def test_default_image_and_missing_image() -> None:
    raw = {k: v for k, v in CPU.items() if k != "sidecar"}
    with_default = msgspec.structs.replace(POLICY, sidecar_image="op-default:7")
    assert pod(render(raw, policy=with_default))["containers"][0]["image"] == "op-default:7"
    assert pod(render(CPU, policy=with_default))["containers"][0]["image"] == "sidecar:1"
    with pytest.raises(RenderError, match="spec.sidecar.image"):
        render(raw)


@pytest.mark.parametrize(
    ("change", "policy", "field"),
    [
        # A socket root the admin did not allow (e.g. inside another cache's directory).
        ({"socketDir": "/var/run/weightcache/other.cache"}, POLICY, "spec.socketDir"),
        ({"socketDir": "/etc"}, POLICY, "spec.socketDir"),
        ({"model": {"path": "/etc"}}, POLICY, "spec.model.path"),
        ({"model": {"path": "/modelsevil/x"}}, POLICY, "spec.model.path"),
        ({"transport": "torch_ipc", "device": "cuda"},
         msgspec.structs.replace(POLICY, allowed_transports=("auto", "vmm_fd")), "spec.transport"),
        ({"sidecar": {"image": "registry.corp.example.evil.io/x:1"}},
         msgspec.structs.replace(POLICY, allowed_sidecar_image_prefixes=("registry.corp.example",)),
         "spec.sidecar.image"),
        ({"sidecar": {"image": "s:1", "runAsUser": OPERATOR_UID}}, POLICY,
         "spec.sidecar.runAsUser"),
        ({}, msgspec.structs.replace(POLICY, setup_image=None), "setup image"),
        ({}, msgspec.structs.replace(POLICY, daemon_namespace=None), "daemon namespace"),
        ({"model": {"pvc": {"claimName": "operator-secrets"}}}, POLICY,
         "spec.model.pvc.claimName"),
        ({"model": {"pvc": {"claimName": "models"}}},
         msgspec.structs.replace(POLICY, allowed_model_claims=("weights",)),
         "spec.model.pvc.claimName: models is not a claim"),
        ({}, Policy(), "spec.socketDir"),
        # Issue 25 item 4: every GPU of the node, seen by an image from anywhere.
        ({"device": "cuda", "transport": "vmm_fd", "gpuAccess": {"mode": "visible-devices"}},
         msgspec.structs.replace(POLICY, allowed_gpu_access_modes=("device-plugin", "dra")),
         "spec.gpuAccess.mode: visible-devices is not allowed"),
        ({"device": "cuda", "transport": "vmm_fd", "gpuAccess": {"mode": "visible-devices"}},
         msgspec.structs.replace(POLICY, allowed_sidecar_image_prefixes=()),
         "spec.gpuAccess.mode: visible-devices shows every GPU"),
        # Issue 34 item 2: a namespace listed in the policy loads only its own sources.
        ({"model": {"path": "/models/minilm"}},
         msgspec.structs.replace(POLICY, namespace_model_sources={
             "team": ModelSources(model_dirs=("/models/team",))}),
         "spec.model.path: /models/minilm is not under a model directory of namespace team's"),
        ({"model": {"pvc": {"claimName": "store"}}},
         msgspec.structs.replace(POLICY, namespace_model_sources={"team": ModelSources()}),
         "spec.model.pvc.claimName: store is not a claim of namespace team's"),
        # Issue 25 item 3: preempting, tolerating and crowding out other tenants' pods.
        ({"placement": {"priorityClassName": "system-cluster-critical"}}, POLICY,
         "spec.placement.priorityClassName: system-cluster-critical is not allowed"),
        ({"placement": {"tolerations": [{"operator": "Exists"}]}}, POLICY,
         r"spec.placement.tolerations\[0\]"),
        ({"placement": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                         "effect": "NoExecute"}]}},
         msgspec.structs.replace(POLICY, allowed_tolerations=(
             Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule"),)),
         r"spec.placement.tolerations\[0\]"),
        ({"sidecar": {"image": "s:1", "resources": {"requests": {"cpu": "16"}}}}, POLICY,
         "spec.sidecar.resources.requests.cpu: 16 is over the cluster's cache policy's 8"),
        ({"sidecar": {"image": "s:1", "resources": {"limits": {"memory": "65Gi"}}}}, POLICY,
         "spec.sidecar.resources.limits.memory: 65Gi is over"),
        ({"sidecar": {"image": "s:1", "resources": {"requests": {"nvidia.com/gpu": "8"}}}},
         POLICY, "spec.sidecar.resources.requests.nvidia.com/gpu: the cluster's cache policy "
         "allows no nvidia.com/gpu"),
    ],
)
def test_policy_violations_are_refused_naming_the_field(
    change: dict, policy: Policy, field: str
) -> None:
    with pytest.raises(PolicyViolation, match=field):
        render({**CPU, **change}, policy=policy)


def test_every_violation_of_one_cache_is_named_at_once() -> None:
    """Issue 34 item 4: users fixed one refused field per apply."""
    bad = {**CPU, "socketDir": "/etc", "model": {"path": "/etc"},
           "sidecar": {"image": "elsewhere.example/x:1", "runAsUser": OPERATOR_UID,
                       "resources": {"requests": {"cpu": "16"}}},
           "placement": {"priorityClassName": "top", "tolerations": [{"operator": "Exists"}]}}
    with pytest.raises(PolicyViolation) as err:
        render(bad)
    fields = [part.split(":")[0] for part in str(err.value).split("; ")]
    assert fields == ["spec.socketDir", "spec.model.path", "spec.placement.priorityClassName",
                      "spec.placement.tolerations[0]", "spec.sidecar.resources.requests.cpu",
                      "spec.sidecar.image", "spec.sidecar.runAsUser"]


def test_visible_devices_is_for_the_charts_own_image_unless_images_are_restricted() -> None:
    gpu = {**GPU, "gpuAccess": {"mode": "visible-devices"}}
    open_images = msgspec.structs.replace(POLICY, allowed_sidecar_image_prefixes=(),
                                          sidecar_image="sidecar:1")
    render(gpu, policy=open_images)  # the chart's own sidecar image
    render({**gpu, "sidecar": {}}, policy=open_images)
    with pytest.raises(PolicyViolation, match="only the chart's own sidecar image"):
        render({**gpu, "sidecar": {"image": "sidecar:2"}}, policy=open_images)
    render({**gpu, "sidecar": {"image": "sidecar:2"}})  # under the allowed prefixes


def test_socket_path_limit() -> None:
    budget = MAX_SOCKET_PATH_BYTES - len(f"{CONTAINER_SOCKET_ROOT}/./") - LONGEST_SOCKET_NAME
    fits = CacheRef("n" * 20, "c" * (budget - 20), "u", 1)
    render(GPU, ref=fits)
    too_long = CacheRef("n" * 20, "c" * (budget - 19), "u", 1)
    with pytest.raises(RenderError, match="107-byte") as err:
        render(GPU, ref=too_long)
    assert f"at most {budget} characters" in str(err.value)


def test_render_hash_tracks_content_not_bookkeeping() -> None:
    ds = render(CPU)
    stamped = ds["metadata"]["annotations"][names.RENDER_HASH_ANNOTATION]
    assert stamped == render_hash(ds)
    later = render(CPU, ref=CacheRef("team", "minilm", "uid-1", generation=4))
    assert later["metadata"]["annotations"][names.GENERATION_ANNOTATION] == "4"
    assert later["metadata"]["annotations"][names.RENDER_HASH_ANNOTATION] == stamped
    changed = render({**CPU, "sidecar": {"image": "sidecar:2"}})
    assert changed["metadata"]["annotations"][names.RENDER_HASH_ANNOTATION] != stamped
    assert render(CPU) == ds


@pytest.mark.parametrize("raw", [CPU, GPU, {**GPU, "gpuAccess": {"mode": "device-plugin"},
                                            "sidecar": {"image": "s:1",
                                                        "allowedPeers": {"uids": [1000]}}}])
def test_the_daemon_cli_accepts_what_is_rendered(raw: dict) -> None:
    """The arguments parse with the daemon's own parser, and mean what the spec says."""
    from weightcache.daemon.cli import build_parser
    from weightcache.daemon.probe import build_parser as probe_parser

    for container in pod(render(raw))["containers"]:
        assert container["command"] == ["weightcache-sidecar"]
        args = build_parser().parse_args(container["args"])
        assert args.command == "serve"
        assert args.cache == ("team", "minilm")
        assert args.socket_dir == CONTAINER_SOCKET_ROOT
        assert str(args.model) == "/weightcache/model"
        assert args.http_address is None
        assert args.metrics_address[1] == container["ports"][0]["containerPort"]
        for probe in ("readinessProbe", "livenessProbe"):
            command = container[probe]["exec"]["command"]
            assert command[:2] == ["weightcache-sidecar", "probe"]
            probe_args = probe_parser().parse_args(command[2:])
            assert probe_args.socket_path_file == args.socket_path_file


@pytest.mark.parametrize(("strategy", "update", "flag"), [
    ("Auto", "RollingUpdate", None),  # the daemon's default: wait for room beside kept ones
    ("Surge", "RollingUpdate", "surge"),
    ("NodeByNode", "OnDelete", "surge"),  # room was made first; an unbound engine holds none
])
def test_the_strategy_reaches_the_daemonset_and_the_daemons(
    strategy: str, update: str, flag: str | None
) -> None:
    ds = render({**GPU, "rollout": {"strategy": strategy}})
    assert ds["spec"]["updateStrategy"]["type"] == update
    args = ds["spec"]["template"]["spec"]["containers"][0]["args"]
    assert (args[args.index("--rollout") + 1] if "--rollout" in args else None) == flag
