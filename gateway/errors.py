"""The gateway's error answers: one table from error class to HTTP status, one renderer.

Every error is OpenAI's error object ``{"error": {"message", "type", "param", "code"}}``
(:func:`runtime.errors.error_body`, shared with the workers): its status comes from
:data:`ERROR_STATUS` (first match wins), its ``type`` (and ``code``) from the error class's
``code``, ``param`` from the error's ``param`` when it names a field; an error not in the
table is a bug, answered 500 ``internal_error``. 503 and 507 always carry
``Retry-After``.
"""

from __future__ import annotations

import math

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from gateway.limits import BodyTimeout, BodyTooLarge, EdgeError
from gateway.proxy import BadRequest, InvocationError
from gateway.storage import StorageFull
from gateway.tenants import Forbidden
from runtime.errors import error_body
from scheduler.errors import (
    FunctionNotFound,
    FunctionQuotaExceeded,
    Rejected,
    SchedulerError,
    StartFailed,
    StateConflict,
    StateNotWritable,
    StateUnavailable,
)
from scheduler.extender.wire import ExtenderWireError
from scheduler.knative.errors import KnativeError, KnativeUnavailable, ServiceConflict
from scheduler.spec import SpecError


class Unauthorized(Exception):
    """Missing or wrong API key."""

    code = "authentication_error"


class ModelSourceError(Exception):
    """The function's model source cannot be registered (HTTP 400 naming spec.model.source)."""

    code = "invalid_model_source"


# Error class -> HTTP status, first match wins; the wire ``type`` is the class's ``code``.
# FastAPI's RequestValidationError is answered as an EdgeError (see render_error).
ERROR_STATUS: dict[type[Exception], int] = {
    SpecError: 400,
    ModelSourceError: 400,
    BadRequest: 400,
    ExtenderWireError: 400,
    BodyTimeout: 408,
    BodyTooLarge: 413,
    EdgeError: 400,  # JSONError, a malformed query; after its subclasses above
    Unauthorized: 401,
    Forbidden: 403,
    FunctionNotFound: 404,
    # A namespace's function cap: 409, not 429 (no rate: retrying cannot succeed until a
    # function is deleted, and clients retry 429s) nor 507 (a policy, not the server's storage).
    FunctionQuotaExceeded: 409,
    StateConflict: 409,
    ServiceConflict: 409,  # the Knative Service's name is another function's (or nobody's)
    KnativeUnavailable: 503,  # the Kubernetes API cannot be reached
    KnativeError: 502,  # the Kubernetes API (or a Knative webhook) refused the object
    InvocationError: 502,
    Rejected: 503,
    StartFailed: 503,
    StateUnavailable: 503,
    StateNotWritable: 503,
    StorageFull: 507,  # a deploy's writes found the disk full (gateway.storage)
}
RETRY_AFTER_S = 1  # Retry-After of a 503/507 whose error names no delay of its own

# Errors that are the client's or the cluster's, mapped to HTTP without a traceback in the log.
HANDLED: tuple[type[Exception], ...] = (
    SpecError, ModelSourceError, RequestValidationError, Unauthorized, SchedulerError, EdgeError,
    StorageFull,
)  # fmt: skip


def render_error(exc: Exception) -> JSONResponse:
    """The JSON error response for ``exc``: status from :data:`ERROR_STATUS`, type its ``code``."""
    if isinstance(exc, RequestValidationError):
        exc = EdgeError("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))
    status = next((v for cls, v in ERROR_STATUS.items() if isinstance(exc, cls)), 500)
    kind = str(getattr(exc, "code", "internal_error")) if status != 500 else "internal_error"
    headers: dict[str, str] = {}
    if status in (503, 507):  # resource exhaustion: always say when to come back
        headers["retry-after"] = str(max(1, math.ceil(getattr(exc, "retry_after_s", RETRY_AFTER_S))))
    if isinstance(exc, BodyTooLarge | BodyTimeout):
        # The rest of the body is never read, so the connection cannot carry another
        # request: close it. (Every other error is answered after the whole body was
        # read and keeps the keep-alive connection.)
        headers["connection"] = "close"
    # error_body escapes lone surrogates (JSON's \ud800 escapes carry them into messages).
    param = getattr(exc, "param", None)
    body = error_body(kind, str(exc), param if isinstance(param, str) else None)
    return JSONResponse(body, status_code=status, headers=headers or None)
