"""First-use costs of the serving path, paid by a pre-warmed worker before it is ready.

Python loads much of a request's path lazily, on first use: a process's first streamed
response imports anyio's asyncio backend and starlette's task-group code: 11-53 ms of an
instance's first request on 2 busy cores, 136 ms in a fresh interpreter. The instance's
first request would pay that on the cold path, after its client already waited for the
instance to start; :func:`rehearse` pays it while the worker still waits for a function (the
model's own first passes are :func:`runtime.instance.warm_up`). It starts no thread: threads
started before the function's sandbox layer would escape it (:mod:`runtime.function_sandbox`).

Each endpoint has a first-call cost of its own: FastAPI reads and tokenizes an endpoint's
source (``inspect.getsourcelines``, for its error messages) the first time the endpoint
answers, 0.5-0.8 ms for ``/_ember/assign`` on this host, which a standby's activation paid on
the cold path. :func:`rehearse` therefore also sends every POST route of the worker's app one
request it refuses (an empty body, or no function assigned yet: a 4xx, and no side effect).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message

# What uvicorn puts in an HTTP scope (its protocols announce ASGI spec 2.3: starlette then
# streams inside a task group that also listens for the client's disconnect).
_SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "POST", "headers": []}


async def _events() -> AsyncIterator[bytes]:
    yield b'data: {"rehearsal": true}\n\n'
    yield b"data: [DONE]\n\n"


async def rehearse(app: ASGIApp | None = None) -> float:
    """Stream one response into nowhere, as uvicorn would run it, and refuse one request on
    each POST route of ``app`` (a worker's app, unassigned); returns the seconds spent."""
    t0 = time.perf_counter()
    if app is not None:
        await _refuse_each_route(app)
    sent: list[Message] = []
    never = asyncio.Event()  # the rehearsal's "client" never disconnects: the stream ends it

    async def receive() -> Message:
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await StreamingResponse(_events(), media_type="text/event-stream")(dict(_SCOPE), receive, send)
    assert sent and sent[-1].get("more_body") is False, "the rehearsal stream did not complete"
    return time.perf_counter() - t0


async def _refuse_each_route(app: ASGIApp) -> None:
    """POST an empty body to every POST route of ``app``; the answers (4xx) are dropped."""
    routes = getattr(app, "routes", ())
    paths = [r.path for r in routes if isinstance(r, Route) and "POST" in (r.methods or ())]
    for path in paths:
        delivered = False

        async def receive() -> Message:
            nonlocal delivered
            if delivered:
                return {"type": "http.disconnect"}
            delivered = True
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: Message) -> None:
            pass

        scope = {
            **_SCOPE,
            "http_version": "1.1",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-length", b"0")],
            "client": ("127.0.0.1", 0),
            "server": ("127.0.0.1", 0),
        }
        await app(scope, receive, send)
