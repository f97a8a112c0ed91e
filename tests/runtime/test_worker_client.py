"""The agent's client for workers' ``/_ember/*`` routes: typed failures (nothing delivered vs
maybe delivered), replies bounded in size, connections reused. Real sockets."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from runtime.worker_client import MAX_REPLY_BYTES, WorkerCallFailed, WorkerClient, WorkerUnreachable
from runtime.worker_handle import WorkerHandle


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def handle_for(url: str) -> WorkerHandle:
    proc = await asyncio.create_subprocess_exec("sleep", "30")  # stands for the worker's process
    return WorkerHandle(proc, url, Path("/dev/null"), "token")


def test_failures_are_typed_replies_bounded_and_connections_reused() -> None:
    async def scenario() -> None:
        connections = 0

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            connections += 1
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                await reader.readexactly(length)
                path = head.split(b" ")[1]
                if path.endswith(b"/hangup"):
                    writer.close()
                    return
                body = b"x" * (MAX_REPLY_BYTES + 1) if path.endswith(b"/huge") else b'{"ok": true}'
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
                await writer.drain()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = WorkerClient(timeout_s=5.0)
        worker = await handle_for(f"http://127.0.0.1:{port}")
        nobody = await handle_for(f"http://127.0.0.1:{free_port()}")
        try:
            for _ in range(3):
                reply = await client.post(worker, "threads", '{"num_threads": 1}')
                assert reply.status == 200 and reply.content == b'{"ok": true}'
            assert connections == 1  # kept alive between calls
            with pytest.raises(WorkerUnreachable):
                await client.post(nobody, "assign", "{}")
            with pytest.raises(WorkerCallFailed, match="reply over"):
                await client.post(worker, "huge", "{}")
            with pytest.raises(WorkerCallFailed):
                await client.post(worker, "hangup", "{}")
        finally:
            await client.close()
            for handle in (worker, nobody):
                handle.kill()
                await handle.proc.wait()
            server.close()
            await server.wait_closed()

    asyncio.run(scenario())


def test_an_error_reply_gives_its_message() -> None:
    from runtime.worker_client import WorkerReply

    reply = WorkerReply(409, b'{"error": {"message": "already assigned", "type": "x"}}')
    assert reply.error_message() == "already assigned"
    assert (
        WorkerReply(502, b"<html>bad gateway</html>").error_message() == "HTTP 502: <html>bad gateway</html>"
    )
