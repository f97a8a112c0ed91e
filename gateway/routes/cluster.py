"""Health and cluster routes: ``/healthz`` (and ``/health``), ``/readyz``, ``/v1/cluster``, evict, metrics.

``/healthz`` (liveness) and ``/readyz`` (readiness, :mod:`gateway.health`) need no key. The
cluster view shows the admin everything (functions by qualified id, the devices' reports);
a tenant sees its own functions by name and no devices (their residency would show other
tenants' models). ``/metrics`` shows a tenant only its own functions' series.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from gateway.health import Readiness, readyz
from gateway.proxy import BadRequest
from gateway.tenants import Principal
from scheduler.state import ClusterState

if TYPE_CHECKING:  # gateway.app composes this module
    from gateway.app import Serving


def health_routes(state: ClusterState, serving: Serving | None) -> APIRouter:
    """``/healthz`` (and its alias ``/health``) and ``/readyz`` (Redis only, unless ``serving``
    has its own checks)."""
    router = APIRouter()
    default_readiness = Readiness(redis_ping=state.r.ping)

    @router.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    # The path vLLM, SGLang, TGI and llama.cpp's server answer: OpenAI load generators (guidellm)
    # probe it before a run and give up on a 404.
    router.add_api_route("/health", healthz, methods=["GET"], include_in_schema=False)

    @router.get("/readyz", include_in_schema=False)
    async def ready() -> Response:
        return await readyz(serving.readiness if serving and serving.readiness else default_readiness)

    return router


def cluster_routes(
    state: ClusterState, serving: Serving | None, authorize: Callable[[Request], Awaitable[Principal]]
) -> APIRouter:
    """``/v1/cluster`` and ``/v1/cluster/evict``; ``/metrics`` too when ``serving``."""
    router = APIRouter()
    caller = Depends(authorize)  # who: Principal = caller (a local alias: annotations are strings)

    @router.post("/v1/cluster/evict")
    async def evict(who: Principal = caller, model: str | None = None) -> dict[str, int]:
        """Admin: drop inactive tensors (of ``?model=ID``, else all) from this node's pools, so
        the next start loads them again (benchmarks of cold loads; freeing memory by hand)."""
        who.require_admin()
        if serving is None or serving.evict is None:
            raise BadRequest("this gateway runs no pools")
        return {"bytes_evicted": await serving.evict(model)}

    @router.get("/v1/cluster")
    def cluster(who: Principal = caller) -> dict[str, Any]:
        """Everything for the admin (functions by qualified id); a tenant sees its own functions
        by name and no devices (their residency would show other tenants' models)."""
        records = {i: r for i, r in state.functions().items() if who.sees(i)}
        return {
            "devices": state.devices() if who.admin else {},
            "functions": {
                who.shown(name): {
                    "model": record.model.encode() if record.model is not None else None,
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

    if serving is not None:
        gateway_metrics = serving.metrics

        @router.get("/metrics")
        def metrics(who: Principal = caller) -> Response:
            """Every series for the admin; a tenant's own functions' series only."""
            text = gateway_metrics.render(who.namespace)
            return Response(text, media_type="text/plain; version=0.0.4")

    return router
