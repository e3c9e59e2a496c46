"""What a WeightCache may ask of a node, as the cluster admin configured it.

A WeightCache makes the operator run a DaemonSet with hostPath mounts from the
image the cache names, so its author could otherwise reach any host directory.
The chart's `cachePolicy` values are the single source: the chart enforces
them at admission (a ValidatingAdmissionPolicy on WeightCaches) and hands the
same values to the operator as JSON in `WEIGHTCACHE_POLICY`, so the operator
refuses to render what the policy forbids even for a cache admitted before the
policy changed, or in a cluster without the admission policy.

Without `WEIGHTCACHE_POLICY` nothing is allowed: no socket directory, no model
directory, so the operator renders nothing until an admin says what is.

Model sources are per namespace: a namespace the policy lists
(`namespaceModelSources`) may use only the model directories and claims its
entry names; any other namespace gets the cluster default
(`allowedHostPaths.modelDirs`, `allowedModelClaims`). A cache loads, and its
engines map, whatever its model source holds, so this decides who can read
which weights.

Every violation of one spec is reported at once, each naming its field.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from decimal import Decimal
from typing import Annotated, Any, Literal

import msgspec

from .spec import DNS_LABEL_RE, GPU_ACCESS_MODES, QUANTITY_RE, TRANSPORTS, WeightCacheSpec

POLICY_ENV = "WEIGHTCACHE_POLICY"

AbsPath = Annotated[str, msgspec.Meta(pattern=r"^(/[A-Za-z0-9._@+=,:~-]+)+/?$")]
Image = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]


class PolicyError(ValueError):
    """The WeightCache asks for something the cache policy forbids; names the field."""


class HostPaths(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
    # spec.socketDir must be one of these exactly: each cache gets <dir>/<ns>.<name>,
    # a name no other cache can take, so no cache can plant a symlink in another's path.
    socket_dirs: tuple[AbsPath, ...] = ()
    # spec.model.path must be one of these or lie below one (mounted read-only).
    model_dirs: tuple[AbsPath, ...] = ()


class ModelSources(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
    """What one namespace's caches may load: host directories (the model path must be one
    or lie below one) and PersistentVolumeClaims of the daemon namespace."""

    model_dirs: tuple[AbsPath, ...] = ()
    model_claims: tuple[str, ...] = ()


class Toleration(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
    """A toleration a cache may give its daemon pods; `tolerationSeconds` is not compared."""

    key: str = ""
    operator: Literal["Equal", "Exists"] = "Equal"
    value: str = ""
    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] = ""

    @classmethod
    def of(cls, raw: Mapping[str, Any]) -> Toleration:
        return cls(str(raw.get("key") or ""), raw.get("operator") or "Equal",
                   str(raw.get("value") or ""), raw.get("effect") or "")


# GPU nodes are commonly tainted so that only GPU workloads land there; daemons are one.
GPU_TAINT = Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")


class Policy(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
    # The operator's own image: the only image that runs a privileged step (the
    # socket directory's chown), never the one a WeightCache names.
    setup_image: Image | None = None
    # The daemon image for caches that set no spec.sidecar.image.
    sidecar_image: Image | None = None
    # Daemons run under this ServiceAccount only (the chart creates it); the
    # chart's report guard covers exactly this identity.
    daemon_service_account: str = "weightcache-daemon"
    # Every cache's DaemonSet runs here (the chart's namespace, the only one that
    # needs Pod Security `privileged`), never in the cache's own namespace.
    daemon_namespace: str | None = None
    # A PVC model (spec.model.pvc.claimName) and a DRA claim (spec.gpuAccess.claim) are
    # looked up in the daemon namespace: a cache may name only these. The model claims
    # (and allowed_host_paths.model_dirs) are the default of namespaces that
    # namespace_model_sources does not list.
    allowed_model_claims: tuple[str, ...] = ()
    allowed_resource_claims: tuple[str, ...] = ()
    allowed_host_paths: HostPaths = HostPaths()
    # Per namespace, in place of the default: the only model directories and claims its
    # caches may load (and so the only weights their engines can read).
    namespace_model_sources: dict[str, ModelSources] = msgspec.field(default_factory=dict)
    # Empty: any image.
    allowed_sidecar_image_prefixes: tuple[Image, ...] = ()
    allowed_transports: tuple[str, ...] = TRANSPORTS
    # A daemon pod runs at no priority class but these: one could preempt others' pods.
    allowed_priority_classes: tuple[str, ...] = ()
    # Each of spec.placement.tolerations must be one of these: `operator: Exists` with no
    # key would put daemons on every tainted node.
    allowed_tolerations: tuple[Toleration, ...] = (GPU_TAINT,)
    # Per daemon container: every resource spec.sidecar.resources names must be listed
    # here, its request and limit at most this quantity.
    max_sidecar_resources: dict[str, str] = msgspec.field(
        default_factory=lambda: {"cpu": "8", "memory": "64Gi"})
    # How a GPU cache's daemons may see GPUs. visible-devices (every GPU of the node, no
    # request) is for the sidecar image above, or images under allowed prefixes.
    allowed_gpu_access_modes: tuple[str, ...] = GPU_ACCESS_MODES

    def model_sources(self, namespace: str) -> tuple[ModelSources, str]:
        """The model sources of `namespace`'s caches, and whose they are (for messages)."""
        listed = self.namespace_model_sources.get(namespace)
        if listed is not None:
            return listed, f"namespace {namespace}'s"
        default = ModelSources(self.allowed_host_paths.model_dirs, self.allowed_model_claims)
        return default, "the cluster's default"


