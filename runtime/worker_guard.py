"""The worker's front door: its credential and a bound on request bodies, before any route runs.

A worker listens on a local TCP port that every process of the node can reach. Each worker
gets its own random credential from the node agent (over its stdin, never argv or the
environment: those are readable through ``/proc``); every route but ``/healthz`` requires it
in the ``X-Ember-Worker-Token`` header (compared in constant time), else 401. Bodies larger
than ``max_body_bytes`` are answered 413 before they are buffered: from ``Content-Length``
when given, else while a chunked body arrives (at most ``max_body_bytes`` are held).
``/readyz`` is open too (a Knative readiness probe carries no credential; it says only
whether the instance serves). :class:`BodyLimit` alone bounds bodies where the caller has no
credential to give (OpenWhisk's invoker, :mod:`runtime.openwhisk`).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from runtime.errors import error_body

TOKEN_HEADER = "x-ember-worker-token"
OPEN_PATHS = frozenset({"/healthz", "/readyz"})  # liveness and readiness: nothing a caller could misuse
DEFAULT_MAX_BODY_BYTES = 4 << 20  # a few MB: far above any prompt that fits a context

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class GuardConfig:
    """The worker's credential and body bound (bytes)."""

    token: str
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def __post_init__(self) -> None:
        if len(self.token) < 16:
            raise ValueError("a worker token must be at least 16 characters")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1 KiB")


class WorkerGuard:
    """ASGI middleware enforcing :class:`GuardConfig` (see the module docstring)."""

    def __init__(self, app: ASGIApp, config: GuardConfig) -> None:
        self.app = app
        self.config = config
        self._token = config.token.encode()
        self._bounded = BodyLimit(app, config.max_body_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers: dict[bytes, bytes] = dict(scope.get("headers") or ())
        if not hmac.compare_digest(headers.get(TOKEN_HEADER.encode(), b""), self._token):
            await _reply(send, 401, "unauthorized", f"this worker requires its {TOKEN_HEADER} header")
            return
        await self._bounded(scope, receive, send)


class BodyLimit:
    """ASGI middleware answering 413 to bodies over ``max_body_bytes`` before buffering them."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        if max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1 KiB")
        self.app = app
        self.limit = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: dict[bytes, bytes] = dict(scope.get("headers") or ())
        limit = self.limit
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) > limit:
                await _reply(send, 413, "request_too_large", f"the body exceeds {limit} bytes")
                return
            await self.app(scope, receive, send)  # the server holds the body to its Content-Length
            return
        if headers.get(b"transfer-encoding") is None:
            await self.app(scope, receive, send)  # no body
            return
        chunks: list[bytes] = []
        size = 0
        while True:  # chunked: read at most `limit` bytes, then replay them to the app
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message]), send)
                return
            size += len(message.get("body", b""))
            if size > limit:
                await _reply(send, 413, "request_too_large", f"the body exceeds {limit} bytes")
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)


def _replay(messages: list[Message], then: Receive | None = None) -> Receive:
    """A ``receive`` that yields ``messages`` first, then defers to ``then`` (disconnects)."""
    pending = list(messages)

    async def receive() -> Message:
        if pending:
            return pending.pop(0)
        if then is None:
            return {"type": "http.disconnect"}
        return await then()

    return receive


async def _reply(send: Send, status: int, kind: str, message: str) -> None:
    body = json.dumps(error_body(kind, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
