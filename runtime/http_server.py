"""The uvicorn server of the gateway and of every worker: httptools with bounded headers.

uvicorn bounds how long an idle keep-alive connection lives (``timeout_keep_alive``) but
not how long a client may take to send a request line and headers: a slow client
("slowloris") sending one header byte at a time holds a connection forever.
:class:`HeaderTimeoutProtocol` arms a timer when a connection opens and when a request's
first byte arrives, and cancels it once the headers are complete; on expiry it answers 408
(JSON error body, ``Connection: close``) and closes the connection. httptools also buffers
a request line and headers whole, with no bound: bytes received while a request's headers
are incomplete are counted, and past ``max_header_bytes`` the request is answered 431 the
same way (a 300 MB header line grew the gateway by 300 MB). Bytes httptools cannot parse
(a bad request line, header or chunk framing) are answered 400 with the same JSON error
body, not uvicorn's ``text/plain`` one. Open connections are capped (``max_connections``,
by default half the process's open-file limit): one more is answered 503 with
``Retry-After`` and closed at once, so a local process flooding a worker's port with
connections cannot take the descriptors its engine and pool session need (a flood of 4,200
held connections exhausted a worker's 4,096 and failed its requests with 500s).

It lives in ``runtime`` because a worker listens on a port every process of its node can
reach and needs the same bounds; the gateway imports it from here (``gateway → runtime`` is
allowed, ``runtime → gateway`` is not). Body size and read time are bounded by each
server's own middleware (:class:`gateway.limits.BodyLimits`,
:class:`runtime.worker_guard.WorkerGuard`).
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from runtime.errors import error_body

# Wire error types (the gateway's BodyTimeout, BodyTooLarge and EdgeError codes).
TIMEOUT_CODE = "request_timeout"
TOO_LARGE_CODE = "request_too_large"
MALFORMED_CODE = "invalid_request_error"
BUSY_CODE = "server_busy"
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_HEADER_BYTES = 64 << 10


@dataclass(frozen=True, slots=True)
class HeaderLimits:
    """How long a request's line and headers may take to arrive (s), how large they may be, and
    how many connections may be open at once (None: half the open-file limit)."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S  # from a request's first byte to its last header
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES  # request line and headers
    max_connections: int | None = None

    def __post_init__(self) -> None:
        if self.max_connections is not None and not 1 <= self.max_connections <= 1 << 20:
            raise ValueError("max_connections must be in [1, 2**20]")
        if not 1024 <= self.max_header_bytes <= 16 << 20:
            raise ValueError("max_header_bytes must be in [1024, 16 MiB]")
        if not 0 < self.header_timeout_s <= 3600:  # also refuses NaN
            raise ValueError("header_timeout_s must be in (0, 3600] seconds")

    @classmethod
    def from_env(cls) -> HeaderLimits:
        """``EMBER_HEADER_TIMEOUT`` (seconds), ``EMBER_MAX_HEADER_BYTES`` and
        ``EMBER_MAX_CONNECTIONS`` (integers); unset ones keep their defaults, bad ones raise
        ValueError naming the variable."""
        table = (
            ("EMBER_HEADER_TIMEOUT", "header_timeout_s", float),
            ("EMBER_MAX_HEADER_BYTES", "max_header_bytes", int),
            ("EMBER_MAX_CONNECTIONS", "max_connections", int),
        )
        values = env_values(table)
        try:
            return cls(**values)
        except ValueError as exc:
            given = [env for env, _, _ in table if env in os.environ]
            raise ValueError(f"{', '.join(given)}: {exc}") from None


