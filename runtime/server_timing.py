"""A ``Server-Timing`` header on every worker response: how long the worker itself took.

``Server-Timing: worker;dur=12.345`` (milliseconds, W3C Server Timing) runs from the moment
the request reached the worker's ASGI app to the moment its response headers leave; for a
JSON answer that is the whole service time (tokenising, prefill, decode, serialising). The
gateway relays the header, so a client (or ``bench/coldstart.py``) can tell the time spent
in the model from the time spent on the way to it: latency minus ``worker;dur`` is what
the network and the gateway cost, without the model's own run-to-run noise.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"server-timing"


class ServerTiming:
    """Pure ASGI middleware (no per-request task or body copy, unlike BaseHTTPMiddleware)."""

    def __init__(self, app: ASGIApp, metric: str = "worker") -> None:
        self.app = app
        self.metric = metric

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                dur_ms = (time.perf_counter() - t0) * 1e3
                headers: list[Any] = list(message.get("headers", []))
                headers.append((HEADER, f"{self.metric};dur={dur_ms:.3f}".encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, timed_send)


def duration_ms(header: str | None, metric: str = "worker") -> float | None:
    """``dur`` of ``metric`` in a ``Server-Timing`` header value, or None when absent."""
    if not header:
        return None
    for entry in header.split(","):
        name, _, params = entry.strip().partition(";")
        if name.strip() != metric:
            continue
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key == "dur":
                try:
                    return float(value)
                except ValueError:
                    return None
    return None
