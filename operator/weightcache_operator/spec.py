"""Parse and validate a WeightCache spec into typed values; compute its hash.

The CRD schema already rejects most bad input at the apiserver. This module
checks the same rules again (an older CRD may be installed, or the operator may
be handed a raw dict in tests) and applies the same defaults, so everything
downstream works on complete, valid values.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

TRANSPORTS = ("auto", "vmm_fd", "torch_ipc", "memfd")
DEVICES = ("cuda", "cpu")
SHARD_PLANS = ("llama",)
DTYPES = ("auto", "float32", "float16", "bfloat16")
GPU_ACCESS_MODES = ("visible-devices", "device-plugin", "dra")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")

DEFAULT_SOCKET_DIR = "/var/run/weightcache"
DEFAULT_HTTP_PORT = 8470
DEFAULT_RUN_AS = 65532
DEFAULT_SERVICE_ACCOUNT = "weightcache-daemon"
DEFAULT_RESOURCE_NAME = "nvidia.com/gpu"
DEFAULT_BYTE_TOLERANCE = 0.01
MAX_GPUS_PER_NODE = 64
MAX_PEER_IDS = 64

# The same patterns the CRD uses, so both layers reject the same strings.
ABS_PATH_RE = re.compile(r"^(/[A-Za-z0-9._@+=,:~-]+)+/?$")
REL_PATH_RE = re.compile(r"^[A-Za-z0-9._@+=,:~-]+(/[A-Za-z0-9._@+=,:~-]+)*/?$")
DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
QUANTITY_RE = re.compile(
    r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
RESOURCE_NAME_RE = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)


class SpecError(ValueError):
    """The spec is invalid; the message names the field."""


@dataclass(frozen=True)
class PvcSource:
    claim_name: str
    sub_path: str | None = None


@dataclass(frozen=True)
class ModelSpec:
    path: str | None
    pvc: PvcSource | None
    revision: str | None
    dtype: str


@dataclass(frozen=True)
class GpuSpec:
    per_node: int = 1
    tp_size: int = 1
    # How each rank's shard is cut from the checkpoint (weightcache.shard); tp_size > 1 only.
    shard_plan: str | None = None


@dataclass(frozen=True)
class GpuAccess:
    mode: str = "visible-devices"
    resource_name: str = DEFAULT_RESOURCE_NAME
    claim_name: str | None = None
    claim_template_name: str | None = None


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: str
    values: tuple[str, ...] = ()


@dataclass(frozen=True)
class LabelSelector:
    match_labels: tuple[tuple[str, str], ...] = ()
    match_expressions: tuple[Requirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Kubernetes semantics; an empty selector matches every pod."""
        for key, value in self.match_labels:
            if labels.get(key) != value:
                return False
        for req in self.match_expressions:
            present = req.key in labels
            if req.operator == "In" and not (present and labels[req.key] in req.values):
                return False
            if req.operator == "NotIn" and present and labels[req.key] in req.values:
                return False
            if req.operator == "Exists" and not present:
                return False
            if req.operator == "DoesNotExist" and present:
                return False
        return True


@dataclass(frozen=True)
class Placement:
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] | None = None
    priority_class_name: str | None = None


@dataclass(frozen=True)
class SidecarSpec:
    image: str | None = None
    image_pull_policy: str | None = None
    requests: Mapping[str, str] = field(default_factory=dict)
    limits: Mapping[str, str] = field(default_factory=dict)
    http_port: int = DEFAULT_HTTP_PORT
    run_as_user: int = DEFAULT_RUN_AS
    run_as_group: int = DEFAULT_RUN_AS
    service_account_name: str = DEFAULT_SERVICE_ACCOUNT
    # Peers the daemon serves besides its own uid and runAsGroup (SO_PEERCRED).
    peer_uids: tuple[int, ...] = ()
    peer_gids: tuple[int, ...] = ()


@dataclass(frozen=True)
class EngineSpec:
    selector: LabelSelector | None = None
    byte_tolerance: float = DEFAULT_BYTE_TOLERANCE
    expected_bytes: int | None = None


