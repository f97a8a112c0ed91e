"""Typed errors of the function runtime (registration, engine, workers)."""

from __future__ import annotations


class EmberRuntimeError(Exception):
    """Base of the runtime's errors; ``code`` is the stable error type used on the wire."""

    code = "runtime_error"


class UnknownSourceError(EmberRuntimeError, ValueError):
    """A model source string does not name a file or package resource that exists."""

    code = "unknown_model_source"


class RegistrationError(EmberRuntimeError):
    """A model could not be registered (unsupported architecture, bad file, ...)."""

    code = "registration_error"


class LaunchError(EmberRuntimeError):
    """An instance could not be started (the worker refused its function or died)."""

    code = "launch_error"
