"""The node agent's control line to a worker it started: the assign, without HTTP.

An assign is on an instance start's critical path twice: the acquire it makes waits for it,
and the requests routed to the worker meanwhile wait for the acquire. Over HTTP it cost
~1.4 ms from the agent's POST to the worker's pool acquire on a 2-core host (the client's
request, then the server's parse, ASGI stack and routing, with every process of the start
competing for the cores); over this line it is one ``send`` and one ``recv``.

The line is a ``SOCK_SEQPACKET`` socketpair the agent opens when it spawns the worker (as it
does the token scheduler's, :mod:`runtime.mesh`): nobody else can speak on it, so it needs no
credential. Each call is one message each way, in this versioned encoding (network order)::

    magic b"EMBc" | version u8 | kind u8 | call id u32 | status u16 | body (JSON, runtime.messages)

A request is :data:`KIND_ASSIGN` with status 0; its reply :data:`KIND_REPLY` with the call's id
and the HTTP status the worker's ``/_ember/assign`` route would have answered, its body the
same JSON. Before the reply, the worker may send :data:`KIND_SERVING` (the call's id, status 0,
no body): the assign took, and the worker serves the instance's first requests while its reply
waits for their first outputs (``runtime.early_requests.Handover``). A worker that exits after
that, before its reply, ended as a serving instance, not as a failed start
(:class:`ExitedServing`). A reply whose id (random) is not the call's (one of a call given up
on) is dropped. A body over :data:`MAX_BODY_BYTES` goes over HTTP instead (:func:`fits`), and
so does one the line refuses whole (:class:`LineTooSmall`). The worker serves one message at a
time, in order (an assign is one at a time anyway); a malformed one is answered 400 when its id
can be read, and dropped otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import json
import logging
import secrets
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from runtime.errors import LaunchError, error_body
from runtime.worker_client import WorkerCallFailed, WorkerReply, WorkerUnreachable

MAGIC = b"EMBc"
VERSION = 2  # 2: KIND_SERVING
KIND_ASSIGN = 1
KIND_REPLY = 2
KIND_SERVING = 3
HEADER = struct.Struct("!4sBBIH")  # magic, version, kind, call id, status
# The largest body sent over the line (bytes): within a socket's default send buffer (one
# message must fit it whole); an assign is a few KiB (its spec is bounded far below this).
MAX_BODY_BYTES = 128 << 10
MAX_MESSAGE_BYTES = HEADER.size + MAX_BODY_BYTES

log = logging.getLogger("ember.worker")


class Message(NamedTuple):
    kind: int
    call_id: int
    status: int
    body: bytes


def encode(kind: int, call_id: int, status: int, body: bytes) -> bytes:
    """One message of the line (see the module docstring)."""
    if len(body) > MAX_BODY_BYTES:
        raise ValueError(f"a control message body is at most {MAX_BODY_BYTES} bytes, got {len(body)}")
    return HEADER.pack(MAGIC, VERSION, kind, call_id, status) + body


def decode(raw: bytes) -> Message:
    """The message in ``raw``; ValueError when it is not one of this version."""
    if len(raw) < HEADER.size:
        raise ValueError(f"a control message is at least {HEADER.size} bytes, got {len(raw)}")
    magic, version, kind, call_id, status = HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise ValueError("not a control message (bad magic)")
    if version != VERSION:
        raise ValueError(f"control message version {version}, this worker speaks {VERSION}")
    if kind not in (KIND_ASSIGN, KIND_REPLY, KIND_SERVING):
        raise ValueError(f"unknown control message kind {kind}")
    return Message(kind, call_id, status, raw[HEADER.size :])


def fits(body: bytes) -> bool:
    """Whether ``body`` can go over the line (else over HTTP)."""
    return len(body) <= MAX_BODY_BYTES


class ExitedServing(WorkerCallFailed):
    """The worker exited after it said it serves the call's instance (:data:`KIND_SERVING`),
    before its reply: the instance started and then died."""


class LineTooSmall(LaunchError):
    """The line refused a message whole (its socket buffer is smaller than the message, as
    ``net.core.wmem_max`` may cap it): nothing was delivered; the caller goes over HTTP."""


def new_pair() -> tuple[socket.socket, socket.socket]:
    """(the agent's end, the worker's end) of a new line, each able to queue a whole message
    of :data:`MAX_MESSAGE_BYTES` where the host allows it (else :class:`LineTooSmall`)."""
    ends = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for end in ends:
        end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2 * MAX_MESSAGE_BYTES)
    return ends


class Caller:
    """The agent's end of one worker's line: one call at a time."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.num_calls = 0  # calls sent (delivered to the worker's end)
        self._lock = asyncio.Lock()
        self._in_flight = False
        self._closing = False

    async def assign(self, body: bytes, timeout_s: float) -> WorkerReply:
        """Send an assign; the worker's reply. :class:`WorkerUnreachable` when nothing was
        delivered (the worker's end is closed), :class:`LineTooSmall` when the line cannot
        take the message, :class:`WorkerCallFailed` when no reply came within ``timeout_s``
        (the wait for an earlier call and the send included) or the line broke after the send,
        :class:`ExitedServing` when the worker exited after it said it serves."""
        loop = asyncio.get_running_loop()
        sent = serving = False
        try:
            async with asyncio.timeout(timeout_s), self._lock:
                if self._closing:
                    raise WorkerUnreachable("the worker's control line is closed")
                self._in_flight = True
                call_id = secrets.randbits(32)  # (a reply queued ahead cannot guess it)
                try:
                    await loop.sock_sendall(self.sock, encode(KIND_ASSIGN, call_id, 0, body))
                except OSError as exc:  # a whole message is queued or none of it (SEQPACKET)
                    if exc.errno in (errno.EMSGSIZE, errno.ENOBUFS):
                        raise LineTooSmall(f"the worker's control line: {exc}") from None
                    raise WorkerUnreachable(f"the worker's control line: {exc}") from None
                sent = True
                self.num_calls += 1
                while True:
                    raw = await loop.sock_recv(self.sock, MAX_MESSAGE_BYTES + 1)
                    if not raw and serving:
                        raise ExitedServing("the worker exited while it served its first requests")
                    if not raw:
                        raise WorkerCallFailed("the worker closed its control line (it exited)")
                    try:
                        reply = decode(raw)
                    except ValueError as exc:
                        raise WorkerCallFailed(f"a malformed control reply: {exc}") from None
                    if reply.call_id != call_id:
                        continue  # a reply to a call given up on (its worker is ended by then)
                    if reply.kind == KIND_REPLY:
                        return WorkerReply(reply.status, reply.body)
                    serving = serving or reply.kind == KIND_SERVING
        except TimeoutError:
            what = "no reply" if sent else "the line was not free"
            raise WorkerCallFailed(f"{what} on the control line within {timeout_s:g} s") from None
        except OSError as exc:
            if serving:  # (a close can read as a reset)
                raise ExitedServing(f"the worker's control line broke while it served: {exc}") from None
            raise WorkerCallFailed(f"the worker's control line: {exc}") from None
        finally:
            self._in_flight = False
            if self._closing:
                self.sock.close()

    def close(self) -> None:
        """Close the agent's end; a call waiting on it fails at once: the end is shut down,
        which ends the call's read, and closed after it (closed under a pending read, it
        would leave the call to its timeout)."""
        self._closing = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        if not self._in_flight:
            self.sock.close()


