"""A Knative Service's readiness, read from its ``status`` as the Kubernetes API returns it.

Knative's Service reconciler reports three conditions: ``ConfigurationsReady`` (the latest
revision was created and its pods became ready), ``RoutesReady`` (traffic reaches it) and
``Ready`` (both). Each is ``"True"``, ``"False"`` (with a reason and message: an image that
cannot be pulled, a webhook rule, ...) or ``"Unknown"`` (still reconciling). A status whose
``observedGeneration`` is behind ``metadata.generation`` describes a previous spec: then the
Service is reported ``Unknown`` (``OutOfDate``) whatever its conditions say, so a redeploy is
never shown ready before Knative has seen it. What is read from the API is bounded (strings
truncated, at most :data:`MAX_CONDITIONS` conditions) before it is shown.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MAX_TEXT = 1024  # characters of a reason, message, revision name or URL kept
MAX_CONDITIONS = 16
STATES = ("True", "False", "Unknown")


def _text(value: Any) -> str:
    return value[:MAX_TEXT] if isinstance(value, str) else ""


def _state(value: Any) -> str:
    return value if value in STATES else "Unknown"


@dataclass(frozen=True, slots=True)
class Condition:
    type: str
    status: str  # True | False | Unknown
    reason: str = ""
    message: str = ""

    def to_document(self) -> dict[str, str]:
        doc = {"status": self.status}
        if self.reason:
            doc["reason"] = self.reason
        if self.message:
            doc["message"] = self.message
        return doc


@dataclass(frozen=True, slots=True)
class ServiceStatus:
    """What ``ember describe`` and ``ember list`` show of a function's Knative Service."""

    service: str
    namespace: str
    found: bool | None  # None: not known (the API could not be asked)
    ready: str  # True | False | Unknown
    reason: str = ""
    message: str = ""
    conditions: dict[str, Condition] = field(default_factory=dict)
    latest_ready_revision: str | None = None
    latest_created_revision: str | None = None
    url: str | None = None

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> ServiceStatus:
        """The readiness of a Service object (``GET .../services/NAME``'s body)."""
        metadata = obj.get("metadata")
        metadata = metadata if isinstance(metadata, Mapping) else {}
        status = obj.get("status")
        status = status if isinstance(status, Mapping) else {}
        conditions: dict[str, Condition] = {}
        raw = status.get("conditions")
        for c in (raw if isinstance(raw, list) else [])[:MAX_CONDITIONS]:
            if isinstance(c, Mapping) and isinstance(c.get("type"), str):
                kind = _text(c["type"])
                conditions[kind] = Condition(
                    kind, _state(c.get("status")), _text(c.get("reason")), _text(c.get("message"))
                )
        name, namespace = _text(metadata.get("name")), _text(metadata.get("namespace"))
        generation, observed = metadata.get("generation"), status.get("observedGeneration")
        ready = conditions.get("Ready")
        revisions = (
            _text(status.get("latestReadyRevisionName")) or None,
            _text(status.get("latestCreatedRevisionName")) or None,
        )
        url = _text(status.get("url")) or None
        if isinstance(generation, int) and (not isinstance(observed, int) or observed < generation):
            message = f"Knative has not yet reconciled generation {generation} (observed: {observed})"
            return cls(name, namespace, True, "Unknown", "OutOfDate", message, conditions, *revisions, url)
        if ready is None:
            return cls(name, namespace, True, "Unknown", "NoReadyCondition", "", conditions, *revisions, url)
        return cls(
            name, namespace, True, ready.status, ready.reason, ready.message, conditions, *revisions, url
        )

    @classmethod
    def not_found(cls, service: str, namespace: str) -> ServiceStatus:
        """No such Service (never applied, or deleted by hand)."""
        return cls(service, namespace, False, "False", "NotFound", f"no Service {service} in {namespace}")

    @classmethod
    def unknown(
        cls, service: str, namespace: str, reason: str, message: str, found: bool | None
    ) -> ServiceStatus:
        """A Service whose state cannot be read (the API is away, or there is no cluster)."""
        return cls(service, namespace, found, "Unknown", reason, message[:MAX_TEXT])

    def to_document(self) -> dict[str, Any]:
        """The ``status.knative`` block of a function's ``describe`` (and ``list``) document."""
        doc: dict[str, Any] = {"service": self.service, "namespace": self.namespace}
        if self.found is not None:
            doc["found"] = self.found
        doc["ready"] = self.ready
        if self.reason:
            doc["reason"] = self.reason
        if self.message:
            doc["message"] = self.message
        if self.conditions:
            doc["conditions"] = {k: c.to_document() for k, c in self.conditions.items()}
        if self.latest_ready_revision:
            doc["latestReadyRevisionName"] = self.latest_ready_revision
        if self.latest_created_revision:
            doc["latestCreatedRevisionName"] = self.latest_created_revision
        if self.url:
            doc["url"] = self.url
        return doc
