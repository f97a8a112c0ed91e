"""A function spec rendered as a Knative Service (``serving.knative.dev/v1``), its token Secret
and, for a custom handler, the ConfigMap of its code.

The one mapping from the Function spec to Knative (CLUSTER.md "One function, rendered"):

=========================== =============================================================== =========
Function spec               Knative Service                                                 notes
=========================== =============================================================== =========
metadata.name, .namespace   ``metadata.name``: ``NAME`` / ``NS--NAME``                      (1)
                            labels ``ember.dev/function``, ``ember.dev/namespace``;
                            annotation ``ember.dev/function-id`` (the qualified id)
scaling.keepAlive (k)       template annotations ``autoscaling.knative.dev/window`` =       (2)
                            clamp(ceil(k), 6s, 1h) and
                            ``scale-to-zero-pod-retention-period`` = k - window (>= 0)
scaling.concurrency (c)     ``containerConcurrency`` = c (at most 1000);                    (3)
                            ``autoscaling.knative.dev/target`` = ceil(c x target%),
                            ``target-utilization-percentage`` = 100
scaling.minScale, maxScale  ``autoscaling.knative.dev/min-scale``, ``max-scale``
slo.ttft, slo.tpot,         ``timeoutSeconds`` = T = min(max, ceil(slack x S)),             (4)
maxTokens                   S = ttft + maxTokens x tpot;
                            ``responseStartTimeoutSeconds`` = ``idleTimeoutSeconds`` = T
device: cuda                container ``resources.limits[nvidia.com/gpu]`` = 1;             (5)
                            ``runtimeClassName`` (``EMBER_KNATIVE_GPU_RUNTIME_CLASS``)
device: auto, cpu           no GPU request
spec.handler: default       nothing
spec.handler: module.py:fn  ConfigMap ``<service>-code-<digest>`` (``immutable``,           (6)
                            key ``module.py``), volume ``ember-handler`` mounted
                            read-only at ``/var/lib/ember/functions/NS/NAME/<digest>``;
                            container env ``EMBER_FUNCTION_HANDLER`` =
                            ``NS/NAME/<digest>/module.py:fn``
the registered model        template annotations ``ember.dev/model`` (its id: the key of    (8)
                            pools' residency reports), ``ember.dev/weight-bytes``
(always)                    ``schedulerName: ember-scheduler``; label
                            ``networking.knative.dev/visibility: cluster-local``;
                            container ``worker``: ``args [worker, --function, ID]``, port
                            8080 ``http1``, readiness ``GET /readyz``, ``EMBER_REDIS_URL``
                            from Secret ``ember-redis`` (key ``url``), ``EMBER_POOL_DIR``
                            on a read-only hostPath, ``EMBER_WORKER_TOKEN`` from Secret
                            ``<service>-worker-token`` (key ``token``)                      (7)
=========================== =============================================================== =========

1. :mod:`scheduler.knative.naming`: a DNS-1035 label of at most 57 characters (Knative appends
   ``-00001`` for revisions); ``--`` in a name or namespace is rejected.
2. Knative accepts a window of 6 s..1 h in whole seconds, and a retention period of 0..1 h.
   After the last request the stable window's average decays to zero in about ``window``,
   then the last pod stays ``max(retention, scale-to-zero-grace-period)`` (the grace period is
   cluster-wide, 30 s by default). So: k <= 6 s renders a window of 6 s (a note says so: pods
   stay at least 6 s + grace); 6 s < k <= 1 h renders window = ceil(k), retention 0 s; 1 h <
   k <= 2 h renders window 1 h and retention k - 1 h; k > 2 h cannot be expressed and is a
   SpecError (use ``minScale: 1`` to keep an instance up). Both annotations are always
   rendered, so a redeploy resets a previous retention.
3. Knative's ``container-concurrency-max-limit`` is 1000 (config-defaults): a larger
   concurrency is a SpecError. Knative multiplies ``target`` by the utilization percentage
   (config-autoscaler's 70 % unless the annotation says otherwise); Ember computes the target
   itself (``EMBER_KNATIVE_TARGET_PERCENT``, 70) and sets utilization to 100 % so the
   percentage is applied once: concurrency 8 -> target 6, as in CLUSTER.md.
4. S is the time a request of ``maxTokens`` takes at the SLO. Knative's queue-proxy runs all
   three timers from the request's arrival (queueing included), and a non-streaming answer's
   first byte is its last (the worker writes the JSON whole), so the response-start and idle
   timeouts must be T as well: shorter ones would cut answers that meet their SLO. Set
   explicitly, they also override the cluster's defaults (a 300 s
   ``revision-response-start-timeout-seconds`` would otherwise apply). ``slack`` is
   ``EMBER_KNATIVE_TIMEOUT_SLACK`` (2: a request may take twice its SLO time, queueing behind
   ``containerConcurrency`` included, before Knative cuts it; the gateway's own deadline,
   ``EMBER_REQUEST_TIMEOUT`` or ``X-Ember-Timeout``, may end it sooner). ``max`` is
   ``EMBER_KNATIVE_MAX_TIMEOUT``, the cluster's ``max-revision-timeout-seconds`` (600); a
   spec whose S exceeds it is a SpecError (lower maxTokens or slo.tpot, or raise the cluster's
   maximum and ``EMBER_KNATIVE_MAX_TIMEOUT`` with it).
5. ``auto`` renders as CPU: a pod gets a GPU only by requesting one (a note says so). The
   device plugin picks the GPU; the pod needs the cluster's GPU runtime class.
6. :mod:`scheduler.knative.handler_code`: the module reaches the pods as a ConfigMap (a
   configMap volume needs no Knative feature flag: unlike hostPath, emptyDir, PVC or CSI
   volumes, the Revision CRD gates it behind none, and ``config-features`` has no flag for it),
   content-addressed (new code: a new ConfigMap and a new revision). It is mounted where the
   worker's handler loader and function sandbox accept it, and ``EMBER_FUNCTION_HANDLER``
   pins the revision to its own code. Rendering a custom handler needs its source
   (:class:`~scheduler.knative.handler_code.HandlerCode`): the gateway reads the module it
   stored, ``ember deploy --target knative`` the one beside the YAML.
7. The token is ``HMAC-SHA256(EMBER_CLUSTER_SECRET, qualified id)``
   (:mod:`scheduler.knative.tokens`); the rendered Secret carries no token: the backend adds it
   when it applies (:meth:`Rendered.secret_with`).
8. Without a registered model (``ember deploy --target knative`` on a machine whose model
   store lacks it) the annotations are left out, and the extender cannot score residency.

Objects are built as plain mappings (serialized with ``yaml.safe_dump``), never templated text.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from scheduler import cluster_keys, names
from scheduler.knative import handler_code
from scheduler.knative.config import KnativeConfig
from scheduler.knative.handler_code import HandlerCode
from scheduler.knative.naming import service_name, token_secret_name
from scheduler.records import FunctionRecord, ModelRef, Scaling
from scheduler.spec import SloSpec, SpecError

WINDOW_MIN_S = 6  # Knative's autoscaling window bounds (autoscaling.WindowMin / WindowMax)
WINDOW_MAX_S = 3600
RETENTION_MAX_S = 3600  # scale-to-zero-pod-retention-period: 0..WindowMax
MAX_CONTAINER_CONCURRENCY = 1000  # config-defaults' container-concurrency-max-limit
MODELS_DIR = cluster_keys.NODE_HOME + "/models"  # the node model store, read-only in pods
WORKER_PORT = 8080  # the worker's serving port (Knative's PORT); the probe uses it too
REDIS_SECRET, REDIS_SECRET_KEY = "ember-redis", "url"
TOKEN_ENV, TOKEN_KEY = "EMBER_WORKER_TOKEN", "token"
MANAGED_BY = ("app.kubernetes.io/managed-by", "ember")  # label of every object Ember applies
VISIBILITY = ("networking.knative.dev/visibility", "cluster-local")
GPU_RESOURCE = "nvidia.com/gpu"
AUTOSCALING = "autoscaling.knative.dev/"
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True, slots=True)
class ServiceInputs:
    """What the rendering reads from a function: its spec's fields, parsed, and its model."""

    function_id: str
    scaling: Scaling
    max_tokens: int
    ttft_s: float
    tpot_s: float
    device: str
    model: ModelRef | None
    code: HandlerCode | None = None  # a custom handler's module (None: the default handler)

    @classmethod
    def from_record(cls, record: FunctionRecord, code: HandlerCode | None = None) -> ServiceInputs:
        """The inputs of a stored function; ``code`` is its custom handler's module (required
        then, and must be the one ``spec.handler`` names)."""
        body = record.spec.get("spec")
        body = body if isinstance(body, Mapping) else {}
        try:
            slo = SloSpec.model_validate(body.get("slo") or {})
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            raise SpecError(f"spec.slo: {exc}") from None
        handler = body.get("handler", "default")
        if handler == "default":
            code = None
        elif not isinstance(handler, str) or code is None:
            raise SpecError(f"spec.handler: {str(handler)[:200]!r} is rendered with its module's source")
        elif not code.matches(handler):
            raise SpecError(f"spec.handler: {handler[:200]!r} is not the module rendered ({code.module})")
        device = body.get("device", "auto")
        if device not in DEVICES:
            raise SpecError(f"spec.device: {device!r} must be one of {', '.join(DEVICES)}")
        return cls(
            record.function_id, record.scaling, record.max_tokens, slo.ttft, slo.tpot, device, record.model,
            code,
        )  # fmt: skip