# What the worker does with an assign's body, given a callable that sends KIND_SERVING for it:
# (HTTP status, JSON reply body, then-task or None).
AssignHandler = Callable[
    [bytes, Callable[[], None]], Awaitable[tuple[int, bytes, Callable[[], Awaitable[None]] | None]]
]


class LineServer:
    """The worker's end of its line: serves each message with ``handler``, one at a time."""

    def __init__(self, sock: socket.socket, handler: AssignHandler) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.handler = handler
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Serve on the running loop until the agent closes its end."""
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                raw = await loop.sock_recv(self.sock, MAX_MESSAGE_BYTES + 1)
            except OSError as exc:
                log.warning("the control line failed: %s", exc)
                return
            if not raw:  # the agent closed its end: assigns come over HTTP, if any
                return
            await self._serve_one(raw)

    async def _serve_one(self, raw: bytes) -> None:
        # (A method of its own: what the handler returned, its then-task holding the engine
        # say, is not kept alive while the line waits for the next message.)
        try:
            message = decode(raw)
            if message.kind != KIND_ASSIGN:
                raise ValueError(f"a worker takes assigns, not kind {message.kind}")
            if len(raw) > MAX_MESSAGE_BYTES:
                raise ValueError(f"a control message is at most {MAX_MESSAGE_BYTES} bytes")
        except ValueError as exc:
            if len(raw) >= HEADER.size:  # its id is readable: answered like a bad request
                call_id = HEADER.unpack_from(raw)[3]
                await self._reply(call_id, 400, _error_body("invalid_request_error", str(exc)))
            else:
                log.warning("a malformed control message was dropped: %s", exc)
            return
        try:
            status, body, then = await self.handler(
                message.body, functools.partial(self._serving, message.call_id)
            )
        except Exception as exc:  # a bug: answered, logged, and the line serves on
            log.exception("an assign over the control line failed")
            status, body, then = 500, _error_body("internal_error", f"{type(exc).__name__}: {exc}"), None
        await self._reply(message.call_id, status, body)
        if then is not None:
            try:
                await then()
            except Exception:
                log.exception("the work after an assign's reply failed")

    def _serving(self, call_id: int) -> None:
        """Tell the agent that the assign ``call_id`` took and its instance serves (one small
        message, sent at once: a full buffer drops it, and the reply still follows)."""
        with contextlib.suppress(OSError):
            self.sock.send(encode(KIND_SERVING, call_id, 0, b""))

    async def _reply(self, call_id: int, status: int, body: bytes) -> None:
        if len(body) > MAX_BODY_BYTES:  # (a reply is a small document: never in practice)
            status, body = 500, _error_body("reply_too_large", f"a reply of {len(body)} bytes")
        with contextlib.suppress(OSError):  # the agent is gone: it ends this worker
            await asyncio.get_running_loop().sock_sendall(
                self.sock, encode(KIND_REPLY, call_id, status, body)
            )

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.sock.close()


def _error_body(kind: str, message: str) -> bytes:
    return json.dumps(error_body(kind, message)).encode()
