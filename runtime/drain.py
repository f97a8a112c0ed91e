"""Serving until SIGTERM, then draining: how a worker ends inside someone else's container.

Knative and OpenWhisk stop a container with SIGTERM and SIGKILL it after a grace period.
:func:`serve_draining` serves an app while the worker starts (readiness 503), then until
SIGTERM or SIGINT. The signal marks the worker draining (readiness 503 again), uvicorn stops
accepting connections, lets in-flight requests (streams included) finish for at most
``grace_s`` seconds, cancels what is left, and runs the app's shutdown (the worker closes
its pool session: the weights stay resident for the next instance). The process then exits
0, since a requested stop is not a failure. uvicorn's own signal capture is not used: it
re-raises the signal once it has shut down, and the process would die of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import socket
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn

from runtime.http_server import HeaderLimits, server_config
from runtime.worker import KEEP_ALIVE_S

log = logging.getLogger("ember.worker")


@dataclass
class Lifecycle:
    """Where a draining worker is: ready once started, draining once told to stop."""

    ready: bool = False
    draining: bool = False

    @property
    def serving(self) -> bool:
        return self.ready and not self.draining

    def readiness(self) -> tuple[int, dict[str, str]]:
        """``/readyz``'s status code and body."""
        if self.draining:
            return 503, {"status": "draining"}
        if not self.ready:
            return 503, {"status": "starting"}
        return 200, {"status": "ready"}


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the signals are serve_draining's (see the module docstring)


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (IPv6 when ``host`` has a colon), not yet listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP: asyncio sets TCP_NODELAY only for it (else ~40 ms Nagle stalls per response).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


async def serve_draining(
    app: Any,
    sock: socket.socket,
    grace_s: float,
    lifecycle: Lifecycle,
    start: Callable[[], Coroutine[Any, Any, None]] | None = None,
    on_drain: Callable[[], Coroutine[Any, Any, None]] | None = None,
    headers: HeaderLimits | None = None,
) -> int:
    """Serve ``app`` on ``sock`` while ``start`` runs and afterwards, until SIGTERM or SIGINT.

    ``lifecycle.ready`` turns true once ``start`` returned; ``on_drain`` runs when the signal
    arrives (concurrently with the drain). Returns 0 after a drain, 1 when ``start`` failed
    (logged; the server then stops at once). ``headers``: the request-head bounds (default:
    ``EMBER_HEADER_TIMEOUT`` / ``EMBER_MAX_HEADER_BYTES``), as every Ember HTTP server has.
    """
    config = server_config(
        app,
        headers or HeaderLimits.from_env(),
        log_level="warning",
        lifespan="on",
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=math.ceil(grace_s),  # whole seconds, as uvicorn types it
    )
    server = _Server(config)
    loop = asyncio.get_running_loop()
    starting = asyncio.create_task(start()) if start is not None else None
    draining: list[asyncio.Task[None]] = []

    def terminate() -> None:
        if not lifecycle.draining:
            lifecycle.draining = True
            log.info("stop requested: draining (at most %.0f s)", grace_s)
            if starting is not None and not starting.done():
                starting.cancel()  # a start still waiting (for its pool, say) is abandoned
            if on_drain is not None:
                draining.append(asyncio.create_task(on_drain()))
        server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, terminate)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    code = 0
    try:
        if starting is not None:
            await starting
        lifecycle.ready = True
    except asyncio.CancelledError:
        if not starting or not starting.cancelled() or not lifecycle.draining:
            raise  # not the stop's cancellation: our own caller's
    except Exception:
        log.exception("the worker failed to start")
        code = 1
        server.should_exit = True
    try:
        await serving
        for task in draining:
            try:
                await task
            except Exception:  # reporting the drain is best effort: the drain itself happened
                log.exception("reporting the drain failed")
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return code
