"""Validate one Kubernetes manifest document without a cluster: ``validate(doc) -> list[str]``.

The returned list holds one line per problem; empty means valid. Used on every manifest under
``deploy/knative/`` and on every Knative Service that ``ember deploy --target knative`` renders:

    from tests.deploy.knative_rules import validate
    assert validate(service) == []

- Knative Serving kinds (Service, Configuration, Revision, Route): the CRD ``openAPIV3Schema``
  of Knative 1.23 with unknown fields rejected wherever the schema does not preserve them
  (``knative_schema``); ``metadata`` as a Kubernetes ObjectMeta; the pod spec, once Knative's
  defaulting has run, as a Kubernetes PodSpec (this checks the fields the CRD preserves whole,
  such as ``hostPath`` and ``tolerations``); then the webhook rules Ember relies on (below).
- Built-in kinds: ``kubernetes-validate`` in strict mode against Kubernetes ``K8S_VERSION``.

The webhook rules, as Knative Serving's admission webhook applies them with the shipped
``deploy/knative/config-features.yaml`` and Knative's default ``config-defaults``:
every volume mount read-only except emptyDir (so hostPath mounts are read-only), every volume
mounted, no reserved mount path; one serving container with at most one port, named ``http1``,
``h2c`` or not at all, not a port queue-proxy reserves; readiness and liveness probes on the
serving port; no environment variable Knative reserves; the autoscaling ``window`` within
6 s..1 h in whole seconds and ``min-scale`` <= ``max-scale``, autoscaling annotations only on
the revision template; ``timeoutSeconds`` within
``max-revision-timeout-seconds`` and the other timeouts within it; ``containerConcurrency``
within ``container-concurrency-max-limit``; every feature-gated pod-spec field (hostPath volumes,
schedulerName, runtimeClassName, tolerations, nodeSelector, hostPID, ...) enabled.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from tests.deploy.go_duration import parse_duration
from tests.deploy.knative_schema import GROUP, ITEM, dotted, reference, schema_problems

K8S_VERSION = "1.34"  # the oldest Kubernetes release Knative Serving 1.23 supports
FEATURES_PATCH = Path(__file__).resolve().parents[2] / "deploy" / "knative" / "config-features.yaml"
ALLOWED = frozenset({"enabled", "allowed"})
KNATIVE_ONLY = ("containerConcurrency", "timeoutSeconds", "responseStartTimeoutSeconds", "idleTimeoutSeconds")
DEFAULT_PORT = 8080  # Knative's default user port when a container declares none
RESERVED_PORTS = frozenset({8012, 8013, 8022, 9090, 9091})  # queue-proxy and metrics ports
RESERVED_ENV = frozenset(
    {"K_SERVICE", "K_CONFIGURATION", "K_REVISION", "CONTAINER_CONCURRENCY", "QUEUE_SERVING_PORT", "USER_PORT"}
)
RESERVED_PATHS = frozenset({"/", "/dev", "/dev/log", "/tmp", "/var", "/var/log"})
PORT_NAMES = frozenset({"", "http1", "h2c"})
AUTOSCALING = "autoscaling.knative.dev/"
WINDOW = AUTOSCALING + "window"
TEMPLATE_ANNOTATIONS = "spec.template.metadata.annotations"
WINDOW_MIN_S, WINDOW_MAX_S = 6.0, 3600.0
MIN_SCALE = ("autoscaling.knative.dev/min-scale", "autoscaling.knative.dev/minScale")
MAX_SCALE = ("autoscaling.knative.dev/max-scale", "autoscaling.knative.dev/maxScale")
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


def shipped_features() -> dict[str, str]:
    """The ``config-features`` Knative runs with: its defaults, then the shipped patch's data."""
    patch = yaml.safe_load(FEATURES_PATCH.read_text())
    return {**reference().features, **{str(k): str(v) for k, v in patch["data"].items()}}


def validate(doc: Mapping[str, Any], *, features: Mapping[str, str] | None = None) -> list[str]:
    """Problems with one manifest document, each ``Kind/name: where: what``; empty when valid.

    ``features`` replaces the shipped ``config-features`` (defaults and patch) for the
    feature-flag rule; leave it out to check against what ``deploy/knative`` installs.
    """
    if not isinstance(doc, Mapping):
        return [f"a manifest document is a mapping, not {type(doc).__name__}"]
    kind, api = doc.get("kind"), str(doc.get("apiVersion", ""))
    name = (doc.get("metadata") or {}).get("name", "?") if isinstance(doc.get("metadata"), Mapping) else "?"
    if api.partition("/")[0] == GROUP:
        flags = dict(features) if features is not None else shipped_features()
        problems = _knative_problems(doc, flags)
    else:
        problems = _builtin_problems(dict(doc))
    return [f"{kind}/{name}: {p}" for p in problems]