class Window(NamedTuple):
    window_s: int
    retention_s: int
    note: str | None


class Timeouts(NamedTuple):
    timeout_s: int
    response_start_s: int
    idle_s: int


def keep_alive_window(keep_alive_s: float) -> Window:
    """Mapping (2): the stable window and scale-to-zero retention of a keep-alive."""
    wanted = math.ceil(keep_alive_s)
    if wanted > WINDOW_MAX_S + RETENTION_MAX_S:
        raise SpecError(
            f"spec.scaling.keepAlive: {keep_alive_s:g} s exceeds what Knative can hold an idle pod "
            f"({WINDOW_MAX_S + RETENTION_MAX_S} s: a 1 h window plus a 1 h retention); "
            f"use minScale: 1 to keep an instance up"
        )
    if wanted < WINDOW_MIN_S:
        note = (
            f"spec.scaling.keepAlive {keep_alive_s:g}s is below Knative's minimum window: rendered as "
            f"{WINDOW_MIN_S}s (an idle pod stays about {WINDOW_MIN_S} s + the scale-to-zero grace period)"
        )
        return Window(WINDOW_MIN_S, 0, note)
    window = min(wanted, WINDOW_MAX_S)
    return Window(window, wanted - window, None)


def autoscaling_target(concurrency: int, target_percent: int) -> int:
    """Mapping (3): Knative's per-pod concurrency target for a function's concurrency."""
    if concurrency > MAX_CONTAINER_CONCURRENCY:
        raise SpecError(
            f"spec.scaling.concurrency: {concurrency} exceeds Knative's container-concurrency-max-limit "
            f"({MAX_CONTAINER_CONCURRENCY})"
        )
    # round() first: 8 x 70 / 100 is 5.6000000000000005 in floating point, and must be 6, not 7
    return max(1, math.ceil(round(concurrency * target_percent / 100, 9)))


