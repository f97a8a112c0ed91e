"""The kube-scheduler extender's wire types (``k8s.io/kube-scheduler/extender/v1``), typed.

The Go structs carry no json tags, so on the wire the keys are the Go field names:
``ExtenderArgs`` is ``{"Pod", "Nodes", "NodeNames"}``, ``ExtenderFilterResult`` is
``{"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}`` and a
``HostPriorityList`` is ``[{"Host", "Score"}]``. With ``nodeCacheCapable: true`` kube-scheduler
sends ``NodeNames`` and expects ``NodeNames`` back; otherwise it sends a full ``v1.NodeList`` in
``Nodes`` and expects the filtered ``NodeList`` back. Both are supported.

:meth:`ExtenderArgs.decode` takes the parsed JSON (the HTTP layer bounds the body's size and
nesting) and checks the rest: the shapes it reads, the node count, name lengths, and the
Ember annotations of the pod (:mod:`scheduler.cluster_keys`). Anything else in the ``v1.Pod``
or the ``v1.Node`` objects is not read, and Node objects are echoed back unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from scheduler import cluster_keys
from scheduler.errors import SchedulerError

MAX_EXTENDER_PRIORITY = 10  # MaxExtenderPriority
MIN_EXTENDER_PRIORITY = 0  # MinExtenderPriority
MAX_NAME = 253  # a node name is a DNS subdomain
# What the API server admits as a Node's name (an RFC 1123 subdomain): anything else is not
# from kube-scheduler, and a '/' would name another device id, a lone surrogate fail the answer.
_NODE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
MAX_WEIGHT_BYTES = 1 << 50  # 1 PiB: far above any model, far below float precision trouble


class ExtenderWireError(SchedulerError):
    """An extender request that is not a well-formed ``ExtenderArgs`` (HTTP 400)."""

    code = "invalid_extender_args"


@dataclass(frozen=True, slots=True)
class WireLimits:
    """Bounds on one ``ExtenderArgs`` beyond the HTTP body cap."""

    max_nodes: int = 5000  # Kubernetes' supported cluster size
    max_metadata_entries: int = 512  # labels + annotations of the pod

    def __post_init__(self) -> None:
        if not 1 <= self.max_nodes <= 100_000 or not 1 <= self.max_metadata_entries <= 100_000:
            raise ValueError("max_nodes and max_metadata_entries must be in [1, 100000]")


@dataclass(frozen=True, slots=True)
class PodDemand:
    """What an Ember function pod asks of a node, from its labels and annotations.

    ``model_id`` is None for a pod that is not an Ember function (no ``ember.dev/model``):
    the extender has no opinion on it (every node passes, every node scores alike)."""

    pod: str  # "namespace/name" of the v1.Pod (for the decision log)
    function_id: str | None  # ember.dev/function-id
    model_id: str | None  # ember.dev/model: the residency map's key
    weight_bytes: int  # ember.dev/weight-bytes (0 when model_id is None)


@dataclass(frozen=True, slots=True)
class ExtenderArgs:
    """One filter or prioritize request."""

    demand: PodDemand
    node_names: tuple[str, ...]  # the candidates, in the order sent
    # The v1.Node objects when kube-scheduler sent a NodeList (nodeCacheCapable: false), by
    # name; None when it sent NodeNames. Filter answers in the same form.
    node_objects: Mapping[str, Any] | None = field(default=None, repr=False)

    @classmethod
    def decode(cls, document: Any, limits: WireLimits | None = None) -> ExtenderArgs:
        """The request in ``document`` (parsed JSON); :class:`ExtenderWireError` if malformed."""
        limits = limits or WireLimits()
        if not isinstance(document, Mapping):
            raise ExtenderWireError("ExtenderArgs must be a JSON object")
        demand = _demand(document.get("Pod"), limits)
        names = document.get("NodeNames")
        nodes = document.get("Nodes")
        if names is not None:
            return cls(demand, _names(names, limits))
        if nodes is None:
            raise ExtenderWireError("ExtenderArgs has neither NodeNames nor Nodes")
        if not isinstance(nodes, Mapping):
            raise ExtenderWireError("ExtenderArgs.Nodes must be a v1.NodeList object")
        items = nodes.get("items")
        items = [] if items is None else items  # Go encodes an empty list as null
        if not isinstance(items, list):
            raise ExtenderWireError("ExtenderArgs.Nodes.items must be an array")
        _count(len(items), limits)
        objects: dict[str, Any] = {}
        for item in items:
            metadata = item.get("metadata") if isinstance(item, Mapping) else None
            name = metadata.get("name") if isinstance(metadata, Mapping) else None
            objects[_name(name)] = item
        if len(objects) != len(items):
            raise ExtenderWireError("ExtenderArgs.Nodes names a node twice")
        return cls(demand, tuple(objects), objects)


def _count(n: int, limits: WireLimits) -> None:
    if n > limits.max_nodes:
        raise ExtenderWireError(f"ExtenderArgs lists {n} nodes (at most {limits.max_nodes})")


def _name(value: Any) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME:
        raise ExtenderWireError(f"a node name must be a string of 1 to {MAX_NAME} characters")
    if _NODE_NAME.fullmatch(value) is None:
        raise ExtenderWireError(f"node name {value[:64]!r} is not a DNS subdomain (RFC 1123)")
    return value


def _names(value: Any, limits: WireLimits) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ExtenderWireError("ExtenderArgs.NodeNames must be an array of strings")
    _count(len(value), limits)
    names = tuple(_name(v) for v in value)
    if len(set(names)) != len(names):
        raise ExtenderWireError("ExtenderArgs.NodeNames names a node twice")
    return names


def _string_map(value: Any, what: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ExtenderWireError(f"Pod.metadata.{what} must be an object")
    return value


def _demand(pod: Any, limits: WireLimits) -> PodDemand:
    if not isinstance(pod, Mapping):
        raise ExtenderWireError("ExtenderArgs.Pod must be a v1.Pod object")
    metadata = pod.get("metadata")
    if not isinstance(metadata, Mapping):
        raise ExtenderWireError("ExtenderArgs.Pod has no metadata object")
    labels = _string_map(metadata.get("labels"), "labels")
    annotations = _string_map(metadata.get("annotations"), "annotations")
    if len(labels) + len(annotations) > limits.max_metadata_entries:
        raise ExtenderWireError(
            f"the pod has {len(labels) + len(annotations)} labels and annotations "
            f"(at most {limits.max_metadata_entries})"
        )
    name = metadata.get("name") or metadata.get("generateName") or "?"
    namespace = metadata.get("namespace") or "default"
    if not isinstance(name, str) or not isinstance(namespace, str):
        raise ExtenderWireError("Pod.metadata.name and namespace must be strings")
    pod_name = f"{namespace[:MAX_NAME]}/{name[:MAX_NAME]}"
    function_id = annotations.get(cluster_keys.ANNOTATION_FUNCTION_ID)
    model_id = annotations.get(cluster_keys.ANNOTATION_MODEL)
    # Printable: the answer and the log quote them, and a lone surrogate cannot be encoded.
    if function_id is not None and not (isinstance(function_id, str) and function_id.isprintable()):
        raise ExtenderWireError(
            f"annotation {cluster_keys.ANNOTATION_FUNCTION_ID} must be a printable string"
        )
    if model_id is None:
        return PodDemand(pod_name, function_id, None, 0)
    if not isinstance(model_id, str) or not 0 < len(model_id) <= 1024 or not model_id.isprintable():
        raise ExtenderWireError(
            f"annotation {cluster_keys.ANNOTATION_MODEL} must be 1 to 1024 printable characters"
        )
    raw = annotations.get(cluster_keys.ANNOTATION_WEIGHT_BYTES)
    # Decimal digits only: int() alone would take "1_000", " 7" and "+7" too.
    if not isinstance(raw, str) or not raw.isascii() or not raw.isdigit() or len(raw) > 16:
        raise ExtenderWireError(
            f"a pod with {cluster_keys.ANNOTATION_MODEL} needs {cluster_keys.ANNOTATION_WEIGHT_BYTES} "
            f"as a decimal byte count, got {str(raw)[:40]!r}"
        )
    weight_bytes = int(raw)
    if weight_bytes > MAX_WEIGHT_BYTES:
        raise ExtenderWireError(f"{cluster_keys.ANNOTATION_WEIGHT_BYTES} {weight_bytes} is implausibly large")
    return PodDemand(pod_name, function_id, model_id, weight_bytes)


class HostPriority(NamedTuple):
    """One ``HostPriority``: a node and its score in 0..10 (higher is better)."""

    host: str
    score: int

    def encode(self) -> dict[str, Any]:
        return {"Host": self.host, "Score": self.score}


def encode_priorities(priorities: Sequence[HostPriority]) -> list[dict[str, Any]]:
    """A ``HostPriorityList``."""
    return [p.encode() for p in priorities]


@dataclass(frozen=True, slots=True)
class FilterResult:
    """An ``ExtenderFilterResult``: the nodes that pass and why the others do not.

    ``unresolvable`` are nodes that preempting pods cannot make feasible (their pool is down):
    kube-scheduler's ``FailedAndUnresolvableNodes``, which take precedence over ``failed``."""

    passed: tuple[str, ...]
    failed: Mapping[str, str] = field(default_factory=dict)
    unresolvable: Mapping[str, str] = field(default_factory=dict)
    error: str = ""

    def encode(self, args: ExtenderArgs) -> dict[str, Any]:
        """The result in the form ``args`` came in (NodeNames, or a NodeList of the passed nodes)."""
        out: dict[str, Any] = {
            "Nodes": None,
            "NodeNames": None,
            "FailedNodes": dict(self.failed),
            "FailedAndUnresolvableNodes": dict(self.unresolvable),
            "Error": self.error,
        }
        if args.node_objects is None:
            out["NodeNames"] = list(self.passed)
        else:
            items = [args.node_objects[n] for n in self.passed]
            out["Nodes"] = {"apiVersion": "v1", "kind": "NodeList", "metadata": {}, "items": items}
        return out
