"""The worker's front door: its credential and a bound on request bodies, before any route runs.

A worker listens on a local TCP port that every process of the node can reach. Each worker
gets its own random credential from the node agent (over its stdin, never argv or the
environment: those are readable through ``/proc``); every route but ``/healthz`` requires it
in the ``X-Ember-Worker-Token`` header (compared in constant time), else 401. Bodies larger
than ``max_body_bytes`` are answered 413 before they are buffered: from ``Content-Length``
when given, else while a chunked body arrives (at most ``max_body_bytes`` are held); a body
that has not arrived whole within ``body_timeout_s`` is answered 408. These answers close the
connection: the rest of the body is never read (a caller without the credential, or with a
body too large or too slow, cannot hold the connection while it sends one).
``/readyz`` is open too (a Knative readiness probe carries no credential; it says only
whether the instance serves). ``/healthz`` answers a caller without the credential with its
status alone: what the worker serves (function, model, instance) is for the agent, not for
any local process looking for another tenant's worker (``scope[AUTHORIZED]`` tells the
route). :class:`BodyLimit` alone bounds bodies where the caller has no credential to give
(OpenWhisk's invoker, :mod:`runtime.openwhisk`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from runtime.errors import error_body

TOKEN_HEADER = "x-ember-worker-token"
OPEN_PATHS = frozenset({"/healthz", "/readyz"})  # liveness and readiness: nothing a caller could misuse
AUTHORIZED = "ember.authorized"  # ASGI scope key: whether the request carried the credential
DEFAULT_MAX_BODY_BYTES = 4 << 20  # a few MB: far above any prompt that fits a context
DEFAULT_BODY_TIMEOUT_S = 30.0  # the gateway's default too (gateway.limits.EdgeLimits)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class GuardConfig:
    """The worker's credential, body bound (bytes) and body read time (s)."""

    token: str
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S

    def __post_init__(self) -> None:
        if len(self.token) < 16:
            raise ValueError("a worker token must be at least 16 characters")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1 KiB")
        if not 0 < self.body_timeout_s <= 3600:  # also refuses NaN
            raise ValueError("body_timeout_s must be in (0, 3600] seconds")

    @classmethod
    def from_env(cls, token: str, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> GuardConfig:
        """With ``EMBER_BODY_TIMEOUT`` (seconds) when set, as the gateway reads it (a worker
        inherits the agent's environment); ValueError naming it when bad."""
        from runtime.http_server import env_values

        config = cls(token, max_body_bytes)  # the token and the bound are the caller's to fix
        values = env_values((("EMBER_BODY_TIMEOUT", "body_timeout_s", float),))
        try:
            return cls(token, max_body_bytes, **values) if values else config
        except ValueError as exc:
            raise ValueError(f"EMBER_BODY_TIMEOUT: {exc}") from None


class WorkerGuard:
    """ASGI middleware enforcing :class:`GuardConfig` (see the module docstring)."""

    def __init__(self, app: ASGIApp, config: GuardConfig) -> None:
        self.app = app
        self.config = config
        self._token = config.token.encode()
        self._bounded = BodyLimit(app, config.max_body_bytes, config.body_timeout_s)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: dict[bytes, bytes] = dict(scope.get("headers") or ())
        scope[AUTHORIZED] = hmac.compare_digest(headers.get(TOKEN_HEADER.encode(), b""), self._token)
        if scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if not scope[AUTHORIZED]:
            await _reply(send, 401, "unauthorized", f"this worker requires its {TOKEN_HEADER} header")
            return
        await self._bounded(scope, receive, send)


class BodyLimit:
    """ASGI middleware that reads a request's body whole before the app runs: 413 past
    ``max_body_bytes`` (declared or counted as it arrives, before buffering), 408 when it has
    not arrived within ``body_timeout_s``; both close the connection."""

    def __init__(
        self, app: ASGIApp, max_body_bytes: int, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    ) -> None:
        if max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1 KiB")
        if not 0 < body_timeout_s <= 3600:
            raise ValueError("body_timeout_s must be in (0, 3600] seconds")
        self.app = app
        self.limit = max_body_bytes
        self.timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: dict[bytes, bytes] = dict(scope.get("headers") or ())
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await _reply(send, 413, "request_too_large", f"the body exceeds {self.limit} bytes")
            return
        if length is None and headers.get(b"transfer-encoding") is None:
            await self.app(scope, receive, send)  # no body
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                messages = await self._read(receive)
        except TimeoutError:
            message = f"the request body did not arrive within {self.timeout_s:g} s"
            await _reply(send, 408, "request_timeout", message)
            return
        if messages is None:
            await _reply(send, 413, "request_too_large", f"the body exceeds {self.limit} bytes")
            return
        await self.app(scope, _replay(messages, receive), send)

    async def _read(self, receive: Receive) -> list[Message] | None:
        """The body as one message (or the disconnect that ended it); None past the limit."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return [message]
            size += len(message.get("body", b""))
            if size > self.limit:
                return None
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]


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
    """Answer the error and close the connection (the request's body is not read)."""
    body = json.dumps(error_body(kind, message)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
