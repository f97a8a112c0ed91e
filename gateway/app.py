"""The HTTP front door: the composition of the gateway's routes (:mod:`gateway.routes`).

Functions are deployed from YAML or JSON (validated against the function spec, defaults filled
in, the model registered) into the cluster state in Redis. Invocations go through
:class:`gateway.proxy.Invoker` to an instance chosen by the scheduler's router, by one
implementation (:mod:`gateway.routes.invoke`) that :class:`gateway.fastpath.InvocationFastPath`
calls ahead of FastAPI's routing. Every error is OpenAI's error object ``{"error": {"message",
"type", "param", "code"}}``: its HTTP status comes from one table
(:data:`gateway.errors.ERROR_STATUS`), its ``type`` from the error class's ``code``. 4xx for
client mistakes; 503 (with ``Retry-After``) when a request is rejected early or Redis is away
or cannot write; 502 when an instance fails. An API key, when configured, is required as
``Authorization: Bearer KEY`` on every route (documentation included) but ``/healthz``
(liveness) and ``/readyz`` (readiness of Redis, pools and a warm worker: see
:mod:`gateway.health`; it reveals nothing beyond ready / not ready per component): the
gateway's own key is the admin's, tenant keys see only their namespace's functions
(:mod:`gateway.tenants`; an admin picks a namespace with ``?namespace=``). Request bodies are
bounded in size and read time (:mod:`gateway.limits`); JSON and YAML are parsed with depth
bounds, specs off the event loop. In cluster mode (:func:`gateway.compose.build_cluster`)
invocations go to each function's Knative Service (:class:`Serving`'s ``router`` is then a
:class:`scheduler.knative.targets.ServiceTargets`) and deploys and deletes apply the Service
too (``Serving.deployments``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope

from gateway.docs import NO_OPEN_DOCS, keyed_docs
from gateway.errors import ERROR_STATUS, HANDLED, ModelSourceError, Unauthorized, render_error
from gateway.fastpath import InvocationFastPath
from gateway.function_code import FunctionCodeConfig
from gateway.health import Readiness
from gateway.limits import BodyLimits, DeployLimits, EdgeLimits
from gateway.metrics import Metrics
from gateway.proxy import Invoker, Routing
from gateway.routes.cluster import cluster_routes, health_routes
from gateway.routes.functions import function_routes
from gateway.routes.invoke import Invocations, invoke_routes
from gateway.tenants import Authenticator, Principal, TenantKeys, tenant_routes
from runtime.errors import route_error
from scheduler.records import FunctionRecord
from scheduler.state import ClusterState

__all__ = [
    "ERROR_STATUS",
    "HANDLED",
    "AdapterRegistrar",
    "Deployments",
    "GatewayConfig",
    "ModelSourceError",
    "Registrar",
    "Serving",
    "Unauthorized",
    "create_app",
]

log = logging.getLogger("ember.gateway")

# (source, dtype) -> the model's reference as the agent returns it ({id, dir, weight_bytes},
# decoded by ModelRef.decode); raises ModelSourceError
Registrar = Callable[[str, str], Awaitable[dict[str, Any]]]
# ((name, source) of each LoRA adapter of spec.model.adapters, the base's dtype, the registered
# base's directory) -> name -> registered adapter directory; raises ModelSourceError (also for
# an adapter that does not fit the base)
AdapterRegistrar = Callable[[list[tuple[str, str]], str, str], Awaitable[dict[str, str]]]


class Deployments(Protocol):
    """Cluster mode: each function is also a Knative Service
    (:class:`scheduler.knative.deployments.KnativeDeployments`). The calls block: routes run
    them in threads."""

    def check(self, record: FunctionRecord) -> object:
        """Raise :class:`scheduler.spec.SpecError` if the function cannot be deployed."""

    def apply(self, record: FunctionRecord) -> object:
        """Create or update the function's objects."""

    def remove(self, function_id: str) -> bool:
        """Delete the function's objects (whether they were there)."""

    def statuses(self, function_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The ``status.knative`` block of each function, by qualified id (never raises)."""


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    api_key: str | None = None  # required when the gateway listens beyond loopback
    logs_dir: Path | None = None  # where instances' logs are (EMBER_HOME/logs)
    code: FunctionCodeConfig | None = None  # where uploaded handler modules go (None: no custom handlers)
    limits: EdgeLimits = field(default_factory=EdgeLimits)  # request body size and time caps
    deploy: DeployLimits = field(default_factory=DeployLimits)  # functions per namespace

    def __post_init__(self) -> None:
        if self.api_key is not None and len(self.api_key) < 16:
            raise ValueError("an API key must be at least 16 characters")


@dataclass
class Serving:
    """The invocation side of a gateway: model registration, routing, forwarding."""

    register: Registrar
    router: Routing
    invoker: Invoker
    metrics: Metrics
    background: list[Callable[[], Coroutine[Any, Any, None]]] = field(
        default_factory=list
    )  # run while serving
    readiness: Readiness | None = None  # /readyz's checks beyond Redis (pools, warm workers)
    # Admin: evict inactive tensors of one model id (None: all) from this node's pools; bytes freed.
    evict: Callable[[str | None], Awaitable[int]] | None = None
    # Cluster mode: deploys and deletes apply each function's Knative Service; describe and list
    # show its readiness (a ``status.knative`` block).
    deployments: Deployments | None = None
    # LoRA adapters of spec.model.adapters (None: this mode serves none; such a deploy is a 400).
    register_adapters: AdapterRegistrar | None = None


def _ended_early(task: asyncio.Task[None]) -> None:
    """Log a background job (supervision, reconcile, fsync) that ended before shutdown: each
    runs until cancelled, so one that returned or raised stopped doing its part."""
    if task.cancelled():
        return
    exc = task.exception()
    log.error("background task %s ended: %r", task.get_coro(), exc, exc_info=exc)


def create_app(
    state: ClusterState, config: GatewayConfig | None = None, serving: Serving | None = None
) -> FastAPI:
    """The gateway's FastAPI app over ``state``; without ``serving`` it only manages functions."""
    config = config or GatewayConfig()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(job()) for job in (serving.background if serving else [])]
        for task in tasks:
            task.add_done_callback(_ended_early)
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    keyed = config.api_key is not None
    app = FastAPI(title="Ember", version="0.1.0", lifespan=lifespan, **(NO_OPEN_DOCS if keyed else {}))
    for cls in HANDLED:
        app.add_exception_handler(cls, lambda _req, exc: render_error(exc))

    app.add_exception_handler(StarletteHTTPException, route_error)  # 404/405 in Ember's error body
    # Anything else is a bug: still a JSON error body (Starlette logs the traceback).
    app.add_exception_handler(Exception, lambda _req, exc: render_error(exc))

    authenticator = Authenticator(config.api_key, TenantKeys(state))

    async def check_key(authorization: str) -> Principal:
        """The caller the ``Authorization`` header names; Unauthorized for a missing or wrong key."""
        who = await authenticator.principal(authorization)
        if who is None:
            raise Unauthorized("missing or wrong API key (send Authorization: Bearer KEY)")
        return who

    async def authorize(request: Request) -> Principal:
        return await check_key(request.headers.get("authorization", ""))

    app.include_router(tenant_routes(authenticator, authorize))
    if keyed:
        keyed_docs(app, [Depends(authorize)])
    app.include_router(health_routes(state, serving))
    app.include_router(function_routes(state, config, serving, authorize))
    app.include_router(cluster_routes(state, serving, authorize))
    if serving is not None:
        invocations = Invocations(serving.invoker, check_key, render_error, HANDLED)
        app.add_middleware(InvocationFastPath, forward=invocations)
        app.include_router(invoke_routes(invocations))
    _limit_bodies(app, config.limits, render_error)
    return app


def _limit_bodies(app: FastAPI, limits: EdgeLimits, error: Callable[[Exception], Response]) -> None:
    """Bound every request body (outermost middleware: the fast path's bodies too)."""

    def cap(scope: Scope) -> int:
        spec = scope["path"] == "/v1/functions" and scope["method"] == "POST"
        return limits.max_spec_bytes if spec else limits.max_body_bytes

    app.add_middleware(BodyLimits, limits=limits, cap=cap, render=error)
