"""The HTTP front door: function CRUD, invocation (invoke + OpenAI), cluster view, metrics.

Functions are deployed from YAML or JSON (validated against the function spec, defaults
filled in, the model registered) into the cluster state in Redis. Invocations go through
:class:`gateway.proxy.Invoker` to an instance chosen by the scheduler's router. Every error
is a JSON ``{"error": {"type", "message"}}`` mapped to its HTTP status in one place
(:data:`ERROR_STATUS`): 4xx for client mistakes; 503 (with ``Retry-After``) when a request
is rejected early or Redis is away; 502 when an instance fails. An API key, when
configured, is required as ``Authorization: Bearer KEY`` on every route but ``/healthz``
(liveness) and ``/readyz`` (readiness of Redis, pools and a warm worker: see
:mod:`gateway.health`; it reveals nothing beyond ready / not ready per component).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import Receive, Scope

from gateway.fastpath import InvocationFastPath, read_body
from gateway.health import Readiness, readyz
from gateway.metrics import Metrics
from gateway.proxy import BadRequest, InvocationError, Invoker, request_model
from scheduler.errors import FunctionNotFound, SchedulerError, StateConflict, StateUnavailable
from scheduler.router import Rejected, Router, StartFailed
from scheduler.spec import SpecError, parse_function, parse_function_yaml
from scheduler.state import ClusterState


class Unauthorized(Exception):
    """Missing or wrong API key."""


class ModelSourceError(Exception):
    """The function's model source cannot be registered (HTTP 400 naming spec.model.source)."""


ERROR_STATUS: dict[type[Exception], tuple[int, str]] = {
    SpecError: (400, "invalid_function_spec"),
    ModelSourceError: (400, "invalid_model_source"),
    BadRequest: (400, "invalid_request_error"),
    RequestValidationError: (400, "invalid_request_error"),
    Unauthorized: (401, "authentication_error"),
    FunctionNotFound: (404, "function_not_found"),
    StateConflict: (409, "conflict"),
    InvocationError: (502, "instance_failed"),
    Rejected: (503, "rejected"),
    StartFailed: (503, "instance_start_failed"),
    StateUnavailable: (503, "state_unavailable"),
}