def env_values(table: tuple[tuple[str, str, type[int] | type[float]], ...]) -> dict[str, Any]:
    """``{key: kind(os.environ[env])}`` for each ``(env, key, kind)`` that is set; ValueError
    naming the variable when one does not parse (range checks are the config's own)."""
    values: dict[str, Any] = {}
    for env, key, kind in table:
        raw = os.environ.get(env)
        if raw is None:
            continue
        try:
            values[key] = kind(raw)
        except ValueError:
            raise ValueError(f"{env}={raw!r} is not a valid {kind.__name__}") from None
    return values


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline and a size cap on each request's headers,
    and JSON answers to malformed requests."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S  # set per server by :func:`server_config`
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES  # set per server by :func:`server_config`
    max_connections: int = 1 << 20  # set per server by :func:`server_config`

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0  # received while the current request's headers are incomplete
        # An error answer due once the responses to earlier (pipelined) requests are sent.
        self._refusal: bytes | None = None

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # counts it in server_state.connections
        if len(self.server_state.connections) > self.max_connections:
            message = f"this server has {self.max_connections} connections open; retry shortly"
            self._refuse(b"503 Service Unavailable", BUSY_CODE, message, b"retry-after: 1\r\n")
            return
        self._arm_header_timer()  # a client that connects and sends nothing

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_header_timer()  # a request's first byte: its headers are due in time

    def on_headers_complete(self) -> None:
        # Every armed timer ends here, so between requests none runs: uvicorn's keep-alive
        # timer governs an idle connection until the next request's first byte.
        self._cancel_header_timer()
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            return  # refused: the connection closes once the answers before the refusal are sent
        super().data_received(data)
        # The timer is armed exactly while headers are due: a chunk that leaves them pending
        # counts whole (at most one chunk of a previous request's body is over-counted).
        if self._header_timer is None or self.transport.is_closing():
            self._header_bytes = 0
            return
        self._header_bytes += len(data)
        if self._header_bytes > self.max_header_bytes:
            self._cancel_header_timer()
            message = f"the request line and headers exceed {self.max_header_bytes} bytes"
            self._refuse(b"431 Request Header Fields Too Large", TOO_LARGE_CODE, message)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes httptools cannot parse (it calls this from
        ``data_received``): Ember's JSON error instead of ``text/plain``."""
        self._cancel_header_timer()
        self._refuse(b"400 Bad Request", MALFORMED_CODE, f"malformed HTTP/1.1 request: {msg}")

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        message = f"the request headers did not arrive within {self.header_timeout_s:g} s"
        self._refuse(b"408 Request Timeout", TIMEOUT_CODE, message)

    def on_response_complete(self) -> None:
        if self._refusal is not None and not self.pipeline and not self.transport.is_closing():
            self.transport.write(self._refusal)  # the last response before it is sent: its turn
            self.transport.close()
        super().on_response_complete()

    def _refuse(self, status: bytes, code: str, message: str, extra_headers: bytes = b"") -> None:
        """Answer ``status`` with Ember's JSON error in its turn on the wire, and close."""
        body = json.dumps(error_body(code, message)).encode()
        answer = (
            b"HTTP/1.1 %s\r\ncontent-type: application/json\r\n%s"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (status, extra_headers, len(body), body)
        )
        cycle = self.cycle  # the last request whose headers were read (None: none yet)
        if cycle is None or cycle.response_complete or (cycle.more_body and not cycle.response_started):
            # Nothing is being answered, or the request being received (its body's framing
            # failed) has no response yet: this answer is the next one on the wire.
            self.transport.write(answer)
            self.transport.close()
        elif cycle.more_body:
            self.transport.close()  # its body failed while its response is under way: no answer fits
        else:
            self._refusal = answer  # a later request failed: answer after the earlier ones


def default_max_connections() -> int:
    """Half the process's soft open-file limit: the other half stays for everything else
    (the engine's files, pool sessions, the gateway's connections to workers)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(64, soft // 2) if soft != resource.RLIM_INFINITY else 1 << 20


def server_config(app: Any, limits: HeaderLimits, **options: Any) -> uvicorn.Config:
    """A uvicorn config serving ``app`` with the header bounds of ``limits`` (``options``
    are further ``uvicorn.Config`` arguments)."""
    protocol = type(
        "EmberHttpProtocol",
        (HeaderTimeoutProtocol,),
        {
            "header_timeout_s": limits.header_timeout_s,
            "max_header_bytes": limits.max_header_bytes,
            # Resolved now, after a worker has set its own open-file limit (runtime.worker_limits).
            "max_connections": limits.max_connections or default_max_connections(),
        },
    )
    return uvicorn.Config(app, http=protocol, **options)
