"""A WeightCache spec as typed values, and its hash.

The structs mirror the CRD (crds/weightcache.dev_weightcaches.yaml): field
names, types, enums, bounds, patterns and defaults are declared once here as
msgspec constraints, so decoding alone rejects what the CRD's schema rejects.
`cross_field_errors` holds the rules that span fields (the CRD's CEL rules).
The operator parses again what the apiserver already admitted because an older
CRD may be installed, and tests hand it raw dicts: both layers refuse the same
input, with the field named (tests/unit/operator/test_crd.py keeps them equal).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal, get_args

import msgspec

Transport = Literal["auto", "vmm_fd", "torch_ipc", "memfd"]
Device = Literal["cuda", "cpu"]
ShardPlan = Literal["llama"]
Dtype = Literal["auto", "float32", "float16", "bfloat16"]
GpuAccessMode = Literal["visible-devices", "device-plugin", "dra"]
PullPolicy = Literal["Always", "IfNotPresent", "Never"]
SelectorOperator = Literal["In", "NotIn", "Exists", "DoesNotExist"]
RolloutStrategy = Literal["Auto", "Surge", "NodeByNode"]
TRANSPORTS: tuple[str, ...] = get_args(Transport)
DEVICES: tuple[str, ...] = get_args(Device)
DTYPES: tuple[str, ...] = get_args(Dtype)
GPU_ACCESS_MODES: tuple[str, ...] = get_args(GpuAccessMode)
ROLLOUT_STRATEGIES: tuple[str, ...] = get_args(RolloutStrategy)

DEFAULT_SOCKET_DIR = "/var/run/weightcache"
DEFAULT_HTTP_PORT = 8470
# Daemons get a uid of their own: not the operator's (65532), not the engines'.
DEFAULT_RUN_AS = 65533
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
# A DaemonSet's maxUnavailable as a percentage; a count is an int >= 1.
PERCENT_RE = re.compile(r"^([1-9][0-9]?|100)%$")
MAX_INT32 = 2**31 - 1
RESOURCE_NAME_RE = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)

AbsPath = Annotated[str, msgspec.Meta(max_length=4096, pattern=ABS_PATH_RE.pattern)]
RelPath = Annotated[str, msgspec.Meta(max_length=4096, pattern=REL_PATH_RE.pattern)]
Name = Annotated[str, msgspec.Meta(max_length=253, pattern=DNS_SUBDOMAIN_RE.pattern)]
NamespaceName = Annotated[str, msgspec.Meta(max_length=63, pattern=DNS_LABEL_RE.pattern)]
MAX_ENGINE_NAMESPACES = 64
ResourceName = Annotated[str, msgspec.Meta(max_length=253, pattern=RESOURCE_NAME_RE.pattern)]
GpuCount = Annotated[int, msgspec.Meta(ge=1, le=MAX_GPUS_PER_NODE)]
PeerId = Annotated[int, msgspec.Meta(ge=1)]  # never 0: root as a peer would admit any root process
PeerIds = Annotated[tuple[PeerId, ...], msgspec.Meta(max_length=MAX_PEER_IDS)]
Quantity = str | int
MaxUnavailable = (
    Annotated[int, msgspec.Meta(ge=1, le=MAX_INT32)]
    | Annotated[str, msgspec.Meta(pattern=PERCENT_RE.pattern)]
)


class SpecError(ValueError):
    """The spec is invalid; the message starts with the field."""


class _Spec(msgspec.Struct, frozen=True, rename="camel"):
    """Unknown fields are ignored, as the apiserver prunes them."""


class PvcSource(_Spec):
    claim_name: Name
    sub_path: RelPath | None = None


class ModelSpec(_Spec):
    path: AbsPath | None = None
    pvc: PvcSource | None = None
    revision: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    dtype: Dtype = "auto"


class GpuSpec(_Spec):
    per_node: GpuCount = 1
    tp_size: GpuCount = 1
    # How each rank's shard is cut from the checkpoint (weightcache.shard); tp_size > 1 only.
    shard_plan: ShardPlan | None = None


class ClaimRef(_Spec):
    resource_claim_name: Name | None = None
    resource_claim_template_name: Name | None = None


class GpuAccess(_Spec):
    mode: GpuAccessMode = "visible-devices"
    resource_name: ResourceName = DEFAULT_RESOURCE_NAME
    claim: ClaimRef = ClaimRef()


class Requirement(_Spec):
    key: Annotated[str, msgspec.Meta(min_length=1, max_length=317)]
    operator: SelectorOperator
    values: tuple[str, ...] = ()


class LabelSelector(_Spec):
    match_labels: dict[str, str] = {}
    match_expressions: tuple[Requirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Kubernetes semantics."""
        for key, value in self.match_labels.items():
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