def request_timeouts(inputs: ServiceInputs, config: KnativeConfig) -> Timeouts:
    """Mapping (4): Knative's request timeouts from the SLO and maxTokens."""
    budget = inputs.ttft_s + inputs.max_tokens * inputs.tpot_s
    if budget > config.max_timeout_s:
        raise SpecError(
            f"spec.maxTokens: a request of {inputs.max_tokens} tokens at the SLO (slo.ttft + maxTokens x "
            f"slo.tpot = {budget:g} s) exceeds Knative's max-revision-timeout-seconds "
            f"({config.max_timeout_s} s, EMBER_KNATIVE_MAX_TIMEOUT): lower maxTokens or slo.tpot"
        )
    timeout = max(1, min(config.max_timeout_s, math.ceil(round(config.timeout_slack * budget, 6))))
    return Timeouts(timeout, timeout, timeout)


@dataclass(frozen=True, slots=True)
class Rendered:
    """The rendered objects; ``secret`` has no token (see :meth:`secret_with`)."""

    function_id: str
    service: dict[str, Any]
    secret: dict[str, Any]
    notes: tuple[str, ...]  # where the rendering differs from the spec (keepAlive, device)
    config_map: dict[str, Any] | None = None  # a custom handler's code (applied before the Service)

    @property
    def name(self) -> str:
        return str(self.service["metadata"]["name"])

    def secret_with(self, token: str) -> dict[str, Any]:
        """The token Secret as applied: ``stringData.token`` set (never printed or logged)."""
        return {**self.secret, "stringData": {TOKEN_KEY: token}}


