"""The HTTP front door: function CRUD, model list, cluster view, health.

Functions are deployed from YAML or JSON (validated against the function spec, defaults
filled in) into the cluster state in Redis. Every error is a JSON
``{"error": {"type", "message"}}`` mapped to its HTTP status in one place
(:data:`ERROR_STATUS`); a 5xx is a bug or an unreachable Redis. An API key, when
configured, is required as ``Authorization: Bearer KEY`` on every route but ``/healthz``.
Invocation routing joins this app in the serving work.
"""

from __future__ import annotations

import hmac
import json
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from scheduler.errors import FunctionNotFound, SchedulerError, StateConflict, StateUnavailable
from scheduler.spec import SpecError, parse_function, parse_function_yaml
from scheduler.state import ClusterState


class Unauthorized(Exception):
    """Missing or wrong API key."""


ERROR_STATUS: dict[type[Exception], tuple[int, str]] = {
    SpecError: (400, "invalid_function_spec"),
    RequestValidationError: (400, "invalid_request_error"),
    Unauthorized: (401, "authentication_error"),
    FunctionNotFound: (404, "function_not_found"),
    StateConflict: (409, "conflict"),
    StateUnavailable: (503, "state_unavailable"),
}


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    api_key: str | None = None  # required when the gateway listens beyond loopback

    def __post_init__(self) -> None:
        if self.api_key is not None and len(self.api_key) < 16:
            raise ValueError("an API key must be at least 16 characters")


def create_app(state: ClusterState, config: GatewayConfig | None = None) -> FastAPI:
    """The gateway's FastAPI app over ``state``."""
    config = config or GatewayConfig()
    app = FastAPI(title="Ember", version="0.1.0")

    def error(exc: Exception) -> JSONResponse:
        status, kind = next(
            (v for cls, v in ERROR_STATUS.items() if isinstance(exc, cls)), (500, "internal_error")
        )
        message = (
            "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            if isinstance(exc, RequestValidationError)
            else str(exc)
        )
        return JSONResponse({"error": {"type": kind, "message": message}}, status_code=status)

    for cls in (SpecError, RequestValidationError, Unauthorized, SchedulerError):
        app.add_exception_handler(cls, lambda _req, exc: error(exc))

    async def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), config.api_key.encode()):
            raise Unauthorized("missing or wrong API key (send Authorization: Bearer KEY)")

    auth = [Depends(authorize)]

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/functions", status_code=201, dependencies=auth)
    async def deploy(request: Request) -> dict[str, Any]:
        raw = (await request.body()).decode("utf-8", errors="replace")
        if "json" in request.headers.get("content-type", ""):
            try:
                spec = parse_function(json.loads(raw))
            except json.JSONDecodeError as exc:
                raise SpecError(f"malformed JSON: {exc}") from None
        else:
            spec = parse_function_yaml(raw)
        document = spec.to_document()
        state.put_function(spec.name, document)
        return document

    @app.get("/v1/functions", dependencies=auth)
    async def list_functions() -> dict[str, Any]:
        return {"functions": list(state.list_functions().values())}

    @app.get("/v1/functions/{name}", dependencies=auth)
    async def describe(name: str) -> dict[str, Any]:
        return state.get_function(name)

    @app.delete("/v1/functions/{name}", status_code=204, dependencies=auth)
    async def delete(name: str) -> Response:
        state.delete_function(name)
        return Response(status_code=204)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        now = int(time.time())
        data = [
            {"id": n, "object": "model", "created": now, "owned_by": "ember"} for n in state.list_functions()
        ]
        return {"object": "list", "data": data}

    @app.get("/v1/cluster", dependencies=auth)
    async def cluster() -> dict[str, Any]:
        functions = state.list_functions()
        return {
            "devices": state.devices(),
            "functions": {
                name: [
                    {"id": i.instance_id, "state": i.state, "device": i.device, "in_flight": i.in_flight}
                    for i in state.instances(name)
                ]
                for name in functions
            },
        }

    return app