class Placement(_Spec):
    node_selector: dict[str, str] = {}
    tolerations: tuple[dict[str, Any], ...] = ()
    affinity: dict[str, Any] | None = None
    priority_class_name: Name | None = None


class Resources(_Spec):
    requests: dict[str, Quantity] = {}
    limits: dict[str, Quantity] = {}


class AllowedPeers(_Spec):
    # Peers the daemon serves besides its own uid and runAsGroup (SO_PEERCRED).
    uids: PeerIds = ()
    gids: PeerIds = ()


class SidecarSpec(_Spec):
    image: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)] | None = None
    image_pull_policy: PullPolicy | None = None
    resources: Resources = Resources()
    http_port: Annotated[int, msgspec.Meta(ge=1024, le=65535 - MAX_GPUS_PER_NODE)] = (
        DEFAULT_HTTP_PORT
    )
    run_as_user: PeerId = DEFAULT_RUN_AS
    run_as_group: PeerId = DEFAULT_RUN_AS
    allowed_peers: AllowedPeers = AllowedPeers()


class EngineSpec(_Spec):
    selector: LabelSelector | None = None
    byte_tolerance: Annotated[float, msgspec.Meta(ge=0, lt=1)] = DEFAULT_BYTE_TOLERANCE
    expected_bytes: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # Other namespaces whose pods may mount this cache's sockets (the CSI driver, the webhook).
    namespaces: Annotated[
        tuple[NamespaceName, ...], msgspec.Meta(max_length=MAX_ENGINE_NAMESPACES)
    ] = ()


class RolloutSpec(_Spec):
    # Nodes whose daemons are replaced at once when the weights change: each replaced
    # daemon reloads from disk, and an engine restarting on its node waits for it.
    max_unavailable: MaxUnavailable = 1
    # Auto: the DaemonSet replaces a node's daemon, which keeps the old weights the engines
    # there map and loads the new beside them where the device has room; where it has not,
    # it waits and the operator evicts that node's engines of older generations
    # (rollout.make_room). Surge: the new weights load beside the old regardless.
    # NodeByNode: the operator evicts a node's engines of older generations first and
    # replaces its daemon once they are gone (rollout.plan).
    strategy: RolloutStrategy = "Auto"


class WeightCacheSpec(_Spec):
    model: ModelSpec
    device: Device = "cuda"
    gpus: GpuSpec = GpuSpec()
    transport: Transport = "auto"
    gpu_access: GpuAccess = GpuAccess()
    socket_dir: AbsPath = DEFAULT_SOCKET_DIR
    placement: Placement = Placement()
    sidecar: SidecarSpec = SidecarSpec()
    engine: EngineSpec = EngineSpec()
    rollout: RolloutSpec = RolloutSpec()

    @property
    def slots(self) -> int:
        """Daemon processes per node: one per GPU, or one on a CPU node."""
        return 1 if self.device == "cpu" else self.gpus.per_node