def render(inputs: ServiceInputs, config: KnativeConfig) -> Rendered:
    """The Knative Service, token Secret and handler ConfigMap of a function; :class:`SpecError`
    for a spec that Knative cannot express (the message names the field)."""
    service = service_name(inputs.function_id)
    namespace, name = names.split(inputs.function_id)
    window = keep_alive_window(inputs.scaling.keep_alive_s)
    target = autoscaling_target(inputs.scaling.concurrency, config.target_percent)
    timeouts = request_timeouts(inputs, config)
    notes = [window.note] if window.note else []
    if inputs.device == "auto":
        notes.append(
            "spec.device auto renders as CPU in cluster mode (a pod gets a GPU only by requesting one)"
        )

    function_labels = {cluster_keys.LABEL_FUNCTION: name, cluster_keys.LABEL_NAMESPACE: namespace}
    owner = {cluster_keys.ANNOTATION_FUNCTION_ID: inputs.function_id}
    template_annotations = {
        AUTOSCALING + "class": "kpa.autoscaling.knative.dev",
        AUTOSCALING + "metric": "concurrency",
        AUTOSCALING + "target": str(target),
        AUTOSCALING + "target-utilization-percentage": "100",
        AUTOSCALING + "min-scale": str(inputs.scaling.min_scale),
        AUTOSCALING + "max-scale": str(inputs.scaling.max_scale),
        AUTOSCALING + "window": f"{window.window_s}s",
        AUTOSCALING + "scale-to-zero-pod-retention-period": f"{window.retention_s}s",
        **owner,
    }
    if inputs.model is not None:
        template_annotations[cluster_keys.ANNOTATION_MODEL] = inputs.model.model_id
        template_annotations[cluster_keys.ANNOTATION_WEIGHT_BYTES] = str(inputs.model.weight_bytes)
    pod: dict[str, Any] = {
        "schedulerName": config.scheduler_name,
        "containerConcurrency": inputs.scaling.concurrency,
        "timeoutSeconds": timeouts.timeout_s,
        "responseStartTimeoutSeconds": timeouts.response_start_s,
        "idleTimeoutSeconds": timeouts.idle_s,
    }
    if inputs.device == "cuda" and config.gpu_runtime_class is not None:
        pod["runtimeClassName"] = config.gpu_runtime_class
    pod["containers"] = [_worker_container(inputs, config, token_secret_name(service))]
    pod["volumes"] = [
        {"name": "ember-run", "hostPath": {"path": cluster_keys.DEFAULT_POOL_DIR, "type": "Directory"}},
        # The node's model store, which `ember node` fills: the worker reads its model's
        # directory (tokenizer, profile) where the gateway recorded it; weights come from the pool.
        {"name": "ember-models", "hostPath": {"path": MODELS_DIR, "type": "Directory"}},
    ]
    object_labels = {**function_labels, MANAGED_BY[0]: MANAGED_BY[1]}
    config_map = None
    if inputs.code is not None:
        config_map = handler_code.render_config_map(
            inputs.code, service, config.namespace, object_labels, owner
        )
        pod["volumes"].append(handler_code.volume(config_map["metadata"]["name"]))
    manifest = {
        "apiVersion": "serving.knative.dev/v1",
        "kind": "Service",
        "metadata": {
            "name": service,
            "namespace": config.namespace,
            "labels": {VISIBILITY[0]: VISIBILITY[1], **function_labels, MANAGED_BY[0]: MANAGED_BY[1]},
            "annotations": dict(owner),
        },
        "spec": {
            "template": {
                "metadata": {"labels": dict(function_labels), "annotations": template_annotations},
                "spec": pod,
            }
        },
    }
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": token_secret_name(service),
            "namespace": config.namespace,
            "labels": dict(object_labels),
            "annotations": dict(owner),
        },
        "type": "Opaque",
    }
    return Rendered(inputs.function_id, manifest, secret, tuple(notes), config_map)


def _worker_container(inputs: ServiceInputs, config: KnativeConfig, token_secret: str) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "worker",
        "image": config.image,
        "args": ["worker", "--function", inputs.function_id],
        "ports": [{"name": "http1", "containerPort": WORKER_PORT}],
        "env": [
            {"name": "EMBER_REDIS_URL", "valueFrom": _secret_ref(REDIS_SECRET, REDIS_SECRET_KEY)},
            {"name": cluster_keys.POOL_DIR_ENV, "value": cluster_keys.DEFAULT_POOL_DIR},
            {"name": "EMBER_HOME", "value": cluster_keys.NODE_HOME},
            {"name": TOKEN_ENV, "valueFrom": _secret_ref(token_secret, TOKEN_KEY)},
        ],
    }  # fmt: skip
    if inputs.code is not None:
        container["env"].append(
            {"name": handler_code.HANDLER_ENV, "value": inputs.code.pod_handler(inputs.function_id)}
        )
    if inputs.device == "cuda":
        container["resources"] = {"limits": {GPU_RESOURCE: "1"}}
    container["readinessProbe"] = {"httpGet": {"path": "/readyz", "port": WORKER_PORT}, "periodSeconds": 1}
    container["volumeMounts"] = [
        {"name": "ember-run", "mountPath": cluster_keys.DEFAULT_POOL_DIR, "readOnly": True},
        {"name": "ember-models", "mountPath": MODELS_DIR, "readOnly": True},
    ]
    if inputs.code is not None:
        container["volumeMounts"].append(handler_code.volume_mount(inputs.code, inputs.function_id))
    return container


def _secret_ref(name: str, key: str) -> dict[str, Any]:
    return {"secretKeyRef": {"name": name, "key": key}}


def render_record(record: FunctionRecord, config: KnativeConfig, code: HandlerCode | None = None) -> Rendered:
    """:func:`render` of a stored function (``code``: its custom handler's module)."""
    return render(ServiceInputs.from_record(record, code), config)
