"""The invocation routes, straight from ASGI to the :class:`gateway.proxy.Invoker`.

Every invocation pays the gateway's overhead, and the budget is 2 ms on top of calling the
worker directly. FastAPI's request path (route matching over every route, dependency
solving for the API key, an exit stack and exception middleware per request, ``Request``
objects) costs a few hundred microseconds of it. :class:`InvocationFastPath` answers the
three invocation routes itself: it checks the key, reads the body and hands it to the
same forwarding code, whose errors map to the same JSON bodies. The routes stay declared on
the FastAPI app (OpenAPI, and any path this middleware does not claim).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

# (scope, receive, worker path, metrics label, function name or None: from the body) ->
# the response, or None when the client hung up before its body arrived.
Forward = Callable[[Scope, Receive, str, str, str | None], Awaitable[Response | None]]

_OPENAI = {
    "/v1/chat/completions": ("/v1/chat/completions", "chat"),
    "/v1/completions": ("/v1/completions", "completions"),
}
_FUNCTIONS, _INVOKE = "/v1/functions/", "/invoke"


class InvocationFastPath:
    """ASGI middleware claiming ``POST`` to the OpenAI routes and ``/v1/functions/{name}/invoke``."""

    def __init__(self, app: ASGIApp, forward: Forward) -> None:
        self.app = app
        self.forward = forward

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path: str = scope["path"]
            target = _OPENAI.get(path)
            name: str | None = None
            if target is None and path.startswith(_FUNCTIONS) and path.endswith(_INVOKE):
                name = path[len(_FUNCTIONS) : -len(_INVOKE)]
                if name and "/" not in name:  # what the route's {name} would match
                    target = ("/invoke", "invoke")
            if target is not None:
                response = await self.forward(scope, receive, target[0], target[1], name)
                if response is not None:
                    await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None if the client disconnected first. Bounded in size and
    time by ``receive`` itself (:class:`gateway.limits.BodyLimits` wraps it): that raises
    :class:`gateway.limits.BodyTooLarge` or :class:`gateway.limits.BodyTimeout` here."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)
