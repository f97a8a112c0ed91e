"""A worker's HTTP server against hostile clients: header read timeout, header size cap,
malformed framing (issue 10). The gateway's server is tested the same way in
``tests/gateway/test_edge.py``; both are :mod:`runtime.http_server`.

One real pre-warmed worker process (``python -m runtime``, no model, credential on stdin)
with a 1 s header timeout; raw sockets control every byte and show what happens to the
connection. Nothing here needs the credential: every request is refused before routing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.worker_guard import TOKEN_HEADER
from tests.proc_memory import memory_kib
from tests.rawhttp import assert_error, closed_by_peer, connect, read_response, request_bytes

pytestmark = pytest.mark.slow

MB = 1 << 20
REPO = Path(__file__).resolve().parents[2]
TOKEN = "worker-http-" + "t" * 20
MAX_CONNECTIONS = 8


def start_worker(env: dict[str, str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime", "--port", "0"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, **env},
    )  # fmt: skip
    return proc


@pytest.fixture(scope="module")
def worker() -> Iterator[tuple[str, int]]:
    """(URL, pid) of a pre-warmed worker with 1 s header and body timeouts, a 64 KiB header
    cap and at most ``MAX_CONNECTIONS`` connections."""
    env = {
        "EMBER_HEADER_TIMEOUT": "1",
        "EMBER_BODY_TIMEOUT": "1",
        "EMBER_MAX_HEADER_BYTES": str(64 << 10),
        "EMBER_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
    }
    proc = start_worker(env)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(TOKEN + "\n")  # the credential, as the agent sends it
        proc.stdin.close()
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        yield json.loads(line)["url"], proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for pipe in (proc.stdout, proc.stderr):
            assert pipe is not None
            pipe.close()


def test_slow_headers_are_408_after_the_header_timeout(worker: tuple[str, int]) -> None:
    url, _ = worker
    with connect(url) as sock:
        t0 = time.perf_counter()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\n")
        for byte in b"x-slow: 1234567890":  # one byte every 0.2 s, for longer than the timeout
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(0.2)
            if time.perf_counter() - t0 > 1.5:
                break
        assert_error(read_response(sock), 408, "request_timeout")
        assert closed_by_peer(sock)
        assert time.perf_counter() - t0 < 3.0
    with connect(url) as idle:  # connected, nothing sent: closed after the timeout too
        t0 = time.perf_counter()
        assert_error(read_response(idle), 408, "request_timeout")
        assert 0.9 < time.perf_counter() - t0 < 3.0


def test_oversized_headers_are_431_without_memory_growth(worker: tuple[str, int]) -> None:
    url, pid = worker
    before = memory_kib(pid)["VmHWM"]
    with connect(url) as sock:
        line = b"x-big: " + b"a" * MB + b"\r\n"

        def send() -> None:
            try:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: t\r\n")
                for _ in range(64):
                    sock.sendall(line)
            except OSError:
                pass  # the worker closed the connection: expected

        sender = threading.Thread(target=send)
        sender.start()
        assert_error(read_response(sock), 431, "request_too_large")
        assert closed_by_peer(sock)
        sender.join(10)
    assert memory_kib(pid)["VmHWM"] - before < 24 << 10
    with connect(url) as sock:  # many small headers within the cap still serve
        extra = b"".join(b"x-h%d: v\r\n" % i for i in range(500))
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: t\r\n" + extra + b"\r\n")
        assert read_response(sock).status == 200


@pytest.mark.parametrize(
    "raw",
    [
        b"NOT HTTP AT ALL\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nbad header line\r\n\r\n",
        # Chunk framing that is not hex, on a request whose headers were fine.
        b"POST /invoke HTTP/1.1\r\nhost: t\r\n" + TOKEN_HEADER.encode() + b": " + TOKEN.encode()
        + b"\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
    ],
)  # fmt: skip
def test_malformed_requests_are_400_with_a_json_body(worker: tuple[str, int], raw: bytes) -> None:
    url, _ = worker
    with connect(url) as sock:
        sock.sendall(raw)
        response = read_response(sock)
        assert "malformed HTTP/1.1 request" in assert_error(response, 400, "invalid_request_error")
        assert response.headers["connection"] == "close"
        assert closed_by_peer(sock)


def test_a_keep_alive_connection_outlives_the_header_timeout(worker: tuple[str, int]) -> None:
    url, _ = worker
    with connect(url) as sock:
        for _ in range(3):  # requests 0.6 s apart on one connection, 1.8 s > the 1 s timeout
            sock.sendall(request_bytes("GET", "/healthz"))
            assert read_response(sock).status == 200
            time.sleep(0.6)


def test_a_request_without_the_credential_is_401_and_closed_before_its_body(worker: tuple[str, int]) -> None:
    """The worker does not wait for the body of a request it refuses (a flood of such requests,
    each declaring a body it never sends, held 4,096 connections for ~75 s each)."""
    url, _ = worker
    with connect(url) as sock:
        t0 = time.perf_counter()
        sock.sendall(b"POST /invoke HTTP/1.1\r\nhost: t\r\ncontent-length: 1000\r\n\r\n")
        response = read_response(sock)
        assert_error(response, 401, "unauthorized")
        assert response.headers["connection"] == "close"
        assert closed_by_peer(sock) and time.perf_counter() - t0 < 0.9  # not the 1 s body timeout


def test_a_body_that_does_not_arrive_in_time_is_408(worker: tuple[str, int]) -> None:
    url, _ = worker
    head = f"POST /invoke HTTP/1.1\r\nhost: t\r\n{TOKEN_HEADER}: {TOKEN}\r\ncontent-length: 100\r\n\r\n"
    with connect(url) as sock:
        t0 = time.perf_counter()
        sock.sendall(head.encode() + b'{"a": ')  # then nothing more
        assert "did not arrive within 1 s" in assert_error(read_response(sock), 408, "request_timeout")
        assert closed_by_peer(sock)
        assert 0.9 < time.perf_counter() - t0 < 3.0


def test_connections_beyond_the_cap_are_503_and_closed_at_once(worker: tuple[str, int]) -> None:
    url, _ = worker
    held = [connect(url) for _ in range(MAX_CONNECTIONS)]
    try:
        for sock in held:  # each idles on keep-alive after a request (no header timer runs)
            sock.sendall(request_bytes("GET", "/healthz"))
            assert read_response(sock).status == 200
        with connect(url) as extra:
            response = read_response(extra)
            assert "connections open" in assert_error(response, 503, "server_busy")
            assert response.headers["retry-after"] == "1"
            assert closed_by_peer(extra)
        held.pop().close()
        time.sleep(0.1)
        with connect(url) as again:  # below the cap: served
            again.sendall(request_bytes("GET", "/healthz"))
            assert read_response(again).status == 200
        for sock in held:  # the held connections still serve
            sock.sendall(request_bytes("GET", "/healthz"))
            assert read_response(sock).status == 200
    finally:
        for sock in held:
            sock.close()


@pytest.mark.parametrize(
    "env",
    [
        {"EMBER_HEADER_TIMEOUT": "0"},
        {"EMBER_HEADER_TIMEOUT": "soon"},
        {"EMBER_MAX_HEADER_BYTES": "1"},
        {"EMBER_MAX_CONNECTIONS": "0"},
        {"EMBER_BODY_TIMEOUT": "-1"},
    ],
)
def test_bad_header_limits_stop_the_worker_loudly(env: dict[str, str]) -> None:
    proc = start_worker(env)
    try:
        out, err = proc.communicate(TOKEN + "\n", timeout=60)
    finally:
        if proc.poll() is None:  # it started after all: stop it
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 2 and out == ""
    assert next(iter(env)) in err