@dataclass(frozen=True)
class WeightCacheSpec:
    model: ModelSpec
    device: str = "cuda"
    gpus: GpuSpec = GpuSpec()
    transport: str = "auto"
    gpu_access: GpuAccess = GpuAccess()
    socket_dir: str = DEFAULT_SOCKET_DIR
    placement: Placement = Placement()
    sidecar: SidecarSpec = SidecarSpec()
    engine: EngineSpec = EngineSpec()

    @property
    def slots(self) -> int:
        """Daemon processes per node: one per GPU, or one on a CPU node."""
        return 1 if self.device == "cpu" else self.gpus.per_node


def parse_spec(raw: Any) -> WeightCacheSpec:
    """Typed, defaulted spec; `SpecError` names the first invalid field."""
    spec = _obj(raw, "spec")
    device = _enum(spec, "device", "spec", DEVICES, "cuda")
    transport = _enum(spec, "transport", "spec", TRANSPORTS, "auto")
    if device == "cpu" and transport not in ("auto", "memfd"):
        raise SpecError(f"spec.transport: {transport!r} needs a GPU; a cpu cache uses memfd")
    if device == "cuda" and transport == "memfd":
        raise SpecError("spec.transport: memfd holds CPU memory; use it with spec.device: cpu")
    gpus = _gpus(spec)
    if device == "cpu" and gpus != GpuSpec():
        raise SpecError(
            "spec.gpus: a cpu cache runs one daemon per node; perNode and tpSize must be 1"
        )
    return WeightCacheSpec(
        model=_model(spec),
        device=device,
        gpus=gpus,
        transport=transport,
        gpu_access=_gpu_access(spec),
        socket_dir=_path(spec, "socketDir", "spec", DEFAULT_SOCKET_DIR, ABS_PATH_RE),
        placement=_placement(spec),
        sidecar=_sidecar(spec),
        engine=_engine(spec),
    )


def spec_hash(spec: WeightCacheSpec) -> str:
    """SHA-256 over the parts that decide which bytes the daemons hold.

    Gate parameters (tolerance, selector) and pod plumbing (image, resources)
    are left out on purpose: changing them must not make resident weights stale.
    """
    m = spec.model
    identity = {
        "model": {
            "path": m.path,
            "pvc": m.pvc and {"claimName": m.pvc.claim_name, "subPath": m.pvc.sub_path},
            "revision": m.revision,
            "dtype": m.dtype,
        },
        "device": spec.device,
        # shardPlan only when set, so caches without one keep their hash.
        "gpus": {"perNode": spec.gpus.per_node, "tpSize": spec.gpus.tp_size}
        | ({"shardPlan": spec.gpus.shard_plan} if spec.gpus.shard_plan else {}),
        "transport": spec.transport,
    }
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


# ----------------------------------------------------------------------------- helpers


