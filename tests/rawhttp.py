"""HTTP/1.1 over a raw socket, for tests that need control over every byte and the connection."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def connect(url: str, timeout: float = 10.0) -> socket.socket:
    """A TCP connection to the server at ``url`` (``http://host:port``)."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def request_bytes(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    """One complete request with a ``Content-Length`` body."""
    head = {"host": "test", "content-length": str(len(body)), **(headers or {})}
    lines = "".join(f"{k}: {v}\r\n" for k, v in head.items())
    return f"{method} {path} HTTP/1.1\r\n{lines}\r\n".encode() + body


def read_response(sock: socket.socket) -> RawResponse:
    """Read one response (``Content-Length`` framed, as the gateway's JSON answers are)."""
    return read_responses(sock, 1)[0]


def read_responses(sock: socket.socket, count: int) -> list[RawResponse]:
    """Read ``count`` responses in a row (pipelined requests' answers may share a read)."""
    data = b""
    responses = []
    while len(responses) < count:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"connection closed before a response: {data!r}")
            data += chunk
        head, _, data = data.partition(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        while len(data) < length:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("connection closed mid-body")
            data += chunk
        responses.append(RawResponse(int(status_line.split()[1]), headers, data[:length]))
        data = data[length:]
    return responses


def closed_by_peer(sock: socket.socket, timeout: float = 2.0) -> bool:
    """Whether the server closed the connection (EOF or reset) within ``timeout``."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def assert_error(response: RawResponse, status: int, kind: str) -> str:
    """``response`` is a ``status`` JSON error of type ``kind``; returns its message."""
    assert response.status == status, (response.status, response.body)
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"type", "message", "param", "code"}, body
    assert body["error"]["type"] == kind, body
    return str(body["error"]["message"])