def policy_from_env(env: Mapping[str, str] = os.environ) -> Policy:
    """The policy in `WEIGHTCACHE_POLICY`; `PolicyError` names what is malformed."""
    raw = env.get(POLICY_ENV)
    if not raw:
        return Policy()
    try:
        policy = msgspec.json.decode(raw, type=Policy)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise PolicyError(f"{POLICY_ENV}: {exc}") from None
    unknown = set(policy.allowed_transports) - set(TRANSPORTS)
    if unknown:
        raise PolicyError(f"{POLICY_ENV}: unknown transports {sorted(unknown)}")
    unknown = set(policy.allowed_gpu_access_modes) - set(GPU_ACCESS_MODES)
    if unknown:
        raise PolicyError(f"{POLICY_ENV}: unknown GPU access modes {sorted(unknown)}")
    for name, cap in policy.max_sidecar_resources.items():
        if not QUANTITY_RE.match(cap):
            raise PolicyError(f"{POLICY_ENV}: maxSidecarResources.{name}: {cap!r} is no quantity")
    for namespace in policy.namespace_model_sources:
        if not (len(namespace) <= 63 and DNS_LABEL_RE.match(namespace)):
            raise PolicyError(f"{POLICY_ENV}: namespaceModelSources: {namespace!r} is not a "
                              "namespace name")
    return policy


