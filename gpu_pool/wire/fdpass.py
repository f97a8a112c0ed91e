"""Passing descriptors (the arena memfd, a session's KV memfd) over the pool socket.

A reply that carries descriptors says so with ``"fds": N``; right after its frame the daemon
sends one marker byte (``b"F"``) with the N descriptors attached as ``SCM_RIGHTS``. The client
reads the frame with plain ``recv`` (exactly its length, so it never touches the marker) and
then the marker with ``recvmsg``, which is the only way to receive the descriptors.

asyncio's ``StreamWriter`` cannot send ancillary data, so the daemon side works around it:
the connection's write buffer limits are 0 (so ``drain()`` returns only once every queued
byte has reached the socket), then the marker goes out with ``sendmsg`` on a duplicate of the
transport's socket descriptor. Nothing else writes to the connection meanwhile: one handler
task answers one request at a time. The byte order on the stream is therefore frame, marker,
next frame.
"""

from __future__ import annotations

import array
import asyncio
import os
import socket
import time

from gpu_pool.errors import ProtocolError

MARKER = b"F"
MAX_FDS = 4  # a reply carries at most the arena's and the session's KV descriptor
SEND_TIMEOUT_S = 10.0  # a peer that does not read for this long has its session closed


def prepare(writer: asyncio.StreamWriter) -> None:
    """Make ``drain()`` wait until the write buffer is empty (call once per connection)."""
    writer.transport.set_write_buffer_limits(high=0, low=0)


async def send_fds(writer: asyncio.StreamWriter, fds: list[int]) -> None:
    """Send the marker byte with ``fds`` after everything already written (raises OSError)."""
    await writer.drain()
    transport = writer.transport
    deadline = time.monotonic() + SEND_TIMEOUT_S
    while transport.get_write_buffer_size():  # drain() is enough with limits of 0; be sure
        if time.monotonic() > deadline:
            raise TimeoutError("peer does not read its replies")
        await asyncio.sleep(0.001)
    raw = transport.get_extra_info("socket")
    if raw is None:
        raise ConnectionError("connection closed")
    # A separate socket object on a dup: sending on it leaves the transport's state alone.
    # The dup shares the non-blocking file description, hence the EAGAIN retry.
    sock = socket.socket(fileno=os.dup(raw.fileno()))
    try:
        while True:
            try:
                socket.send_fds(sock, [MARKER], fds)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError("peer does not read its replies") from None
                await asyncio.sleep(0.001)
    finally:
        sock.close()


def recv_fds(sock: socket.socket, count: int) -> list[int]:
    """Receive the marker and exactly ``count`` descriptors (1 <= count <= MAX_FDS)."""
    if not 1 <= count <= MAX_FDS:
        raise ProtocolError(f"reply announces {count!r} descriptors (expected 1..{MAX_FDS})")
    fds_size = array.array("i").itemsize * MAX_FDS
    msg, ancdata, flags, _ = sock.recvmsg(1, socket.CMSG_SPACE(fds_size), socket.MSG_CMSG_CLOEXEC)
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(data[: len(data) - (len(data) % got.itemsize)])
            fds += list(got)
    if msg != MARKER or len(fds) != count or flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        if not msg:
            raise ConnectionError("pool daemon closed the connection")
        raise ProtocolError(f"expected {count} descriptors after the reply, got {len(fds)}")
    return fds
