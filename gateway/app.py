"""The HTTP front door: function CRUD, invocation (invoke + OpenAI), cluster view, metrics.

Functions are deployed from YAML or JSON (validated against the function spec, defaults
filled in, the model registered) into the cluster state in Redis. Invocations go through
:class:`gateway.proxy.Invoker` to an instance chosen by the scheduler's router. Every error
is a JSON ``{"error": {"type", "message"}}``: its HTTP status comes from one table
(:data:`ERROR_STATUS`), its ``type`` from the error class's ``code``. 4xx for client
mistakes; 503 (with ``Retry-After``) when a request is rejected early or Redis is away or
cannot write; 502 when an instance fails. An API key, when configured, is required as
``Authorization: Bearer KEY`` on every route (documentation included) but ``/healthz``
(liveness) and ``/readyz`` (readiness of Redis, pools and a warm worker: see
:mod:`gateway.health`; it reveals nothing beyond ready / not ready per component):
the gateway's own key is the admin's, tenant keys see only their namespace's functions
(:mod:`gateway.tenants`; an admin picks a namespace with ``?namespace=``).
Request bodies are bounded in size and read time (:mod:`gateway.limits`); JSON and YAML
are parsed with depth bounds, specs off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope

from gateway.docs import NO_OPEN_DOCS, keyed_docs
from gateway.fastpath import InvocationFastPath, read_body
from gateway.function_code import FunctionCodeConfig, split_upload, store_handler
from gateway.health import Readiness, readyz
from gateway.limits import BodyLimits, BodyTimeout, BodyTooLarge, EdgeError, EdgeLimits, JSONError, load_json
from gateway.metrics import Metrics
from gateway.proxy import BadRequest, InvocationError, Invoker, request_model
from gateway.tenants import Authenticator, Forbidden, Principal, TenantKeys, tenant_routes
from scheduler import names
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
    Forbidden: 403,
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
    code: FunctionCodeConfig | None = None  # where uploaded handler modules go (None: no custom handlers)
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
    readiness: Readiness | None = None  # /readyz's checks beyond Redis (pools, warm workers)
    # Admin: evict inactive tensors of one model id (None: all) from this node's pools; bytes freed.
    evict: Callable[[str | None], Awaitable[int]] | None = None


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

    def route_error(_req: Request, exc: Exception) -> Response:
        """Starlette's own errors (no such route: 404, wrong method: 405) in Ember's error body."""
        assert isinstance(exc, StarletteHTTPException)
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request_error")
        body = {"error": {"type": kind, "message": str(exc.detail)}}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    app.add_exception_handler(StarletteHTTPException, route_error)
    # Anything else is a bug: still a JSON error body (Starlette logs the traceback).
    app.add_exception_handler(Exception, lambda _req, exc: error(exc))

    authenticator = Authenticator(config.api_key, TenantKeys(state))

    async def check_key(authorization: str) -> Principal:
        """The caller the ``Authorization`` header names; Unauthorized for a missing or wrong key."""
        who = await authenticator.principal(authorization)
        if who is None:
            raise Unauthorized("missing or wrong API key (send Authorization: Bearer KEY)")
        return who

    async def authorize(request: Request) -> Principal:
        return await check_key(request.headers.get("authorization", ""))

    caller = Depends(authorize)  # who: Principal = caller (a local alias: annotations are strings)
    app.include_router(tenant_routes(authenticator, authorize))
    if keyed:
        keyed_docs(app, [caller])

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    default_readiness = Readiness(redis_ping=state.r.ping)

    @app.get("/readyz", include_in_schema=False)
    async def ready() -> Response:
        return await readyz(serving.readiness if serving and serving.readiness else default_readiness)

    @app.post("/v1/functions", status_code=201)
    async def deploy(request: Request, who: Principal = caller) -> dict[str, Any]:
        raw = (await request.body()).decode("utf-8", errors="replace")  # bounded: BodyLimits
        # Parsing and validating a spec of up to max_spec_bytes is CPU work: off the event loop.
        spec, files = await asyncio.to_thread(_parse_spec, raw, request.headers.get("content-type", ""))
        spec = who.place(spec)  # a tenant's own namespace; 403 for another
        function_id = names.qualified(spec.metadata.namespace, spec.name)
        handler = await asyncio.to_thread(store_handler, config.code, function_id, spec.spec.handler, files)
        model = None
        if serving is not None:
            model = await serving.register(spec.spec.model.source, spec.spec.model.dtype)
        document = spec.to_document()
        document["spec"]["handler"] = handler  # an uploaded module's stored path
        try:
            previous: dict[str, Any] | None = await asyncio.to_thread(state.get_record, function_id)
        except FunctionNotFound:
            previous = None
        await asyncio.to_thread(state.put_function, function_id, document, model)
        if serving is not None:
            serving.invoker.forget(function_id)
            if previous is not None and (previous["spec"], previous.get("model")) != (document, model):
                await serving.router.retire(function_id)  # running instances serve the old version
        return document

    # Handlers that only read Redis are plain functions: FastAPI runs them in its thread pool,
    # so a Redis restart (retried for seconds) never stalls the event loop and its streams.
    # Each acts in one namespace: a tenant's own, or the admin's ``?namespace=`` (default:
    # "default"); another tenant's function is a 404 like a missing one.
    def in_namespace(who: Principal, namespace: str | None) -> dict[str, dict[str, Any]]:
        scope = who.scope(namespace)
        return {i: f for i, f in state.list_functions().items() if names.split(i)[0] == scope}

    @app.get("/v1/functions")
    def list_functions(who: Principal = caller, namespace: str | None = None) -> dict[str, Any]:
        return {"functions": list(in_namespace(who, namespace).values())}

    @app.get("/v1/functions/{name}")
    def describe(name: str, who: Principal = caller, namespace: str | None = None) -> dict[str, Any]:
        return state.get_function(who.function(name, namespace))

    @app.delete("/v1/functions/{name}", status_code=204)
    async def delete(name: str, who: Principal = caller, namespace: str | None = None) -> Response:
        name = who.function(name, namespace)
        await asyncio.to_thread(state.delete_function, name)
        if config.code is not None:
            await asyncio.to_thread(config.code.remove, name)
        if serving is not None:
            serving.invoker.forget(name)
            await serving.router.retire(name)
        return Response(status_code=204)

    @app.get("/v1/functions/{name}/logs")
    def logs(
        name: str, tail: int = 200, who: Principal = caller, namespace: str | None = None
    ) -> PlainTextResponse:
        name = who.function(name, namespace)  # "ns/name": the directory functions/ns/name
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

    @app.get("/v1/models")
    def models(who: Principal = caller, namespace: str | None = None) -> dict[str, Any]:
        now = int(time.time())
        data = [
            {"id": names.split(i)[1], "object": "model", "created": now, "owned_by": "ember"}
            for i in in_namespace(who, namespace)
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/cluster/evict")
    async def evict(who: Principal = caller, model: str | None = None) -> dict[str, int]:
        """Admin: drop inactive tensors (of ``?model=ID``, else all) from this node's pools, so
        the next start loads them again (benchmarks of cold loads; freeing memory by hand)."""
        who.require_admin()
        if serving is None or serving.evict is None:
            raise BadRequest("this gateway runs no pools")
        return {"bytes_evicted": await serving.evict(model)}

    @app.get("/v1/cluster")
    def cluster(who: Principal = caller) -> dict[str, Any]:
        """Everything for the admin (functions by qualified id); a tenant sees its own functions
        by name and no devices (their residency would show other tenants' models)."""
        records = {i: r for i, r in state.list_records().items() if who.sees(i)}
        return {
            "devices": state.devices() if who.admin else {},
            "functions": {
                who.shown(name): {
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

    @app.get("/metrics")
    def metrics(who: Principal = caller) -> Response:
        """Every series for the admin; a tenant's own functions' series only."""
        text = serving.metrics.render(who.namespace)
        return Response(text, media_type="text/plain; version=0.0.4")

    async def relay(
        body: bytes, path: str, label: str, name: str | None, timeout: str | None, who: Principal,
        namespace: str | None,
    ) -> Response:  # fmt: skip
        """Relay one invocation; OpenAI routes name the function in the body's ``model``."""
        try:
            parsed = load_json(body)  # depth-bounded: a 100k-deep body is a 400, not a RecursionError
        except JSONError as exc:
            what = "body" if name is None else "the event"
            raise BadRequest(f"{what} is not valid JSON: {exc}") from None
        # Another tenant's function is a 404 like a missing one, before any routing.
        name = who.model(request_model(parsed)) if name is None else who.function(name, namespace)
        return await invoker.forward(name, path, body, label, timeout)

    async def forward(request: Request, path: str, label: str, name: str | None = None) -> Response:
        who = await authorize(request)
        namespace = request.query_params.get("namespace")
        timeout = request.headers.get("x-ember-timeout")
        return await relay(await request.body(), path, label, name, timeout, who, namespace)

    async def fast_forward(
        scope: Scope, receive: Receive, path: str, label: str, name: str | None
    ) -> Response | None:
        """:func:`forward` without FastAPI's routing, dependency solving and request objects
        (see :class:`gateway.fastpath.InvocationFastPath`); None if the client hung up."""
        try:
            headers = dict(scope["headers"])
            who = await check_key(headers.get(b"authorization", b"").decode("latin-1"))
            body = await read_body(receive)
            if body is None:
                return None
            timeout = headers.get(b"x-ember-timeout")
            raw_query = scope.get("query_string", b"")
            query = parse_qs(raw_query.decode("latin-1")) if raw_query else {}
            namespace = query["namespace"][-1] if "namespace" in query else None
            timeout_s = timeout.decode("latin-1") if timeout else None
            return await relay(body, path, label, name, timeout_s, who, namespace)
        except Exception as exc:
            if not isinstance(exc, HANDLED):
                log.exception("invocation failed")
            return error(exc)

    app.add_middleware(InvocationFastPath, forward=fast_forward)
    _limit_bodies(app, config.limits, error)

    @app.post("/v1/functions/{name}/invoke")
    async def invoke(name: str, request: Request) -> Response:
        return await forward(request, "/invoke", "invoke", name)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions", "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions", "completions")

    return app


def _limit_bodies(app: FastAPI, limits: EdgeLimits, error: Callable[[Exception], Response]) -> None:
    """Bound every request body (outermost middleware: the fast path's bodies too)."""

    def cap(scope: Scope) -> int:
        spec = scope["path"] == "/v1/functions" and scope["method"] == "POST"
        return limits.max_spec_bytes if spec else limits.max_body_bytes

    app.add_middleware(BodyLimits, limits=limits, cap=cap, render=error)


def _parse_spec(raw: str, content_type: str) -> tuple[FunctionSpec, dict[str, str]]:
    """A function spec from a deploy body, depth-bounded: JSON (by content type, optionally with
    the handler's uploaded module: :func:`gateway.function_code.split_upload`) or YAML."""
    if "json" in content_type:
        try:
            data, files = split_upload(load_json(raw))
        except JSONError as exc:
            raise SpecError(f"malformed JSON: {exc}") from None
        return parse_function(data), files
    return parse_function_yaml(raw), {}
