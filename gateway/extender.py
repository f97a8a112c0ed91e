"""The scheduler extender over HTTP: ``POST {prefix}/filter`` and ``POST {prefix}/prioritize``.

kube-scheduler's ``ember-scheduler`` profile names ``urlPrefix`` (e.g. ``http://HOST:PORT/extender``),
``filterVerb: filter`` and ``prioritizeVerb: prioritize``. Bodies are ``ExtenderArgs`` JSON and
the answers ``ExtenderFilterResult`` / ``HostPriorityList`` (:mod:`scheduler.extender`).

Two ways to serve it:

* :func:`extender_app` is the ASGI app of the two verbs (plus ``/healthz``, ``/readyz``), to be
  mounted at the prefix, e.g. in the gateway's app:
  ``app.mount("/extender", extender_app(extender_for(state), limits, ping=state.r.ping))``.
  Mounted there it is *not* behind the gateway's API key: kube-scheduler's extender client sends
  no credentials (only TLS client certificates), so restrict who reaches it (a NetworkPolicy
  admitting only the ``ember-scheduler`` pods); what it reveals is which nodes hold a model.
* ``ember extender --port P --redis URL`` (:func:`serve_extender`) serves it alone under uvicorn.

Both bound request bodies like the gateway (:class:`gateway.limits.BodyLimits`; JSON depth with
:func:`gateway.limits.load_json`) and answer errors as the gateway does
(:func:`gateway.errors.render_error`): 400 for a malformed ``ExtenderArgs``, 413/408 for an
oversized or slow body, 503 when Redis is away. Any non-200 answer makes kube-scheduler treat
the extender as failed for that pod, which with ``ignorable: true`` means it places the pod
without residency rather than not at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Scope

from gateway.errors import render_error
from gateway.limits import BodyLimits, EdgeLimits, load_json
from gateway.redis_auth import PASSWORD_ENV, with_password
from runtime.errors import error_body
from runtime.http_server import server_config
from scheduler.extender.residency import ResidencyCache
from scheduler.extender.service import Extender, ExtenderConfig
from scheduler.state import ClusterState

log = logging.getLogger("ember.extender")

DEFAULT_PREFIX = "/extender"
DEFAULT_PORT = 8090
_THREAD_PARSE_BYTES = 256 << 10  # bodies above this are parsed off the event loop


def extender_for(state: ClusterState, config: ExtenderConfig | None = None) -> Extender:
    """The extender over ``state``'s device reports (cached for ``config.cache_s``)."""
    config = config or ExtenderConfig()
    # One attempt per read, no retry loop: kube-scheduler waits for the extender (httpTimeout,
    # 2 s as shipped) in every pod's scheduling cycle, and with ``ignorable`` a quick 503
    # lets it place the pod without residency rather than after a timeout.
    read = functools.partial(state.device_reports_or_errors, retry=False)
    return Extender(ResidencyCache(read, config.cache_s), config)