def _obj(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(f"{where}: must be an object, got {type(value).__name__}")
    return value


def _child(parent: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    return _obj(parent.get(key), f"{where}.{key}")


def _str(
    parent: Mapping[str, Any], key: str, where: str, default: str | None = None, max_len: int = 4096
) -> str | None:
    value = parent.get(key, default)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise SpecError(f"{where}.{key}: must be a non-empty string, got {value!r}")
    if len(value) > max_len:
        raise SpecError(f"{where}.{key}: longer than {max_len} characters")
    return value


def _enum(
    parent: Mapping[str, Any], key: str, where: str, allowed: tuple[str, ...], default: str
) -> str:
    value = parent.get(key, default)
    if value not in allowed:
        raise SpecError(f"{where}.{key}: must be one of {', '.join(allowed)}; got {value!r}")
    return value


def _int(
    parent: Mapping[str, Any],
    key: str,
    where: str,
    default: int | None,
    lo: int,
    hi: int | None = None,
) -> int | None:
    value = parent.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{where}.{key}: must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise SpecError(f"{where}.{key}: must be {bound}, got {value}")
    return value


def _path(
    parent: Mapping[str, Any], key: str, where: str, default: str | None, pattern: re.Pattern[str]
) -> str | None:
    value = _str(parent, key, where, default)
    if value is None:
        return None
    kind = "an absolute" if pattern is ABS_PATH_RE else "a relative"
    if not pattern.match(value) or ".." in value.split("/"):
        raise SpecError(f"{where}.{key}: must be {kind} path without '..' segments, got {value!r}")
    return value


def _name(
    parent: Mapping[str, Any],
    key: str,
    where: str,
    default: str | None = None,
    pattern: re.Pattern[str] = DNS_SUBDOMAIN_RE,
) -> str | None:
    value = _str(parent, key, where, default, max_len=253)
    if value is not None and not pattern.match(value):
        raise SpecError(f"{where}.{key}: {value!r} is not a valid Kubernetes name")
    return value


def _model(spec: Mapping[str, Any]) -> ModelSpec:
    if "model" not in spec:
        raise SpecError("spec.model: required")
    model = _child(spec, "model", "spec")
    path = _path(model, "path", "spec.model", None, ABS_PATH_RE)
    pvc = None
    if model.get("pvc") is not None:
        raw_pvc = _child(model, "pvc", "spec.model")
        claim = _name(raw_pvc, "claimName", "spec.model.pvc")
        if claim is None:
            raise SpecError("spec.model.pvc.claimName: required")
        pvc = PvcSource(claim, _path(raw_pvc, "subPath", "spec.model.pvc", None, REL_PATH_RE))
    if (path is None) == (pvc is None):
        raise SpecError("spec.model: set exactly one of path or pvc")
    return ModelSpec(
        path=path,
        pvc=pvc,
        revision=_str(model, "revision", "spec.model", max_len=256),
        dtype=_enum(model, "dtype", "spec.model", DTYPES, "auto"),
    )


def _gpus(spec: Mapping[str, Any]) -> GpuSpec:
    gpus = _child(spec, "gpus", "spec")
    per_node = _int(gpus, "perNode", "spec.gpus", 1, 1, MAX_GPUS_PER_NODE)
    tp_size = _int(gpus, "tpSize", "spec.gpus", 1, 1, MAX_GPUS_PER_NODE)
    assert per_node is not None and tp_size is not None
    if per_node % tp_size:
        raise SpecError(
            f"spec.gpus.perNode: {per_node} is not a multiple of spec.gpus.tpSize {tp_size}"
        )
    plan = gpus.get("shardPlan")
    if plan is not None and plan not in SHARD_PLANS:
        allowed = ", ".join(SHARD_PLANS)
        raise SpecError(f"spec.gpus.shardPlan: must be one of {allowed}; got {plan!r}")
    if tp_size > 1 and plan is None:
        raise SpecError("spec.gpus.shardPlan: required when spec.gpus.tpSize > 1")
    return GpuSpec(per_node, tp_size, plan)


def _gpu_access(spec: Mapping[str, Any]) -> GpuAccess:
    access = _child(spec, "gpuAccess", "spec")
    where = "spec.gpuAccess"
    mode = _enum(access, "mode", where, GPU_ACCESS_MODES, "visible-devices")
    resource = _str(access, "resourceName", where, DEFAULT_RESOURCE_NAME, max_len=253)
    assert resource is not None
    if not RESOURCE_NAME_RE.match(resource):
        raise SpecError(f"{where}.resourceName: {resource!r} is not a resource name")
    claim = _child(access, "claim", where)
    claim_name = _name(claim, "resourceClaimName", f"{where}.claim")
    template = _name(claim, "resourceClaimTemplateName", f"{where}.claim")
    if mode == "dra" and (claim_name is None) == (template is None):
        raise SpecError(
            f"{where}.claim: mode dra needs exactly one of resourceClaimName or "
            "resourceClaimTemplateName"
        )
    return GpuAccess(mode, resource, claim_name, template)


def _quantities(parent: Mapping[str, Any], key: str, where: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in _child(parent, key, where).items():
        text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
        if not isinstance(text, str) or not QUANTITY_RE.match(text):
            raise SpecError(f"{where}.{key}.{name}: {value!r} is not a quantity (e.g. 500m, 2Gi)")
        if not RESOURCE_NAME_RE.match(name):
            raise SpecError(f"{where}.{key}: {name!r} is not a resource name")
        out[name] = text
    return out


def _placement(spec: Mapping[str, Any]) -> Placement:
    place = _child(spec, "placement", "spec")
    where = "spec.placement"
    node_selector = dict(_child(place, "nodeSelector", where))
    for key, value in node_selector.items():
        if not isinstance(value, str):
            raise SpecError(f"{where}.nodeSelector.{key}: must be a string, got {value!r}")
    tolerations = place.get("tolerations") or []
    if not isinstance(tolerations, list) or not all(isinstance(t, Mapping) for t in tolerations):
        raise SpecError(f"{where}.tolerations: must be a list of objects")
    affinity = place.get("affinity")
    if affinity is not None and not isinstance(affinity, Mapping):
        raise SpecError(f"{where}.affinity: must be an object")
    return Placement(
        node_selector=node_selector,
        tolerations=tuple(dict(t) for t in tolerations),
        affinity=None if affinity is None else dict(affinity),
        priority_class_name=_name(place, "priorityClassName", where),
    )


def _sidecar(spec: Mapping[str, Any]) -> SidecarSpec:
    side = _child(spec, "sidecar", "spec")
    where = "spec.sidecar"
    resources = _child(side, "resources", where)
    policy = side.get("imagePullPolicy")
    if policy is not None and policy not in PULL_POLICIES:
        raise SpecError(f"{where}.imagePullPolicy: must be one of {', '.join(PULL_POLICIES)}")
    port = _int(side, "httpPort", where, DEFAULT_HTTP_PORT, 1024, 65535 - MAX_GPUS_PER_NODE)
    user = _int(side, "runAsUser", where, DEFAULT_RUN_AS, 1)
    group = _int(side, "runAsGroup", where, DEFAULT_RUN_AS, 1)
    account = _name(side, "serviceAccountName", where, DEFAULT_SERVICE_ACCOUNT)
    assert port is not None and user is not None and group is not None and account is not None
    peers = _child(side, "allowedPeers", where)
    return SidecarSpec(
        image=_str(side, "image", where, max_len=1024),
        image_pull_policy=policy,
        requests=_quantities(resources, "requests", f"{where}.resources"),
        limits=_quantities(resources, "limits", f"{where}.resources"),
        http_port=port,
        run_as_user=user,
        run_as_group=group,
        service_account_name=account,
        peer_uids=_ids(peers, "uids", f"{where}.allowedPeers"),
        peer_gids=_ids(peers, "gids", f"{where}.allowedPeers"),
    )


def _ids(parent: Mapping[str, Any], key: str, where: str) -> tuple[int, ...]:
    values = parent.get(key) or []
    if (
        not isinstance(values, list)
        or len(values) > MAX_PEER_IDS
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)
    ):
        raise SpecError(
            f"{where}.{key}: must be a list of at most {MAX_PEER_IDS} non-negative integers"
        )
    return tuple(sorted(set(values)))


def _selector(raw: Any, where: str) -> LabelSelector:
    sel = _obj(raw, where)
    labels = _obj(sel.get("matchLabels"), f"{where}.matchLabels")
    for key, value in labels.items():
        if not isinstance(value, str):
            raise SpecError(f"{where}.matchLabels.{key}: must be a string, got {value!r}")
    exprs = sel.get("matchExpressions") or []
    if not isinstance(exprs, list):
        raise SpecError(f"{where}.matchExpressions: must be a list")
    reqs = []
    for i, raw_expr in enumerate(exprs):
        at = f"{where}.matchExpressions[{i}]"
        expr = _obj(raw_expr, at)
        key = _str(expr, "key", at, max_len=317)
        if key is None:
            raise SpecError(f"{at}.key: required")
        op = _enum(expr, "operator", at, SELECTOR_OPERATORS, "")
        values = expr.get("values") or []
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise SpecError(f"{at}.values: must be a list of strings")
        if op in ("In", "NotIn") and not values:
            raise SpecError(f"{at}.values: operator {op} needs at least one value")
        if op in ("Exists", "DoesNotExist") and values:
            raise SpecError(f"{at}.values: operator {op} takes no values")
        reqs.append(Requirement(key, op, tuple(values)))
    return LabelSelector(tuple(sorted(labels.items())), tuple(reqs))


def _engine(spec: Mapping[str, Any]) -> EngineSpec:
    engine = _child(spec, "engine", "spec")
    where = "spec.engine"
    tolerance = engine.get("byteTolerance", DEFAULT_BYTE_TOLERANCE)
    if (
        isinstance(tolerance, bool)
        or not isinstance(tolerance, (int, float))
        or not (0 <= tolerance < 1)
    ):
        raise SpecError(f"{where}.byteTolerance: must be a number in [0, 1), got {tolerance!r}")
    selector = engine.get("selector")
    return EngineSpec(
        selector=None if selector is None else _selector(selector, f"{where}.selector"),
        byte_tolerance=float(tolerance),
        expected_bytes=_int(engine, "expectedBytes", where, None, 1),
    )
