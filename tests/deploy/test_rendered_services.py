"""Rendered function Services pass the Knative CRD schema and the webhook rules Ember relies on,
with exactly the features the shipped ``config-features`` patch enables."""

from __future__ import annotations

from typing import Any

import pytest

from scheduler.knative.config import KnativeConfig
from scheduler.knative.handler_code import HandlerCode
from scheduler.knative.render import render_record
from tests.deploy.knative_rules import shipped_features, validate
from tests.deploy.knative_schema import reference
from tests.scheduler.test_knative_render import record

CPU_FUNCTIONS: list[dict[str, Any]] = [
    {},
    {"namespace": "team-a"},
    {"scaling": {"minScale": 1, "maxScale": 8, "concurrency": 1000, "keepAlive": "59m"}},
    {"scaling": {"keepAlive": "2s"}},  # below Knative's 6 s window
    {"slo": {"ttft": "2s", "tpot": "200ms"}, "maxTokens": 2048},
    {"model": None},  # not registered yet: no model annotations
]


@pytest.mark.parametrize("body", CPU_FUNCTIONS)
def test_rendered_cpu_service_and_secret_are_valid(body: dict[str, Any]) -> None:
    body = dict(body)
    namespace = body.pop("namespace", None)
    kwargs: dict[str, Any] = {"namespace": namespace, **body}
    if "model" in body:
        kwargs["model"] = body["model"]
    rendered = render_record(record(**kwargs), KnativeConfig(image="ember:VERSION"))
    assert validate(rendered.service) == []
    assert validate(rendered.secret) == []


def test_rendered_gpu_service_needs_the_runtimeclass_flag_the_patch_documents() -> None:
    rendered = render_record(record(device="cuda"), KnativeConfig())
    problems = validate(rendered.service)
    assert problems and all("runtimeclassname" in p.lower() for p in problems), problems
    features = {**shipped_features(), "kubernetes.podspec-runtimeclassname": "enabled"}
    assert validate(rendered.service, features=features) == []


def test_a_custom_handlers_configmap_and_its_mount_are_valid_without_a_feature_flag() -> None:
    """configMap volumes are not gated by any Knative feature flag (the Revision CRD marks
    hostPath, emptyDir, PVC, CSI... "accessible behind a feature flag", not configMap), so the
    shipped config-features needs nothing more; the ConfigMap itself passes kubernetes-validate."""
    code = HandlerCode("hello.py", "handler", "def handler(event, context):\n    return event\n")
    for namespace in (None, "team-a"):
        rendered = render_record(
            record(namespace=namespace, handler="hello.py:handler"), KnativeConfig(), code
        )
        assert rendered.config_map is not None
        assert validate(rendered.config_map) == []
        assert validate(rendered.service) == []
        # With Knative's default flags alone, the code adds no problem to the default handler's.
        plain = render_record(record(namespace=namespace), KnativeConfig())
        defaults = reference().features
        assert validate(rendered.service, features=defaults) == validate(plain.service, features=defaults)
