"""Typed errors of the function runtime (registration, engine, workers)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.responses import JSONResponse


class EmberRuntimeError(Exception):
    """Base of the runtime's errors; ``code`` is the stable error type used on the wire."""

    code = "runtime_error"


class UnknownSourceError(EmberRuntimeError, ValueError):
    """A model source string does not name a file or package resource that exists."""

    code = "unknown_model_source"


class RegistrationError(EmberRuntimeError):
    """A model could not be registered (unsupported architecture, bad file, ...)."""

    code = "registration_error"


class PoolLost(EmberRuntimeError):
    """The pool daemon of a worker's session died while the worker became an instance."""

    code = "pool_lost"


class LaunchError(EmberRuntimeError):
    """An instance could not be started (the worker refused its function or died)."""

    code = "launch_error"


class NoRoom(LaunchError):
    """The device's pool had no room for the model next to what other instances pin (the
    scheduler's ``NO_ROOM``: it makes room or waits, and places again)."""

    code = "no_room"


class InstanceLost(LaunchError):
    """The worker took the function and served its first requests, then exited before its
    reply (the scheduler's ``INSTANCE_LOST``: an instance that died, not a failed start; the
    waiting requests start another)."""

    code = "instance_lost"


def error_body(
    kind: str, message: str, param: str | None = None, code: str | None = None
) -> dict[str, object]:
    """The one JSON error object of the runtime's HTTP answers, OpenAI's shape: ``type`` is
    Ember's error type (``invalid_request_error`` for a client's mistake, as OpenAI's),
    ``param`` the request field at fault when one is, ``code`` a finer reason (defaults to
    ``type``). Messages may quote input, whose lone surrogates UTF-8 cannot carry: escaped."""
    safe = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": safe, "type": kind, "param": param, "code": code or kind}}


def route_error(_request: object, exc: Exception) -> JSONResponse:
    """Starlette's own errors (no such route: 404, wrong method: 405) in :func:`error_body`'s
    shape, not ``{"detail": ...}``: the ``HTTPException`` handler of every Ember app."""
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse

    assert isinstance(exc, HTTPException)
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request_error")
    return JSONResponse(error_body(kind, str(exc.detail)), status_code=exc.status_code, headers=exc.headers)
