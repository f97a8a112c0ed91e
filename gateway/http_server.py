"""The gateway's uvicorn server: httptools with a header read timeout.

uvicorn bounds how long an idle keep-alive connection lives (``timeout_keep_alive``) but
not how long a client may take to send a request line and headers: a slow client
("slowloris") sending one header byte at a time holds a connection forever.
:class:`HeaderTimeoutProtocol` arms a timer when a connection opens and when a request's
first byte arrives, and cancels it once the headers are complete; on expiry it answers 408
(JSON error body, ``Connection: close``) and closes the connection. Body read time is
bounded separately (:class:`gateway.limits.BodyLimits`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.limits import BodyTimeout, EdgeLimits


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on each request's headers."""

    header_timeout_s: float = 10.0  # seconds; set per server by :func:`server_config`

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

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

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:  # no response under way
            message = f"the request headers did not arrive within {self.header_timeout_s:g} s"
            body = json.dumps({"error": {"type": BodyTimeout.code, "message": message}}).encode()
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
            )
        self.transport.close()


def server_config(app: Any, limits: EdgeLimits, **options: Any) -> uvicorn.Config:
    """A uvicorn config serving ``app`` with the header timeout of ``limits`` (``options``
    are further ``uvicorn.Config`` arguments)."""
    protocol = type(
        "EmberHttpProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": limits.header_timeout_s}
    )
    return uvicorn.Config(app, http=protocol, **options)
