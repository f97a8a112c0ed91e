"""The gateway's uvicorn server: httptools with a header read timeout.

uvicorn bounds how long an idle keep-alive connection lives (``timeout_keep_alive``) but
not how long a client may take to send a request line and headers: a slow client
("slowloris") sending one header byte at a time holds a connection forever.
:class:`HeaderTimeoutProtocol` arms a timer when a connection opens and when a request's
first byte arrives, and cancels it once the headers are complete; on expiry it answers 408
(JSON error body, ``Connection: close``) and closes the connection. httptools also buffers
a request line and headers whole, with no bound: bytes received while a request's headers
are incomplete are counted, and past ``max_header_bytes`` the request is answered 431 the
same way (a 300 MB header line grew the gateway by 300 MB). Body read time and size are
bounded separately (:class:`gateway.limits.BodyLimits`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.limits import BodyTimeout, BodyTooLarge, EdgeLimits


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on each request's headers."""

    header_timeout_s: float = 10.0  # seconds; set per server by :func:`server_config`
    max_header_bytes: int = 64 << 10  # bytes; set per server by :func:`server_config`

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0  # received while the current request's headers are incomplete

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
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
            self._refuse(b"431 Request Header Fields Too Large", BodyTooLarge.code, message)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        message = f"the request headers did not arrive within {self.header_timeout_s:g} s"
        self._refuse(b"408 Request Timeout", BodyTimeout.code, message)

    def _refuse(self, status: bytes, code: str, message: str) -> None:
        """Answer ``status`` with Ember's JSON error (unless a response is under way) and close."""
        if self.cycle is None or self.cycle.response_complete:  # no response under way
            body = json.dumps({"error": {"type": code, "message": message}}).encode()
            self.transport.write(
                b"HTTP/1.1 %s\r\ncontent-type: application/json\r\n"
                b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body)
            )
        self.transport.close()


def server_config(app: Any, limits: EdgeLimits, **options: Any) -> uvicorn.Config:
    """A uvicorn config serving ``app`` with the header timeout of ``limits`` (``options``
    are further ``uvicorn.Config`` arguments)."""
    protocol = type(
        "EmberHttpProtocol",
        (HeaderTimeoutProtocol,),
        {"header_timeout_s": limits.header_timeout_s, "max_header_bytes": limits.max_header_bytes},
    )
    return uvicorn.Config(app, http=protocol, **options)