def _builtin_problems(doc: dict[str, Any]) -> list[str]:
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return [f"no Kubernetes {K8S_VERSION} schema for apiVersion {doc.get('apiVersion')!r}"]
    except kubernetes_validate.ValidationError as e:
        where = dotted(e.absolute_path) or "(root)"
        return [f"{where}: {e.message}"]
    return []


def _knative_problems(doc: Mapping[str, Any], features: Mapping[str, str]) -> list[str]:
    problems = schema_problems(doc)
    meta = doc.get("metadata")
    if not isinstance(meta, Mapping):
        return [*problems, "metadata: required"]
    problems += _builtin_problems({"apiVersion": "v1", "kind": "ConfigMap", "metadata": dict(meta)})
    if not DNS_1035.match(str(meta.get("name", ""))):
        problems.append(f"metadata.name: {meta.get('name')!r} is not a DNS-1035 label (a-z0-9-, <= 63)")
    if problems or doc.get("kind") == "Route":
        return problems  # the rules below read the pod spec the schema has vouched for
    if doc.get("kind") == "Revision":
        where, spec, annotations = "spec", doc["spec"], meta.get("annotations") or {}
    else:
        template = doc.get("spec", {}).get("template", {})
        where, spec = "spec.template.spec", template.get("spec", {})
        annotations = template.get("metadata", {}).get("annotations") or {}
        problems += [
            f"metadata.annotations.{key}: autoscaling annotations belong in {TEMPLATE_ANNOTATIONS}"
            for key in meta.get("annotations") or {}
            if str(key).startswith(AUTOSCALING)
        ]
    problems += [f"{where}.{p}" for p in _podspec_problems(spec)]
    problems += [f"{where}.{p}" for p in _gate_problems(spec, features)]
    problems += [f"{where}.{p}" for p in _volume_problems(spec, features)]
    problems += [f"{where}.{p}" for p in _container_problems(spec)]
    problems += [f"{where}.{p}" for p in _timeout_problems(spec)]
    problems += _annotation_problems(annotations)
    return problems