_SUFFIXES = {"": 1, "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
             "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def quantity(value: str | int) -> Decimal:
    """A Kubernetes quantity's value (`500m`, `2Gi`, `1e3`, `8`); ValueError if it is none."""
    text = str(value)
    if isinstance(value, bool) or not QUANTITY_RE.match(text):
        raise ValueError(f"{value!r} is not a quantity")
    number = text.rstrip("KMGTPEikmnu")
    suffix = text[len(number):]
    if suffix in _SUFFIXES:
        return Decimal(number) * _SUFFIXES[suffix]
    return Decimal(text)  # an exponent: 1e3


def _norm(path: str) -> str:
    return path.rstrip("/") or "/"


def path_within(path: str, directories: tuple[str, ...]) -> bool:
    """`path` is one of `directories` or below one, compared by whole path segments."""
    path = _norm(path)
    for directory in map(_norm, directories):
        if path == directory or path.startswith(directory.rstrip("/") + "/"):
            return True
    return False


def image_allowed(image: str, prefixes: tuple[str, ...]) -> bool:
    """Whether `image` is under one of `prefixes` at a registry/path boundary.

    `registry.corp.example` admits `registry.corp.example/x:1` but not
    `registry.corp.example.evil.io/x:1`, nor `registry.corp.example:5000/x`
    (another registry, on another port: what follows a `:` is a tag only
    without a `/`); a prefix ending in `/` admits what is below it; a full
    repository admits its tags and digests.
    """
    if not prefixes:
        return True
    for prefix in prefixes:
        if prefix.endswith("/"):
            if image.startswith(prefix):
                return True
        elif image == prefix or image.startswith((prefix + "/", prefix + "@")):
            return True
        elif image.startswith(prefix + ":") and "/" not in image[len(prefix) + 1:]:
            return True
    return False


def check_spec(spec: WeightCacheSpec, policy: Policy, operator_uid: int, namespace: str
               ) -> str:
    """The daemon image to run; `PolicyError` names every field the policy forbids, at once
    (one message, `; ` between them and in no message), so that a user fixes them in one
    go."""
    problems = violations(spec, policy, operator_uid, namespace)
    if problems:
        raise PolicyError("; ".join(problems))
    image = spec.sidecar.image or policy.sidecar_image
    assert image is not None  # violations() names an unset one
    return image


def violations(spec: WeightCacheSpec, policy: Policy, operator_uid: int, namespace: str
               ) -> list[str]:
    """What a cache of `namespace` with `spec` asks for that the policy forbids, each naming
    its field; empty when it may run (pure)."""
    problems: list[str] = []
    if spec.transport not in policy.allowed_transports:
        problems.append(
            f"spec.transport: {spec.transport} is not allowed by the cluster's cache policy "
            f"(allowed: {', '.join(policy.allowed_transports)})"
        )
    sockets = policy.allowed_host_paths.socket_dirs
    if _norm(spec.socket_dir) not in {_norm(d) for d in sockets}:
        allowed = ", ".join(sockets) or "none (set cachePolicy.allowedHostPaths.socketDirs)"
        problems.append(
            f"spec.socketDir: {spec.socket_dir} is not a socket directory the cluster's cache "
            f"policy allows (allowed: {allowed})"
        )
    problems += _model_violations(spec, policy, namespace)
    claim = spec.gpu_access.claim
    if spec.device == "cuda" and spec.gpu_access.mode == "dra":
        named = claim.resource_claim_name or claim.resource_claim_template_name
        if named not in policy.allowed_resource_claims:
            allowed = ", ".join(policy.allowed_resource_claims) or "none"
            problems.append(
                f"spec.gpuAccess.claim: {named} is not a resource claim (or template) the "
                f"cluster's cache policy allows in the daemon namespace (allowed: {allowed})"
            )
    image = spec.sidecar.image or policy.sidecar_image
    if spec.device == "cuda":
        mode = spec.gpu_access.mode
        if mode not in policy.allowed_gpu_access_modes:
            problems.append(
                f"spec.gpuAccess.mode: {mode} is not allowed by the cluster's cache policy "
                f"(allowed: {', '.join(policy.allowed_gpu_access_modes) or 'none'})"
            )
        elif (mode == "visible-devices" and not policy.allowed_sidecar_image_prefixes
              and image != policy.sidecar_image):
            problems.append(
                f"spec.gpuAccess.mode: visible-devices shows every GPU of the node to the "
                f"daemon image, so only the chart's own sidecar image ({policy.sidecar_image}) "
                "may use it, unless the cluster's cache policy restricts images "
                "(cachePolicy.allowedSidecarImagePrefixes)"
            )
    problems += _placement_violations(spec, policy)
    problems += _resource_violations(spec, policy)
    if not image:
        problems.append(
            "spec.sidecar.image: unset, and the operator has no default sidecar image "
            f"({POLICY_ENV} sidecarImage)"
        )
    elif not image_allowed(image, policy.allowed_sidecar_image_prefixes):
        problems.append(
            f"spec.sidecar.image: {image} is not allowed by the cluster's cache policy: it must "
            f"be under one of: {', '.join(policy.allowed_sidecar_image_prefixes)}"
        )
    # With torch_ipc's hostPID a daemon of the operator's uid could read the
    # operator's token through /proc; no daemon gets that uid.
    if spec.sidecar.run_as_user == operator_uid:
        problems.append(
            f"spec.sidecar.runAsUser: {operator_uid} is the operator's own uid, choose another"
        )
    if not policy.daemon_namespace:
        problems.append(
            f"the operator has no daemon namespace ({POLICY_ENV} daemonNamespace) to run "
            "the cache's daemons in"
        )
    if not policy.setup_image:
        problems.append(
            f"the operator has no setup image ({POLICY_ENV} setupImage) to prepare "
            "spec.socketDir with"
        )
    return problems


def _model_violations(spec: WeightCacheSpec, policy: Policy, namespace: str) -> list[str]:
    sources, whose = policy.model_sources(namespace)
    problems = []
    if spec.model.path is not None and not path_within(spec.model.path, sources.model_dirs):
        allowed = ", ".join(sources.model_dirs) or "none"
        problems.append(
            f"spec.model.path: {spec.model.path} is not under a model directory of "
            f"{whose} model sources in the cluster's cache policy (allowed: {allowed}), "
            "or use spec.model.pvc"
        )
    pvc = spec.model.pvc
    if pvc is not None and pvc.claim_name not in sources.model_claims:
        allowed = ", ".join(sources.model_claims) or "none"
        problems.append(
            f"spec.model.pvc.claimName: {pvc.claim_name} is not a claim of {whose} model "
            f"sources in the cluster's cache policy (allowed in the daemon namespace: "
            f"{allowed})"
        )
    return problems


def _placement_violations(spec: WeightCacheSpec, policy: Policy) -> list[str]:
    problems = []
    priority = spec.placement.priority_class_name
    if priority is not None and priority not in policy.allowed_priority_classes:
        problems.append(
            f"spec.placement.priorityClassName: {priority} is not allowed by the cluster's cache "
            f"policy (allowed: {', '.join(policy.allowed_priority_classes) or 'none'})"
        )
    for i, raw in enumerate(spec.placement.tolerations):
        try:
            toleration = Toleration.of(raw)
        except (TypeError, ValueError):
            toleration = None
        if toleration is None or toleration not in policy.allowed_tolerations:
            allowed = ", ".join(_describe(t) for t in policy.allowed_tolerations) or "none"
            problems.append(
                f"spec.placement.tolerations[{i}]: {dict(raw)} is not a toleration the cluster's "
                f"cache policy allows (allowed: {allowed})"
            )
    return problems


def _describe(t: Toleration) -> str:
    value = f"={t.value}" if t.operator == "Equal" else ""
    return f"{t.key or '<any key>'} {t.operator}{value}:{t.effect or '<any effect>'}"


def _resource_violations(spec: WeightCacheSpec, policy: Policy) -> list[str]:
    caps = policy.max_sidecar_resources
    problems = []
    for kind, quantities in (("requests", spec.sidecar.resources.requests),
                             ("limits", spec.sidecar.resources.limits)):
        for name, value in sorted(quantities.items()):
            where = f"spec.sidecar.resources.{kind}.{name}"
            if name not in caps:
                problems.append(
                    f"{where}: the cluster's cache policy allows no {name} for a daemon "
                    f"(allowed: {', '.join(sorted(caps)) or 'none'})"
                )
            elif quantity(value) > quantity(caps[name]):
                problems.append(
                    f"{where}: {value} is over the cluster's cache policy's {caps[name]} per "
                    "daemon container"
                )
    return problems
