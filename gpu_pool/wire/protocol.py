"""Wire format of the pool protocol: length-prefixed, versioned msgpack messages.

A frame is a 4-byte big-endian unsigned length followed by that many bytes of msgpack.
Every request is a map with ``v`` (protocol version), ``op`` and an ``id`` the reply
echoes. Replies carry ``ok``; failures carry ``error: {type, message, ...details}`` where
``type`` is a :class:`gpu_pool.errors.PoolError` code. A reply with ``fds: N`` is followed on
the stream by one marker byte carrying N descriptors (``SCM_RIGHTS``, :mod:`gpu_pool.wire.fdpass`).
Requests are validated into typed messages by :mod:`gpu_pool.wire.messages`. ``kv_publish`` and
``kv_restore`` (prefix KV shared across instances, :mod:`gpu_pool.server.prefix_kv`) are ops of
version 1 too: a daemon from before them answers ``unknown_op``, which clients treat as "no
sharing". An ``acquire``
reply carries ``placements`` (tensor name -> arena offset) and ``report``, an
:class:`gpu_pool.acquire_report.AcquireReport` in its own versioned encoding. Never pickle.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import msgpack

from gpu_pool.errors import MessageTooLarge, PoolError, ProtocolError, UnknownOp, UnsupportedVersion
from gpu_pool.wire.messages import MESSAGES

PROTOCOL_VERSION = 1
# What this daemon does beyond version 1's first form, told in ``hello`` (a daemon that does not
# say "keep_kv" ignores ``release``'s ``keep_kv`` and frees the blocks: a client must not count
# on keeping them; "prefix_prefetch": ``kv_alloc``'s ``prefix`` and ``kv_restore``'s ``first``,
# which an older daemon ignores, an offer either way; "reacquire": the ``reacquire`` op, which
# an older daemon refuses as an unknown op).
FEATURES = ("keep_kv", "prefix_prefetch", "reacquire")
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20  # a 300-tensor manifest is ~60 KB; 16 MiB is generous
OPS = frozenset(MESSAGES)
_HEADER = struct.Struct(">I")


def encode(message: dict[str, Any]) -> bytes:
    """One frame: length prefix + msgpack body."""
    body: bytes = msgpack.packb(message, use_bin_type=True)
    return _HEADER.pack(len(body)) + body


def decode_request(body: bytes) -> dict[str, Any]:
    """Parse and validate a request body (raises a :class:`ProtocolError` subclass)."""
    message = _unpack(body)
    version = message.get("v")
    if version != PROTOCOL_VERSION:
        raise UnsupportedVersion(f"protocol version {version!r} is not supported (this daemon speaks 1)")
    op = message.get("op")
    if op not in OPS:
        raise UnknownOp(f"unknown op {op!r}; known ops: {', '.join(sorted(OPS))}")
    return message


def decode_reply(body: bytes) -> dict[str, Any]:
    """Parse a reply body."""
    return _unpack(body)


def error_reply(exc: PoolError, request_id: Any = None) -> dict[str, Any]:
    """The reply for a failed request."""
    return {
        "v": PROTOCOL_VERSION,
        "id": request_id,
        "ok": False,
        "error": {"type": exc.code, "message": str(exc), **exc.details()},
    }


def encode_reply(reply: dict[str, Any]) -> bytes:
    """``reply`` as a frame; a reply msgpack cannot carry (an integer past 64 bits, say)
    becomes a typed error reply instead of a dropped connection."""
    try:
        return encode(reply)
    except (OverflowError, ValueError, TypeError) as exc:
        failure = PoolError(f"internal error: the reply cannot be encoded ({type(exc).__name__}: {exc})")
        request_id = reply.get("id")
        if not isinstance(request_id, (int, str, type(None))):
            request_id = None
        return encode(error_reply(failure, request_id))


def _unpack(body: bytes) -> dict[str, Any]:
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(f"message is not valid msgpack: {type(exc).__name__}") from None
    if not isinstance(message, dict):
        raise ProtocolError("message must be a msgpack map")
    return message


async def read_frame(reader: asyncio.StreamReader, limit: int) -> bytes:
    """Read one frame body. Raises ``IncompleteReadError`` at EOF and
    :class:`MessageTooLarge` (after reading only the header) for oversized frames."""
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > limit:
        raise MessageTooLarge(size, limit)
    return await reader.readexactly(size)


def send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    """Blocking send of one frame."""
    sock.sendall(encode(message))


def recv_frame(sock: socket.socket, limit: int = DEFAULT_MAX_MESSAGE_BYTES) -> bytes:
    """Blocking receive of one frame body; ``ConnectionError`` at EOF."""
    (size,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    if size > limit:
        raise MessageTooLarge(size, limit)
    return _recv_exactly(sock, size)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("pool daemon closed the connection")
        got += k
    return bytes(buf)