# (source, dtype) -> model record {id, dir, weight_bytes}; raises ModelSourceError
Registrar = Callable[[str, str], Awaitable[dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    api_key: str | None = None  # required when the gateway listens beyond loopback
    logs_dir: Path | None = None  # where instances' logs are (EMBER_HOME/logs)

    def __post_init__(self) -> None:
        if self.api_key is not None and len(self.api_key) < 16:
            raise ValueError("an API key must be at least 16 characters")


@dataclass
class Serving:
    """The invocation side of a gateway: model registration, routing, forwarding."""

    register: Registrar
    router: Router
    invoker: Invoker
    metrics: Metrics
    background: list[Callable[[], Coroutine[Any, Any, None]]] = field(
        default_factory=list
    )  # run while serving
    readiness: Readiness | None = None  # /readyz's checks beyond Redis (pools, warm workers)


log = logging.getLogger("ember.gateway")

# Errors that are the client's or the cluster's, mapped to HTTP without a traceback in the log.
HANDLED: tuple[type[Exception], ...] = (
    SpecError, ModelSourceError, RequestValidationError, Unauthorized, SchedulerError,
)  # fmt: skip


def create_app(
    state: ClusterState, config: GatewayConfig | None = None, serving: Serving | None = None
) -> FastAPI:
    """The gateway's FastAPI app over ``state``; without ``serving`` it only manages functions."""
    config = config or GatewayConfig()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        import asyncio

        tasks: list[asyncio.Task[None]] = [
            asyncio.create_task(job()) for job in (serving.background if serving else [])
        ]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    app = FastAPI(title="Ember", version="0.1.0", lifespan=lifespan)

    def error(exc: Exception) -> JSONResponse:
        status, kind = next(
            (v for cls, v in ERROR_STATUS.items() if isinstance(exc, cls)), (500, "internal_error")
        )
        message = (
            "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            if isinstance(exc, RequestValidationError)
            else str(exc)
        )
        # Messages may quote input, and JSON's \ud800 escapes can carry lone surrogates, which
        # the response's UTF-8 cannot: escape them rather than fail with a 500.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        headers = (
            {"retry-after": str(max(1, math.ceil(exc.retry_after_s)))} if isinstance(exc, Rejected) else None
        )
        return JSONResponse(
            {"error": {"type": kind, "message": message}}, status_code=status, headers=headers
        )

    for cls in HANDLED:
        app.add_exception_handler(cls, lambda _req, exc: error(exc))
    # Anything else is a bug: still a JSON error body (Starlette logs the traceback).
    app.add_exception_handler(Exception, lambda _req, exc: error(exc))

    def check_key(authorization: str) -> None:
        """Raise Unauthorized unless the ``Authorization`` header carries the API key (if any)."""
        if config.api_key is None:
            return
        token = authorization[7:] if authorization.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), config.api_key.encode()):
            raise Unauthorized("missing or wrong API key (send Authorization: Bearer KEY)")

    async def authorize(request: Request) -> None:
        check_key(request.headers.get("authorization", ""))

    auth = [Depends(authorize)]

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    default_readiness = Readiness(redis_ping=state.r.ping)

    @app.get("/readyz", include_in_schema=False)
    async def ready() -> Response:
        return await readyz(serving.readiness if serving and serving.readiness else default_readiness)

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
        handler = spec.spec.handler
        if handler != "default":
            path = Path(handler.rpartition(":")[0])
            if not path.is_absolute() or not path.is_file():
                raise SpecError(
                    f"spec.handler: {path} is not a file on the server (give an absolute path; "
                    f"`ember deploy -f` resolves it against the YAML's directory)"
                )
        model = None
        if serving is not None:
            model = await serving.register(spec.spec.model.source, spec.spec.model.dtype)
        document = spec.to_document()
        try:
            previous: dict[str, Any] | None = await asyncio.to_thread(state.get_record, spec.name)
        except FunctionNotFound:
            previous = None
        await asyncio.to_thread(state.put_function, spec.name, document, model)
        if serving is not None:
            serving.invoker.forget(spec.name)
            if previous is not None and (previous["spec"], previous.get("model")) != (document, model):
                await serving.router.retire(spec.name)  # running instances serve the old version
        return document

    # Handlers that only read Redis are plain functions: FastAPI runs them in its thread pool,
    # so a Redis restart (retried for seconds) never stalls the event loop and its streams.
    @app.get("/v1/functions", dependencies=auth)
    def list_functions() -> dict[str, Any]:
        return {"functions": list(state.list_functions().values())}

    @app.get("/v1/functions/{name}", dependencies=auth)
    def describe(name: str) -> dict[str, Any]:
        return state.get_function(name)

    @app.delete("/v1/functions/{name}", status_code=204, dependencies=auth)
    async def delete(name: str) -> Response:
        await asyncio.to_thread(state.delete_function, name)
        if serving is not None:
            serving.invoker.forget(name)
            await serving.router.retire(name)
        return Response(status_code=204)

    @app.get("/v1/functions/{name}/logs", dependencies=auth)
    def logs(name: str, tail: int = 200) -> PlainTextResponse:
        state.get_function(name)  # 404 for unknown functions
        directory = (config.logs_dir / "functions" / name) if config.logs_dir else None
        if directory is None or not directory.is_dir():
            return PlainTextResponse("")
        files = sorted(directory.glob("instance-*.log"), key=lambda p: p.stat().st_mtime)
        lines: list[str] = []
        for path in files:
            text = path.read_text(errors="replace").splitlines()
            lines += [f"[{path.stem}] {line}" for line in text]
        return PlainTextResponse("\n".join(lines[-max(1, min(tail, 10_000)) :]) + "\n")

    @app.get("/v1/models", dependencies=auth)
    def models() -> dict[str, Any]:
        now = int(time.time())
        data = [
            {"id": n, "object": "model", "created": now, "owned_by": "ember"} for n in state.list_functions()
        ]
        return {"object": "list", "data": data}

    @app.get("/v1/cluster", dependencies=auth)
    def cluster() -> dict[str, Any]:
        records = state.list_records()
        return {
            "devices": state.devices(),
            "functions": {
                name: {
                    "model": record.get("model"),
                    "instances": [
                        {
                            "id": i.instance_id,
                            "state": i.state,
                            "device": i.device,
                            "in_flight": i.in_flight,
                            "url": i.url,
                            **i.details,
                        }
                        for i in state.instances(name)
                    ],
                }
                for name, record in records.items()
            },
        }

    if serving is None:
        return app
    invoker = serving.invoker

    @app.get("/metrics", dependencies=auth)
    def metrics() -> Response:
        return Response(serving.metrics.render(), media_type="text/plain; version=0.0.4")

    async def relay(body: bytes, path: str, label: str, name: str | None, timeout: str | None) -> Response:
        """Relay one invocation; OpenAI routes name the function in the body's ``model``."""
        if name is None:
            name, _ = request_model(body)
        else:
            try:
                json.loads(body)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise BadRequest(f"the event is not valid JSON: {exc}") from None
        return await invoker.forward(name, path, body, label, timeout)

    async def forward(request: Request, path: str, label: str, name: str | None = None) -> Response:
        return await relay(await request.body(), path, label, name, request.headers.get("x-ember-timeout"))

    async def fast_forward(
        scope: Scope, receive: Receive, path: str, label: str, name: str | None
    ) -> Response | None:
        """:func:`forward` without FastAPI's routing, dependency solving and request objects
        (see :class:`gateway.fastpath.InvocationFastPath`); None if the client hung up."""
        try:
            headers = dict(scope["headers"])
            check_key(headers.get(b"authorization", b"").decode("latin-1"))
            body = await read_body(receive)
            if body is None:
                return None
            timeout = headers.get(b"x-ember-timeout")
            return await relay(body, path, label, name, timeout.decode("latin-1") if timeout else None)
        except Exception as exc:
            if not isinstance(exc, HANDLED):
                log.exception("invocation failed")
            return error(exc)

    app.add_middleware(InvocationFastPath, forward=fast_forward)

    @app.post("/v1/functions/{name}/invoke", dependencies=auth)
    async def invoke(name: str, request: Request) -> Response:
        return await forward(request, "/invoke", "invoke", name)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions", "chat")

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions", "completions")

    return app
