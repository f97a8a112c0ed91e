"""The HTTP front door: function CRUD, invocation (invoke + OpenAI), cluster view, metrics.

Functions are deployed from YAML or JSON (validated against the function spec, defaults
filled in, the model registered) into the cluster state in Redis. Invocations go through
:class:`gateway.proxy.Invoker` to an instance chosen by the scheduler's router. Every error
is a JSON ``{"error": {"type", "message"}}``: its HTTP status comes from one table
(:data:`ERROR_STATUS`), its ``type`` from the error class's ``code``. 4xx for client
mistakes; 503 (with ``Retry-After``) when a request is rejected early or Redis is away or
cannot write; 502 when an instance fails. An API key, when configured, is required as
``Authorization: Bearer KEY`` on every route but ``/healthz`` (documentation included).
Request bodies are bounded in size and read time (:mod:`gateway.limits`); JSON and YAML
are parsed with depth bounds, specs off the event loop.
"""

from __future__ import annotations

import asyncio
import hmac
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

from gateway.docs import NO_OPEN_DOCS, keyed_docs
from gateway.fastpath import InvocationFastPath, read_body
from gateway.limits import BodyLimits, BodyTimeout, BodyTooLarge, EdgeError, EdgeLimits, JSONError, load_json
from gateway.metrics import Metrics
from gateway.proxy import BadRequest, InvocationError, Invoker, request_model
from scheduler.errors import (
    FunctionNotFound,
    SchedulerError,
    StateConflict,
    StateNotWritable,
    StateUnavailable,
)
from scheduler.router import Rejected, Router, StartFailed
from scheduler.spec import FunctionSpec, SpecError, parse_function, parse_function_yaml
from scheduler.state import ClusterState


class Unauthorized(Exception):
    """Missing or wrong API key."""

    code = "authentication_error"


class ModelSourceError(Exception):
    """The function's model source cannot be registered (HTTP 400 naming spec.model.source)."""

    code = "invalid_model_source"


# Error class -> HTTP status, first match wins; the wire ``type`` is the class's ``code``.
# FastAPI's RequestValidationError is answered as an EdgeError (see error() below).
ERROR_STATUS: dict[type[Exception], int] = {
    SpecError: 400,
    ModelSourceError: 400,
    BadRequest: 400,
    BodyTimeout: 408,
    BodyTooLarge: 413,
    EdgeError: 400,  # JSONError, a malformed query; after its subclasses above
    Unauthorized: 401,
    FunctionNotFound: 404,
    StateConflict: 409,
    InvocationError: 502,
    Rejected: 503,
    StartFailed: 503,
    StateUnavailable: 503,
    StateNotWritable: 503,
}
RETRY_AFTER_S = 1  # Retry-After of a 503/507 whose error names no delay of its own

# (source, dtype) -> model record {id, dir, weight_bytes}; raises ModelSourceError
Registrar = Callable[[str, str], Awaitable[dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    api_key: str | None = None  # required when the gateway listens beyond loopback
    logs_dir: Path | None = None  # where instances' logs are (EMBER_HOME/logs)
    limits: EdgeLimits = field(default_factory=EdgeLimits)  # request body size and time caps

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


log = logging.getLogger("ember.gateway")

# Errors that are the client's or the cluster's, mapped to HTTP without a traceback in the log.
HANDLED: tuple[type[Exception], ...] = (
    SpecError, ModelSourceError, RequestValidationError, Unauthorized, SchedulerError, EdgeError,
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

    keyed = config.api_key is not None
    app = FastAPI(title="Ember", version="0.1.0", lifespan=lifespan, **(NO_OPEN_DOCS if keyed else {}))

    def error(exc: Exception) -> JSONResponse:
        if isinstance(exc, RequestValidationError):
            exc = EdgeError("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))
        status = next((v for cls, v in ERROR_STATUS.items() if isinstance(exc, cls)), 500)
        kind = str(getattr(exc, "code", "internal_error")) if status != 500 else "internal_error"
        # Messages may quote input, and JSON's \ud800 escapes can carry lone surrogates, which
        # the response's UTF-8 cannot: escape them rather than fail with a 500.
        message = str(exc).encode("utf-8", "backslashreplace").decode("utf-8")
        headers: dict[str, str] = {}
        if status in (503, 507):  # resource exhaustion: always say when to come back
            headers["retry-after"] = str(max(1, math.ceil(getattr(exc, "retry_after_s", RETRY_AFTER_S))))
        if isinstance(exc, BodyTooLarge | BodyTimeout):
            # The rest of the body is never read, so the connection cannot carry another
            # request: close it. (Every other error is answered after the whole body was
            # read and keeps the keep-alive connection.)
            headers["connection"] = "close"
        return JSONResponse(
            {"error": {"type": kind, "message": message}}, status_code=status, headers=headers or None
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
    if keyed:
        keyed_docs(app, auth)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/functions", status_code=201, dependencies=auth)
    async def deploy(request: Request) -> dict[str, Any]:
        raw = (await request.body()).decode("utf-8", errors="replace")  # bounded: BodyLimits
        # Parsing and validating a spec of up to max_spec_bytes is CPU work: off the event loop.
        spec = await asyncio.to_thread(_parse_spec, raw, request.headers.get("content-type", ""))
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
        _limit_bodies(app, config.limits, error)
        return app
    invoker = serving.invoker

    @app.get("/metrics", dependencies=auth)
    def metrics() -> Response:
        return Response(serving.metrics.render(), media_type="text/plain; version=0.0.4")

    async def relay(body: bytes, path: str, label: str, name: str | None, timeout: str | None) -> Response:
        """Relay one invocation; OpenAI routes name the function in the body's ``model``."""
        try:
            load_json(body)  # bounded depth (request_model's plain json.loads is not)
        except JSONError as exc:
            what = "body" if name is None else "the event"
            raise BadRequest(f"{what} is not valid JSON: {exc}") from None
        if name is None:
            name, _ = request_model(body)
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
    _limit_bodies(app, config.limits, error)

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


def _limit_bodies(app: FastAPI, limits: EdgeLimits, error: Callable[[Exception], Response]) -> None:
    """Bound every request body (outermost middleware: the fast path's bodies too)."""

    def cap(scope: Scope) -> int:
        spec = scope["path"] == "/v1/functions" and scope["method"] == "POST"
        return limits.max_spec_bytes if spec else limits.max_body_bytes

    app.add_middleware(BodyLimits, limits=limits, cap=cap, render=error)


def _parse_spec(raw: str, content_type: str) -> FunctionSpec:
    """A function spec from a deploy body: JSON (by content type) or YAML, depth-bounded."""
    if "json" in content_type:
        try:
            return parse_function(load_json(raw))
        except JSONError as exc:
            raise SpecError(f"malformed JSON: {exc}") from None
    return parse_function_yaml(raw)
