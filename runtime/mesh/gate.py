"""The worker's side of token-level scheduling: wait for the device before each iteration.

An instance whose agent schedules its device token by token (:mod:`runtime.mesh`) steps its
engine only while it holds a grant: :meth:`Gate.acquire` before an iteration (with the
deadline of its most urgent request), :meth:`Gate.release` after it, :meth:`Gate.idle` when
it has nothing left to run. A lease (granted while no other instance waited) lets it run on
without a round trip until the agent says another instance waits.
"""

from __future__ import annotations

import asyncio
import socket

from runtime.mesh.wire import SIZE, Message, Op, WireError, decode, encode


class Gate:
    """One instance's grants (drive it from one task: the engine's loop)."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._held = False  # granted and not yet given back
        self._lease = False
        self._yield = False  # the agent asked for the lease back
        self.num_waits = 0  # grants waited for (the others ran on a lease)

    async def acquire(self, deadline: float) -> None:
        """Return when this instance may run its next iteration."""
        self._poll()
        if self._held and self._lease and not self._yield:
            return
        if self._held:  # a lease the agent asked back: give it back, then queue like anyone
            self._send(Message(Op.DONE))
            self._held = False
        self._send(Message(Op.WANT, deadline))
        loop = asyncio.get_running_loop()
        self.num_waits += 1
        while True:
            raw = await loop.sock_recv(self._sock, SIZE)
            if not raw:
                raise ConnectionError("the agent's token scheduler closed the connection")
            message = decode(raw)
            if message.op is Op.GRANT:
                self._held, self._lease, self._yield = True, message.value == 1.0, False
                return
            if message.op is not Op.YIELD:  # a stale YIELD of an earlier lease is skipped
                raise WireError(f"unexpected {message.op.name} while waiting for a grant")

    def release(self) -> None:
        """The iteration is over: give the device back unless a lease covers the next one."""
        self._poll()
        if self._held and not (self._lease and not self._yield):
            self._send(Message(Op.DONE))
            self._held = False

    def idle(self) -> None:
        """Nothing left to run: give a lease back."""
        if self._held:
            self._send(Message(Op.DONE))
            self._held = False

    def close(self) -> None:
        self._sock.close()

    def _poll(self) -> None:
        """Read what the agent sent meanwhile (only YIELD can come unasked)."""
        while True:
            try:
                raw = self._sock.recv(SIZE)
            except BlockingIOError:
                return
            if not raw:
                raise ConnectionError("the agent's token scheduler closed the connection")
            if decode(raw).op is Op.YIELD and self._held:
                self._yield = True

    def _send(self, message: Message) -> None:
        self._sock.send(encode(message))  # 10 bytes on a local socketpair: never blocks in practice
