"""Typed errors of the Knative backend (HTTP statuses in :mod:`gateway.errors`).

A function spec Knative cannot express is a :class:`scheduler.spec.SpecError` (400), raised
by the renderer before anything is stored or applied; these are the backend's own failures.
"""

from __future__ import annotations

from scheduler.errors import SchedulerError


class KnativeError(SchedulerError):
    """The Kubernetes API (or the manifest directory) refused an object (HTTP 502)."""

    code = "knative_error"


class KnativeUnavailable(KnativeError):
    """The Kubernetes API cannot be reached or its credentials are missing (HTTP 503)."""

    code = "knative_unavailable"


class ServiceConflict(KnativeError):
    """An object of the rendered name exists and belongs to another function, or to nobody
    Ember knows (HTTP 409): it is never overwritten or deleted."""

    code = "knative_conflict"
