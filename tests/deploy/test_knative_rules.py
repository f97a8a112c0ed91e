"""tests/deploy/knative_rules.validate accepts a function's Knative Service as CLUSTER.md renders
it, and each rule catches the violation it exists for (no cluster: schemas and rules only)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from tests.deploy.go_duration import parse_duration
from tests.deploy.knative_rules import shipped_features, validate
from tests.deploy.knative_schema import reference, strict

Doc = dict[str, Any]


def function_service() -> Doc:
    """The rendered function of CLUSTER.md ("One function, rendered")."""
    return {
        "apiVersion": "serving.knative.dev/v1",
        "kind": "Service",
        "metadata": {
            "name": "smollm2-chat",
            "namespace": "ember-fn",
            "labels": {
                "networking.knative.dev/visibility": "cluster-local",
                "ember.dev/function": "smollm2-chat",
            },
        },
        "spec": {
            "template": {
                "metadata": {
                    "labels": {"ember.dev/function": "smollm2-chat"},
                    "annotations": {
                        "autoscaling.knative.dev/class": "kpa.autoscaling.knative.dev",
                        "autoscaling.knative.dev/metric": "concurrency",
                        "autoscaling.knative.dev/target": "6",
                        "autoscaling.knative.dev/min-scale": "0",
                        "autoscaling.knative.dev/max-scale": "4",
                        "autoscaling.knative.dev/window": "10s",
                        "ember.dev/model": "sha256:0123abcd",
                    },
                },
                "spec": {
                    "schedulerName": "ember-scheduler",
                    "containerConcurrency": 8,
                    "timeoutSeconds": 600,
                    "responseStartTimeoutSeconds": 120,
                    "idleTimeoutSeconds": 120,
                    "containers": [
                        {
                            "name": "worker",
                            "image": "ember:latest",
                            "args": ["worker", "--function", "default/smollm2-chat"],
                            "ports": [{"name": "http1", "containerPort": 8080}],
                            "env": [
                                {
                                    "name": "EMBER_REDIS_URL",
                                    "valueFrom": {"secretKeyRef": {"name": "ember-redis", "key": "url"}},
                                },
                                {"name": "EMBER_POOL_DIR", "value": "/var/run/ember"},
                            ],
                            "readinessProbe": {
                                "httpGet": {"path": "/readyz", "port": 8080},
                                "periodSeconds": 1,
                            },
                            "volumeMounts": [
                                {"name": "ember-run", "mountPath": "/var/run/ember", "readOnly": True}
                            ],
                        }
                    ],
                    "volumes": [
                        {"name": "ember-run", "hostPath": {"path": "/var/run/ember", "type": "Directory"}}
                    ],
                },
            }
        },
    }


def pod(doc: Doc) -> Doc:
    spec: Doc = doc["spec"]["template"]["spec"]
    return spec


def container(doc: Doc) -> Doc:
    first: Doc = pod(doc)["containers"][0]
    return first


def template_annotations(doc: Doc) -> Doc:
    notes: Doc = doc["spec"]["template"]["metadata"]["annotations"]
    return notes


def changed(edit: Callable[[Doc], object]) -> list[str]:
    doc = function_service()
    edit(doc)
    return validate(doc)


def test_the_rendered_function_of_cluster_md_is_valid() -> None:
    assert validate(function_service()) == []


def test_configuration_revision_and_route_are_checked_too() -> None:
    service = function_service()
    configuration = {**service, "kind": "Configuration"}
    revision: Doc = {
        "apiVersion": "serving.knative.dev/v1",
        "kind": "Revision",
        "metadata": {"name": "smollm2-chat-00001", **service["spec"]["template"]["metadata"]},
        "spec": copy.deepcopy(pod(service)),
    }
    route: Doc = {
        "apiVersion": "serving.knative.dev/v1",
        "kind": "Route",
        "metadata": {"name": "smollm2-chat"},
        "spec": {"traffic": [{"configurationName": "smollm2-chat", "percent": 100}]},
    }
    assert validate(configuration) == validate(revision) == validate(route) == []
    revision["spec"]["volumes"][0]["hostPath"]["pth"] = "/x"
    route["spec"]["traffic"][0]["weight"] = 100
    assert any("pth" in p for p in validate(revision))
    assert any("weight" in p for p in validate(route))


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        # strict CRD schema: unknown fields where the schema does not preserve them
        (lambda d: d["spec"].update(tempalte={}), "'tempalte' was unexpected"),
        (lambda d: container(d).update(imagePullPolicyy="Always"), "imagePullPolicyy"),
        (lambda d: container(d)["ports"][0].update(hostPort=80), "hostPort"),
        (lambda d: pod(d).update(containerConcurrency="8"), "'8' is not of type 'integer'"),
        (lambda d: pod(d).pop("containers"), "'containers' is a required property"),
        # inside fields the CRD preserves whole: checked as a Kubernetes PodSpec
        (lambda d: pod(d)["volumes"][0]["hostPath"].update(pth="/x"), "pth"),
        (lambda d: pod(d)["volumes"][0]["hostPath"].pop("path"), "'path' is a required property"),
        # metadata as ObjectMeta, names as DNS-1035 labels
        (lambda d: d["metadata"].update(lables={}), "lables"),
        (lambda d: d["metadata"].update(name="9lives"), "DNS-1035"),
    ],
)
def test_schema_violations_are_caught(edit: Callable[[Doc], object], expected: str) -> None:
    problems = changed(edit)
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda d: container(d)["volumeMounts"][0].pop("readOnly"), "readOnly: must be true for a hostPath"),
        (lambda d: container(d)["volumeMounts"][0].update(readOnly=False), "readOnly: must be true"),
        (lambda d: container(d)["volumeMounts"][0].update(name="other"), "no volume named 'other'"),
        (lambda d: container(d).pop("volumeMounts"), "'ember-run' is not mounted"),
        (lambda d: container(d)["volumeMounts"][0].update(mountPath="/var"), "'/var' is reserved"),
        (lambda d: container(d)["readinessProbe"]["httpGet"].update(port=9000), "not the serving port 8080"),
        (lambda d: container(d).update(livenessProbe={"tcpSocket": {"port": 81}}), "not the serving port"),
        (lambda d: container(d)["ports"].append({"containerPort": 8081}), "at most one port"),
        (lambda d: container(d)["ports"][0].update(name="http"), "'http' is not http1, h2c or empty"),
        (lambda d: container(d)["ports"][0].update(containerPort=8012), "8012 is reserved"),
        (lambda d: container(d)["env"].append({"name": "K_SERVICE", "value": "x"}), "K_SERVICE is reserved"),
        (
            lambda d: template_annotations(d).update({"autoscaling.knative.dev/window": "5s"}),
            "outside 6s..1h",
        ),
        (
            lambda d: template_annotations(d).update({"autoscaling.knative.dev/window": "61m"}),
            "outside 6s..1h",
        ),
        (
            lambda d: template_annotations(d).update({"autoscaling.knative.dev/window": "10"}),
            "not a Go duration",
        ),
        (
            lambda d: template_annotations(d).update({"autoscaling.knative.dev/window": "6500ms"}),
            "whole seconds",
        ),
        (lambda d: template_annotations(d).update({"autoscaling.knative.dev/min-scale": "5"}), "above"),
        (
            lambda d: d["metadata"].update(annotations={"autoscaling.knative.dev/window": "10s"}),
            "autoscaling annotations belong in spec.template.metadata.annotations",
        ),
        (
            lambda d: template_annotations(d).update({"autoscaling.knative.dev/max-scale": "-1"}),
            "non-negative",
        ),
        (lambda d: pod(d).update(timeoutSeconds=601), "601 is outside 0..600"),
        (lambda d: pod(d).update(timeoutSeconds=100), "responseStartTimeoutSeconds: 120 is outside 0..100"),
        (lambda d: pod(d).update(idleTimeoutSeconds=700), "idleTimeoutSeconds: 700 is outside 0..600"),
        (lambda d: pod(d).update(containerConcurrency=1001), "1001 is outside 0..1000"),
        (lambda d: pod(d)["containers"].append({"image": "x", "ports": [{"containerPort": 9}]}), "only one"),
    ],
)
def test_webhook_rules_are_caught(edit: Callable[[Doc], object], expected: str) -> None:
    problems = changed(edit)
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize(
    ("edit", "flag"),
    [
        (lambda d: pod(d).update(runtimeClassName="nvidia"), "kubernetes.podspec-runtimeclassname"),
        (
            lambda d: pod(d).update(tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists"}]),
            "tolerations",
        ),
        (lambda d: pod(d).update(nodeSelector={"gpu": "yes"}), "kubernetes.podspec-nodeselector"),
        (lambda d: pod(d).update(hostPID=True), "kubernetes.podspec-hostpid"),
        (lambda d: pod(d).update(hostIPC=True), "kubernetes.podspec-hostipc"),
        (lambda d: pod(d).update(affinity={"nodeAffinity": {}}), "kubernetes.podspec-affinity"),
        (lambda d: pod(d).update(priorityClassName="high"), "kubernetes.podspec-priorityclassname"),
        (lambda d: pod(d).update(securityContext={"runAsUser": 1}), "kubernetes.podspec-securitycontext"),
        (
            lambda d: container(d)["env"].append(
                {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
            ),
            "kubernetes.podspec-fieldref",
        ),
    ],
)
def test_feature_gated_fields_need_their_flag_in_the_shipped_config_features(
    edit: Callable[[Doc], object], flag: str
) -> None:
    problems = changed(edit)
    assert any(flag in p and "needs Knative feature flag" in p for p in problems), problems


def test_the_shipped_flags_are_what_the_function_pod_uses_and_no_more() -> None:
    """hostPath and schedulerName pass only because deploy/knative/config-features.yaml enables them."""
    without = {**shipped_features()}
    without["kubernetes.podspec-volumes-hostpath"] = "disabled"
    without["kubernetes.podspec-schedulername"] = "disabled"
    problems = validate(function_service(), features=without)
    assert sorted(p.split("needs Knative feature flag ")[1] for p in problems) == [
        "kubernetes.podspec-schedulername (not enabled)",
        "kubernetes.podspec-volumes-hostpath (not enabled)",
    ]
    enabled = {k for k, v in shipped_features().items() if v == "enabled"}
    assert enabled - set(reference().features) == set()  # the patch names only real flags
    assert enabled - {k for k, v in reference().features.items() if v == "enabled"} == {
        "kubernetes.podspec-volumes-hostpath",
        "kubernetes.podspec-schedulername",
    }


def test_multi_container_and_emptydir_follow_their_defaults() -> None:
    doc = function_service()
    pod(doc)["containers"].append(
        {"name": "side", "image": "x", "volumeMounts": [{"name": "s", "mountPath": "/s"}]}
    )
    pod(doc)["volumes"].append({"name": "s", "emptyDir": {}})  # writable: emptyDir may be
    assert validate(doc) == []
    off = {
        **shipped_features(),
        "multi-container": "disabled",
        "kubernetes.podspec-volumes-emptydir": "disabled",
    }
    problems = validate(doc, features=off)
    assert any("multi-container" in p for p in problems)
    assert any("kubernetes.podspec-volumes-emptydir" in p for p in problems)


def test_built_in_kinds_are_checked_strictly() -> None:
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "data": {"a": "b"}}
    assert validate(config_map) == []
    assert validate({**config_map, "dta": {}}) != []
    assert validate({**config_map, "data": {"a": 1}}) != []
    assert any("no Kubernetes" in p for p in validate({**config_map, "apiVersion": "example.com/v9"}))
    assert validate([]) == ["a manifest document is a mapping, not list"]  # type: ignore[arg-type]


def test_strict_rejects_unknown_fields_only_where_the_schema_does_not_preserve_them() -> None:
    schema = {
        "type": "object",
        "properties": {
            "kept": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            "closed": {"type": "object", "properties": {"a": {"type": "string"}}},
            "map": {"type": "object", "additionalProperties": {"type": "string"}},
        },
    }
    out = strict(schema)
    assert out["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["kept"]
    assert out["properties"]["closed"]["additionalProperties"] is False
    assert out["properties"]["map"]["additionalProperties"] == {"type": "string"}


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("10s", 10.0),
        ("1m30s", 90.0),
        ("1h", 3600.0),
        ("1.5m", 90.0),
        ("500ms", 0.5),
        ("0", 0.0),
        ("-2s", -2.0),
    ],
)
def test_go_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "10", "s", "1x", "1s ", "1 s", "x" * 100])
def test_not_go_durations(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)
