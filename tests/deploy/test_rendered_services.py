"""Rendered function Services pass the Knative CRD schema and the webhook rules Ember relies on,
with exactly the features the shipped ``config-features`` patch enables."""

from __future__ import annotations

from typing import Any

import pytest

from scheduler.knative.config import KnativeConfig
from scheduler.knative.render import render_record
from tests.deploy.knative_rules import shipped_features, validate
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
