"""Invocation: ``POST /v1/functions/{name}/invoke`` and the OpenAI completion routes.

One implementation, :class:`Invocations`, called with the raw ASGI scope and ``receive``.
:class:`gateway.fastpath.InvocationFastPath` calls it before FastAPI's routing (the 2 ms
budget); the routes :func:`invoke_routes` declares call the same object, so they document
the API in OpenAPI, answer 405 to other methods, and serve any request the fast path did
not claim the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.types import Receive, Scope

from gateway.fastpath import read_body
from gateway.limits import JSONError, load_json
from gateway.proxy import BadRequest, Invoker, request_model
from gateway.tenants import Principal

log = logging.getLogger("ember.gateway")

CheckKey = Callable[[str], Awaitable[Principal]]  # Authorization header -> caller, or Unauthorized


class Invocations:
    """Relay invocations to the function's instances (see module docstring)."""

    def __init__(
        self,
        invoker: Invoker,
        check_key: CheckKey,
        render_error: Callable[[Exception], Response],
        handled: tuple[type[Exception], ...],
    ) -> None:
        self.invoker = invoker
        self.check_key = check_key
        self.render_error = render_error
        self.handled = handled  # errors answered without a traceback in the log

    async def __call__(
        self, scope: Scope, receive: Receive, path: str, label: str, name: str | None
    ) -> Response | None:
        """Send the request's body to ``path`` on an instance; None if the client hung up.
        ``name`` is the function of ``/v1/functions/{name}/invoke`` (None: the OpenAI body's
        ``model``). Every error is answered as JSON (:mod:`gateway.errors`)."""
        try:
            headers = dict(scope["headers"])
            who = await self.check_key(headers.get(b"authorization", b"").decode("latin-1"))
            body = await read_body(receive)
            if body is None:
                return None
            timeout = headers.get(b"x-ember-timeout")
            raw_query = scope.get("query_string", b"")
            query = parse_qs(raw_query.decode("latin-1")) if raw_query else {}
            namespace = query["namespace"][-1] if "namespace" in query else None
            timeout_s = timeout.decode("latin-1") if timeout else None
            return await self._relay(body, path, label, name, timeout_s, who, namespace)
        except Exception as exc:
            if not isinstance(exc, self.handled):
                log.exception("invocation failed")
            return self.render_error(exc)

    async def _relay(
        self, body: bytes, path: str, label: str, name: str | None, timeout: str | None, who: Principal,
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
        return await self.invoker.forward(name, path, body, label, timeout)


def invoke_routes(invocations: Invocations) -> APIRouter:
    """The invocation routes, declared for OpenAPI and methods; each calls ``invocations``."""
    router = APIRouter()

    async def call(request: Request, path: str, label: str, name: str | None) -> Response:
        response = await invocations(request.scope, request.receive, path, label, name)
        return response if response is not None else Response(status_code=204)  # the client left

    @router.post("/v1/functions/{name}/invoke")
    async def invoke(name: str, request: Request) -> Response:
        return await call(request, "/invoke", "invoke", name)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await call(request, "/v1/chat/completions", "chat", None)

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await call(request, "/v1/completions", "completions", None)

    return router