def _podspec_problems(spec: Mapping[str, Any]) -> list[str]:
    """The pod spec after Knative's defaulting (container names, probe ports), as a PodSpec."""
    pod = {k: copy.deepcopy(v) for k, v in spec.items() if k not in KNATIVE_ONLY}
    for i, container in enumerate(pod.get("containers", [])):
        container.setdefault("name", "user-container" if i == 0 else f"user-container-{i}")
        ports: list[dict[str, Any]] = container.get("ports") or [{}]
        port = ports[0].get("containerPort", DEFAULT_PORT)
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            for action in ("httpGet", "tcpSocket", "grpc"):
                if isinstance(container.get(probe, {}).get(action), dict):
                    container[probe][action].setdefault("port", port)
    problems = _builtin_problems({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": pod})
    return [p.removeprefix("spec.") for p in problems]


def _present(node: Any, path: tuple[str, ...]) -> Iterator[str]:
    """The concrete locations of ``path`` in ``node`` (``[]`` steps fan out over list items)."""
    if not path:
        yield ""
        return
    step, rest = path[0], path[1:]
    if step == ITEM and isinstance(node, list):
        for i, item in enumerate(node):
            yield from (f"[{i}]{tail}" for tail in _present(item, rest))
    elif isinstance(node, Mapping) and node.get(step) is not None:
        yield from (f".{step}{tail}" for tail in _present(node[step], rest))


def _gate_problems(spec: Mapping[str, Any], features: Mapping[str, str]) -> list[str]:
    problems = []
    for gate in reference().gates:
        if features.get(gate.flag) in ALLOWED:
            continue
        for where in _present(spec, gate.path):
            problems.append(f"{where.lstrip('.')}: needs Knative feature flag {gate.flag} (not enabled)")
    if len(spec.get("containers", [])) > 1 and features.get("multi-container") not in ALLOWED:
        problems.append("containers: more than one needs Knative feature flag multi-container")
    return problems


def _volume_problems(spec: Mapping[str, Any], features: Mapping[str, str]) -> list[str]:
    volumes = {v.get("name"): v for v in spec.get("volumes", [])}
    pvc_writable = features.get("kubernetes.podspec-persistent-volume-write") in ALLOWED
    problems, mounted = [], set()
    for i, container in enumerate(spec.get("containers", [])):
        for j, mount in enumerate(container.get("volumeMounts", [])):
            where = f"containers[{i}].volumeMounts[{j}]"
            volume = volumes.get(mount.get("name"))
            mounted.add(mount.get("name"))
            if volume is None:
                problems.append(f"{where}.name: no volume named {mount.get('name')!r}")
                continue
            writable = "emptyDir" in volume or (
                pvc_writable and not volume.get("persistentVolumeClaim", {"readOnly": True}).get("readOnly")
            )
            if not writable and mount.get("readOnly") is not True:
                problems.append(f"{where}.readOnly: must be true for a {_source(volume)} volume")
            if str(mount.get("mountPath", "")).rstrip("/") in {p.rstrip("/") for p in RESERVED_PATHS}:
                problems.append(f"{where}.mountPath: {mount.get('mountPath')!r} is reserved")
    for name in volumes.keys() - mounted:
        problems.append(f"volumes: {name!r} is not mounted by any container")
    return problems


def _source(volume: Mapping[str, Any]) -> str:
    return next((k for k in volume if k != "name"), "sourceless")


def _container_problems(spec: Mapping[str, Any]) -> list[str]:
    containers = spec.get("containers", [])
    serving = [i for i, c in enumerate(containers) if c.get("ports")] or [0][: len(containers)]
    problems = []
    if len(serving) > 1:
        problems.append(f"containers: only one may declare ports (the serving one), not {len(serving)}")
    for i, container in enumerate(containers):
        for j, env in enumerate(container.get("env", [])):
            if env.get("name") in RESERVED_ENV:
                problems.append(f"containers[{i}].env[{j}].name: {env['name']} is reserved by Knative")
    for i in serving[:1]:
        container, ports = containers[i], containers[i].get("ports", [])
        if len(ports) > 1:
            problems.append(f"containers[{i}].ports: at most one port, not {len(ports)}")
        port = ports[0] if ports else {"containerPort": DEFAULT_PORT}
        if port.get("name", "") not in PORT_NAMES:
            problems.append(f"containers[{i}].ports[0].name: {port['name']!r} is not http1, h2c or empty")
        if port.get("containerPort") in RESERVED_PORTS:
            problems.append(f"containers[{i}].ports[0].containerPort: {port['containerPort']} is reserved")
        accepted = {port.get("containerPort", DEFAULT_PORT), port.get("name") or None, 0} - {None}
        for probe in ("readinessProbe", "livenessProbe"):
            for action in ("httpGet", "tcpSocket", "grpc"):
                target = container.get(probe, {}).get(action)
                if isinstance(target, Mapping) and target.get("port", 0) not in accepted:
                    problems.append(
                        f"containers[{i}].{probe}.{action}.port: {target['port']!r} is not the serving "
                        f"port {port.get('containerPort', DEFAULT_PORT)}"
                    )
    return problems


def _timeout_problems(spec: Mapping[str, Any]) -> list[str]:
    defaults = reference().defaults
    most = int(defaults["max-revision-timeout-seconds"])
    problems = []
    timeout = spec.get("timeoutSeconds")
    if timeout is not None and not 0 <= timeout <= most:
        problems.append(f"timeoutSeconds: {timeout} is outside 0..{most} (max-revision-timeout-seconds)")
    bound = timeout if timeout is not None else most
    for field in ("responseStartTimeoutSeconds", "idleTimeoutSeconds"):
        value = spec.get(field)
        if value is not None and not 0 <= value <= bound:
            problems.append(f"{field}: {value} is outside 0..{bound} (timeoutSeconds or the maximum)")
    concurrency = spec.get("containerConcurrency")
    limit = int(defaults["container-concurrency-max-limit"])
    floor = 0 if defaults.get("allow-container-concurrency-zero", "true") == "true" else 1
    if concurrency is not None and not floor <= concurrency <= limit:
        bounds = f"{floor}..{limit} (container-concurrency-max-limit)"
        problems.append(f"containerConcurrency: {concurrency} is outside {bounds}")
    return problems


def _annotation_problems(annotations: Mapping[str, Any]) -> list[str]:
    problems = []
    if WINDOW in annotations:
        try:
            seconds = parse_duration(str(annotations[WINDOW]))
        except ValueError as e:
            problems.append(f"annotations.{WINDOW}: {e}")
        else:
            if not WINDOW_MIN_S <= seconds <= WINDOW_MAX_S:
                problems.append(f"annotations.{WINDOW}: {annotations[WINDOW]!r} is outside 6s..1h")
            elif seconds != int(seconds):
                problems.append(f"annotations.{WINDOW}: {annotations[WINDOW]!r} is not in whole seconds")
    scale = {}
    for keys in (MIN_SCALE, MAX_SCALE):
        for key in keys:
            if key in annotations:
                value = str(annotations[key])
                if not value.isdigit():
                    problems.append(f"annotations.{key}: {value!r} is not a non-negative integer")
                else:
                    scale[keys[0]] = int(value)
    low, high = scale.get(MIN_SCALE[0], 0), scale.get(MAX_SCALE[0], 0)
    if high and low > high:
        problems.append(f"annotations.{MIN_SCALE[0]}: {low} is above {MAX_SCALE[0]} {high}")
    return problems
