"""First-use costs of the serving path, paid by a pre-warmed worker before it is ready.

Python loads much of a request's path lazily, on first use: a process's first streamed
response imports anyio's asyncio backend and starlette's task-group code: 11-53 ms of an
instance's first request on 2 busy cores, 136 ms in a fresh interpreter. The instance's
first request would pay that on the cold path, after its client already waited for the
instance to start; :func:`rehearse` pays it while the worker still waits for a function (the
model's own first passes are :func:`runtime.instance.warm_up`). It starts no thread: threads
started before the function's sandbox layer would escape it (:mod:`runtime.function_sandbox`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse
from starlette.types import Message

# What uvicorn puts in an HTTP scope (its protocols announce ASGI spec 2.3: starlette then
# streams inside a task group that also listens for the client's disconnect).
_SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "POST", "headers": []}


async def _events() -> AsyncIterator[bytes]:
    yield b'data: {"rehearsal": true}\n\n'
    yield b"data: [DONE]\n\n"


async def rehearse() -> float:
    """Stream one response into nowhere, as uvicorn would run it; returns the seconds spent."""
    t0 = time.perf_counter()
    sent: list[Message] = []
    never = asyncio.Event()  # the rehearsal's "client" never disconnects: the stream ends it

    async def receive() -> Message:
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await StreamingResponse(_events(), media_type="text/event-stream")(dict(_SCOPE), receive, send)
    assert sent and sent[-1].get("more_body") is False, "the rehearsal stream did not complete"
    return time.perf_counter() - t0
