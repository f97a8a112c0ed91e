"""A Knative Service's readiness from its status, as the Kubernetes API returns the object
(shapes from Knative Serving 1.x: ``kubectl get ksvc NAME -o json``), bounded and defensive."""

from __future__ import annotations

import copy
import json
from typing import Any

from scheduler.knative.status import MAX_CONDITIONS, MAX_TEXT, ServiceStatus

READY_SERVICE = json.loads(
    """
{
  "apiVersion": "serving.knative.dev/v1",
  "kind": "Service",
  "metadata": {
    "annotations": {
      "ember.dev/function-id": "smollm2-chat",
      "serving.knative.dev/creator": "system:serviceaccount:ember:ember-gateway",
      "serving.knative.dev/lastModifier": "system:serviceaccount:ember:ember-gateway"
    },
    "creationTimestamp": "2025-01-07T10:12:03Z",
    "generation": 2,
    "labels": {"networking.knative.dev/visibility": "cluster-local", "ember.dev/function": "smollm2-chat"},
    "name": "smollm2-chat",
    "namespace": "ember-fn",
    "resourceVersion": "184467",
    "uid": "6c1b2f0e-9a53-4c1e-9d5f-3f4b7f0f2a11"
  },
  "spec": {"template": {"spec": {"containerConcurrency": 8, "containers": [{"image": "ember:0.1.0"}]}}},
  "status": {
    "address": {"url": "http://smollm2-chat.ember-fn.svc.cluster.local"},
    "conditions": [
      {"lastTransitionTime": "2025-01-07T10:14:41Z", "status": "True", "type": "ConfigurationsReady"},
      {"lastTransitionTime": "2025-01-07T10:14:42Z", "status": "True", "type": "Ready"},
      {"lastTransitionTime": "2025-01-07T10:14:42Z", "status": "True", "type": "RoutesReady"}
    ],
    "latestCreatedRevisionName": "smollm2-chat-00002",
    "latestReadyRevisionName": "smollm2-chat-00002",
    "observedGeneration": 2,
    "traffic": [{"latestRevision": true, "percent": 100, "revisionName": "smollm2-chat-00002"}],
    "url": "http://smollm2-chat.ember-fn.svc.cluster.local"
  }
}
"""
)


def with_status(**changes: Any) -> dict[str, Any]:
    obj = copy.deepcopy(READY_SERVICE)
    obj["status"].update(changes)
    return obj


def test_a_ready_service() -> None:
    status = ServiceStatus.from_object(READY_SERVICE)
    assert (status.service, status.namespace, status.found, status.ready) == (
        "smollm2-chat",
        "ember-fn",
        True,
        "True",
    )
    doc = status.to_document()
    assert doc["latestReadyRevisionName"] == "smollm2-chat-00002"
    assert doc["url"] == "http://smollm2-chat.ember-fn.svc.cluster.local"
    assert doc["conditions"] == {
        "ConfigurationsReady": {"status": "True"},
        "Ready": {"status": "True"},
        "RoutesReady": {"status": "True"},
    }


def test_a_revision_that_fails_is_not_ready_and_says_why() -> None:
    message = 'Revision "smollm2-chat-00003" failed with message: Back-off pulling image "ember:0.2.0".'
    failed = with_status(
        conditions=[
            {
                "type": "ConfigurationsReady",
                "status": "False",
                "reason": "RevisionFailed",
                "message": message,
            },
            {"status": "False", "type": "Ready", "reason": "RevisionFailed", "message": message},
            {"status": "True", "type": "RoutesReady"},
        ],
        latestCreatedRevisionName="smollm2-chat-00003",
    )
    status = ServiceStatus.from_object(failed)
    assert (status.ready, status.reason, status.message) == ("False", "RevisionFailed", message)
    assert status.latest_ready_revision == "smollm2-chat-00002"  # traffic stays on the last good one
    assert status.latest_created_revision == "smollm2-chat-00003"


def test_a_service_still_reconciling_is_unknown() -> None:
    rolling = with_status(
        conditions=[
            {"status": "Unknown", "type": "ConfigurationsReady"},
            {"status": "Unknown", "type": "Ready", "reason": "RevisionMissing"},
            {"status": "True", "type": "RoutesReady"},
        ]
    )
    assert ServiceStatus.from_object(rolling).ready == "Unknown"


def test_a_status_of_an_older_generation_is_not_taken_for_the_new_one() -> None:
    stale = copy.deepcopy(READY_SERVICE)
    stale["metadata"]["generation"] = 3  # redeployed; Knative has not reconciled it yet
    status = ServiceStatus.from_object(stale)
    assert (status.ready, status.reason) == ("Unknown", "OutOfDate")
    assert status.conditions["Ready"].status == "True"  # what Knative said, still shown
    just_created = {"metadata": {"name": "x", "namespace": "ember-fn", "generation": 1}}
    assert ServiceStatus.from_object(just_created).ready == "Unknown"


def test_what_the_api_returns_is_bounded_and_malformed_fields_are_unknown() -> None:
    noisy = with_status(
        conditions=[{"type": f"C{i}", "status": "True", "message": "m" * 10_000} for i in range(100)]
        + [{"type": "Ready", "status": "True"}]
    )
    status = ServiceStatus.from_object(noisy)
    assert len(status.conditions) == MAX_CONDITIONS
    assert all(len(c.message) == MAX_TEXT for c in status.conditions.values())
    assert status.ready == "Unknown"  # the Ready condition was past the bound: not seen
    garbage = with_status(conditions=[{"type": "Ready", "status": "yes"}, "x", {"status": "True"}])
    assert ServiceStatus.from_object(garbage).ready == "Unknown"
    assert ServiceStatus.from_object({"status": {"conditions": "Ready"}}).ready == "Unknown"
    assert ServiceStatus.from_object({}).found is True  # an object was returned, however odd


def test_absent_and_unreadable_services() -> None:
    assert ServiceStatus.not_found("chat", "ember-fn").to_document() == {
        "service": "chat",
        "namespace": "ember-fn",
        "found": False,
        "ready": "False",
        "reason": "NotFound",
        "message": "no Service chat in ember-fn",
    }
    away = ServiceStatus.unknown("chat", "ember-fn", "StatusUnavailable", "x" * 5000, None).to_document()
    assert "found" not in away and away["ready"] == "Unknown" and len(away["message"]) == MAX_TEXT