def parse_spec(raw: Any) -> WeightCacheSpec:
    """Typed, defaulted spec; `SpecError` names the first invalid field."""
    try:
        spec = msgspec.convert({} if raw is None else raw, type=WeightCacheSpec)
    except msgspec.ValidationError as exc:
        raise SpecError(_located(str(exc))) from None
    errors = cross_field_errors(spec)
    if errors:
        raise SpecError(errors[0])
    return spec


def cross_field_errors(spec: WeightCacheSpec) -> list[str]:
    """What decoding cannot see: rules across fields, and keys of free-form maps."""
    errors: list[str] = []
    model = spec.model
    if (model.path is None) == (model.pvc is None):
        errors.append("spec.model: set exactly one of path or pvc")
    for where, path in (("spec.model.path", model.path), ("spec.socketDir", spec.socket_dir),
                        ("spec.model.pvc.subPath", model.pvc and model.pvc.sub_path)):
        if path and ".." in path.split("/"):
            errors.append(f"{where}: '..' segments are not allowed, got {path!r}")
    if spec.device == "cpu" and spec.transport not in ("auto", "memfd"):
        errors.append(f"spec.transport: {spec.transport!r} needs a GPU; a cpu cache uses memfd")
    if spec.device == "cuda" and spec.transport == "memfd":
        errors.append("spec.transport: memfd holds CPU memory; use it with spec.device: cpu")
    if spec.device == "cpu" and spec.gpus != GpuSpec():
        errors.append(
            "spec.gpus: a cpu cache runs one daemon per node; perNode and tpSize must be 1"
        )
    gpus = spec.gpus
    if gpus.per_node % gpus.tp_size:
        errors.append(
            f"spec.gpus.perNode: {gpus.per_node} is not a multiple of spec.gpus.tpSize "
            f"{gpus.tp_size}"
        )
    if gpus.tp_size > 1 and gpus.shard_plan is None:
        errors.append("spec.gpus.shardPlan: required when spec.gpus.tpSize > 1")
    claim = spec.gpu_access.claim
    if spec.gpu_access.mode == "dra" and (claim.resource_claim_name is None) == (
        claim.resource_claim_template_name is None
    ):
        errors.append(
            "spec.gpuAccess.claim: mode dra needs exactly one of resourceClaimName or "
            "resourceClaimTemplateName"
        )
    for kind, quantities in (("requests", spec.sidecar.resources.requests),
                             ("limits", spec.sidecar.resources.limits)):
        for name, value in quantities.items():
            where = f"spec.sidecar.resources.{kind}"
            if not RESOURCE_NAME_RE.match(name):
                errors.append(f"{where}: {name!r} is not a resource name")
            if isinstance(value, bool) or not QUANTITY_RE.match(str(value)):
                errors.append(f"{where}.{name}: {value!r} is not a quantity (e.g. 500m, 2Gi)")
    selector = spec.engine.selector
    if selector is not None:
        if not selector.match_labels and not selector.match_expressions:
            errors.append(
                "spec.engine.selector: empty; it would hold every gated pod in the namespace: "
                "name the engine's labels"
            )
        for i, req in enumerate(selector.match_expressions):
            at = f"spec.engine.selector.matchExpressions[{i}].values"
            if req.operator in ("In", "NotIn") and not req.values:
                errors.append(f"{at}: operator {req.operator} needs at least one value")
            if req.operator in ("Exists", "DoesNotExist") and req.values:
                errors.append(f"{at}: operator {req.operator} takes no values")
    return errors


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


def _located(message: str) -> str:
    """msgspec's "what - at `$.a.b`" as "spec.a.b: what"; a missing field is named itself."""
    what, _, where = message.partition(" - at `")
    path = "spec" + where.rstrip("`")[1:] if where else "spec"
    missing = re.fullmatch(r"Object missing required field `(.+)`", what)
    if missing:
        return f"{path}.{missing.group(1)}: required"
    return f"{path}: {what}"