def extender_app(
    extender: Extender, limits: EdgeLimits | None = None, ping: Callable[[], object] | None = None
) -> ASGIApp:
    """The extender's routes as one ASGI app (mount it at the prefix): ``POST /filter``,
    ``POST /prioritize``, ``GET /healthz`` and ``GET /readyz`` (``ping()`` succeeds: Redis)."""
    limits = limits or EdgeLimits()

    def verb(call: Callable[[Any], Awaitable[Any]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                body = await request.body()  # bounded by BodyLimits
                if len(body) > _THREAD_PARSE_BYTES:
                    document = await asyncio.to_thread(load_json, body)
                else:
                    document = load_json(body)
                return JSONResponse(await call(document))
            except Exception as exc:
                response = render_error(exc)
                if response.status_code == 500:
                    log.exception("extender %s failed", request.url.path)
                return response

        return endpoint

    async def healthz(_request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(_request: Request) -> Response:
        if ping is not None:
            try:
                await asyncio.to_thread(ping)
            except Exception as exc:  # any failure to reach Redis: not ready
                return JSONResponse({"status": "unavailable", "redis": str(exc)[:200]}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def http_error(_request: Request, exc: Exception) -> Response:
        """Starlette's own errors (no such route: 404, wrong method: 405) as Ember's error body."""
        assert isinstance(exc, HTTPException)
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request_error")
        body = error_body(kind, str(exc.detail))
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    def cap(_scope: Scope) -> int:
        return limits.max_body_bytes

    return Starlette(
        routes=[
            Route("/filter", verb(extender.filter), methods=["POST"]),
            Route("/prioritize", verb(extender.prioritize), methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
        ],
        middleware=[Middleware(BodyLimits, limits=limits, cap=cap, render=render_error)],
        exception_handlers={HTTPException: http_error},
    )


@dataclass(frozen=True, slots=True)
class ExtenderServeConfig:
    """``ember extender``: where it listens, its Redis, its URL prefix, its limits."""

    redis_url: str
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT  # 0: any free port (printed in the ready line)
    prefix: str = DEFAULT_PREFIX
    extender: ExtenderConfig = field(default_factory=ExtenderConfig)
    limits: EdgeLimits = field(default_factory=EdgeLimits)

    def __post_init__(self) -> None:
        if not self.redis_url:
            raise ValueError("the extender needs a Redis URL (--redis or EMBER_REDIS_URL)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port {self.port} is not in [0, 65535]")
        if not self.prefix.startswith("/") or self.prefix.endswith("/") or len(self.prefix) > 256:
            raise ValueError(f"prefix {self.prefix!r} must start with '/' and not end with one")

    @classmethod
    def from_env(cls, **overrides: Any) -> ExtenderServeConfig:
        """``EMBER_REDIS_URL`` (+ ``EMBER_REDIS_PASSWORD``), ``EMBER_HOST``, ``EMBER_EXTENDER_PORT``,
        ``EMBER_EXTENDER_PREFIX``, the ``EMBER_EXTENDER_*`` settings of :class:`ExtenderConfig`
        and the request limits of :class:`EdgeLimits`; then the non-None ``overrides``."""
        env = os.environ
        values: dict[str, Any] = {"redis_url": env.get("EMBER_REDIS_URL", "")}
        if "EMBER_HOST" in env:
            values["host"] = env["EMBER_HOST"]
        if "EMBER_EXTENDER_PORT" in env:
            raw = env["EMBER_EXTENDER_PORT"]
            try:
                values["port"] = int(raw)
            except ValueError:
                raise ValueError(f"EMBER_EXTENDER_PORT={raw!r} is not a valid int") from None
        if "EMBER_EXTENDER_PREFIX" in env:
            values["prefix"] = env["EMBER_EXTENDER_PREFIX"]
        values.update({k: v for k, v in overrides.items() if v is not None})
        values["redis_url"] = with_password(values["redis_url"] or None, env.get(PASSWORD_ENV)) or ""
        return cls(**values, extender=ExtenderConfig.from_env(), limits=EdgeLimits.from_env())


async def serve_extender(config: ExtenderServeConfig, ready: Callable[[str], None] | None = None) -> None:
    """Serve the extender until SIGINT/SIGTERM; ``ready(url)`` once it listens (default: print
    ``{"event": "ready", "url": ...}`` on stdout)."""
    state = ClusterState.from_url(config.redis_url)
    try:
        inner = extender_app(extender_for(state, config.extender), config.limits, ping=state.r.ping)
        app = Starlette(routes=[Mount(config.prefix, app=inner)])
        # IPPROTO_TCP: only then does asyncio set TCP_NODELAY on accepted connections (no
        # 40 ms delayed-ACK stalls on the answer's second write).
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((config.host, config.port))
        host = f"[{config.host}]" if ":" in config.host else config.host
        url = f"http://{host}:{sock.getsockname()[1]}{config.prefix}"
        server = _Server(server_config(app, config.limits.headers, log_level="warning", lifespan="off"))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                await task
                return
            await asyncio.sleep(0.01)
        if ready is not None:
            ready(url)
        else:
            print(json.dumps({"event": "ready", "url": url, "pid": os.getpid()}), flush=True)
        await task
    finally:
        state.close()


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling (it would re-raise SIGTERM after shutdown):
    :func:`serve_extender` stops it and closes Redis, and the process exits 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def log_decisions(stream: Any = sys.stderr) -> None:
    """Send the decision log (one JSON line each, ``ember.extender`` at INFO) to ``stream``."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("ember.extender")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
