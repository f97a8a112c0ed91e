"""The worker's Server-Timing header: the middleware over a real server, and its parser."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from runtime.server_timing import ServerTiming, duration_ms


@pytest.mark.parametrize(
    ("header", "metric", "expected"),
    [
        ("worker;dur=12.5", "worker", 12.5),
        ('cache;desc="hit", worker;dur=3', "worker", 3.0),
        ("worker;desc=x;dur=0.25", "worker", 0.25),
        ("gateway;dur=1", "worker", None),
        ("worker;dur=abc", "worker", None),
        ("worker", "worker", None),
        ("", "worker", None),
        (None, "worker", None),
    ],
)
def test_duration_ms_parses_the_named_metric(header: str | None, metric: str, expected: float | None) -> None:
    assert duration_ms(header, metric) == expected


def test_middleware_times_the_app_over_a_real_socket() -> None:
    async def slow(request: Request) -> Response:
        await asyncio.sleep(0.05)
        return JSONResponse({"ok": True})

    app = ServerTiming(Starlette(routes=[Route("/slow", slow, methods=["POST"])]))

    async def run() -> httpx.Response:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            async with httpx.AsyncClient() as client:
                return await client.post(f"http://127.0.0.1:{port}/slow")
        finally:
            server.should_exit = True
            await task

    response = asyncio.run(run())
    assert response.status_code == 200 and response.json() == {"ok": True}
    dur = duration_ms(response.headers.get("server-timing"))
    assert dur is not None and 50.0 <= dur < 5_000.0
