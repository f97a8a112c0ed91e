"""The worker's side of token-level scheduling: wait for the device before each iteration.

An instance whose agent schedules its device token by token (:mod:`runtime.mesh`) steps its
engine only while it holds a grant: :meth:`Gate.acquire` before an iteration (with the
deadline of its most urgent request), :meth:`Gate.release` after it, :meth:`Gate.idle` when
it has nothing left to run. A lease (granted while no other instance waited) lets it run on
without a round trip until the agent says another instance waits. :meth:`Gate.admit` asks
the agent's shadow validation whether a new request may join. One reader (an event-loop
callback) takes every message the agent sends and hands it to whoever waits for it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket

from runtime.mesh.state_page import StatePage
from runtime.mesh.wire import SIZE, Message, Op, WireError, decode, encode


class GateClosed(ConnectionError):
    """The agent's token scheduler is gone (or spoke out of turn): the instance runs on its own."""


class Gate:
    """One instance's grants (drive it from the event loop it was made in)."""

    def __init__(self, sock: socket.socket, page: StatePage | None = None) -> None:
        sock.setblocking(False)
        self._sock = sock
        self.page = page  # where the engine publishes its requests for the agent
        self._loop = asyncio.get_running_loop()
        self._held = False  # granted and not yet given back
        self._lease = False
        self._yield = False  # the agent asked for the lease back
        self._grant: asyncio.Future[bool] | None = None  # waiting for a GRANT (value: leased)
        self._verdicts: collections.deque[asyncio.Future[int]] = collections.deque()
        self._error: GateClosed | None = None
        self.num_waits = 0  # grants waited for (the others ran on a lease)
        self._loop.add_reader(sock.fileno(), self._readable)

    async def acquire(self, deadline: float) -> None:
        """Return when this instance may run its next iteration."""
        self._check()
        if self._held and self._lease and not self._yield:
            return
        if self._held:  # a lease the agent asked back: give it back, then queue like anyone
            self._send(Message(Op.DONE))
            self._held = False
        grant = self._grant = self._loop.create_future()
        self._send(Message(Op.WANT, deadline))
        self.num_waits += 1
        try:
            leased = await grant
        except asyncio.CancelledError:  # a GRANT still to come is given back when it comes
            if grant.done() and not grant.cancelled():  # granted as it was cancelled: give it back
                self._grant = None
                self._send(Message(Op.DONE))
            raise
        self._grant = None
        self._held, self._lease, self._yield = True, leased, False

    def release(self) -> None:
        """The iteration is over: give the device back unless a lease covers the next one."""
        self._check()
        if self._held and not (self._lease and not self._yield):
            self._send(Message(Op.DONE))
            self._held = False

    def idle(self) -> None:
        """Nothing left to run: give a lease back."""
        self._check()
        if self._held:
            self._send(Message(Op.DONE))
            self._held = False

    async def admit(self, prompt_tokens: int) -> int:
        """The agent's verdict on a request of ``prompt_tokens`` joining: 0 admitted, else the
        shadow validation's failed case (:class:`runtime.mesh.shadow.Case` number)."""
        self._check()
        verdict: asyncio.Future[int] = self._loop.create_future()
        self._verdicts.append(verdict)
        self._send(Message(Op.ADMIT, float(prompt_tokens)))
        return await verdict

    def detach(self) -> None:
        """Stop using the line but keep it open: the instance ended and the worker's next one
        makes its own gate on it. Waiters fail; what the agent sent for this one is dropped."""
        if self._sock.fileno() >= 0:
            self._loop.remove_reader(self._sock.fileno())
            with contextlib.suppress(OSError):  # BlockingIOError: nothing left to drop
                while self._sock.recv(SIZE):
                    pass
        self._fail(GateClosed("the instance ended"))

    def close(self) -> None:
        if self._sock.fileno() >= 0:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
        self._fail(GateClosed("the gate was closed"))

    def _readable(self) -> None:
        try:
            while True:
                try:
                    raw = self._sock.recv(SIZE)
                except BlockingIOError:
                    return
                if not raw:
                    raise GateClosed("the agent's token scheduler closed the connection")
                self._dispatch(decode(raw))
        except (OSError, WireError) as exc:
            self._loop.remove_reader(self._sock.fileno())
            self._fail(exc if isinstance(exc, GateClosed) else GateClosed(str(exc)))

    def _dispatch(self, message: Message) -> None:
        if message.op is Op.GRANT:
            if self._grant is None or (self._grant.done() and not self._grant.cancelled()):
                raise GateClosed("a grant nobody asked for")
            if self._grant.cancelled():  # whoever asked stopped waiting: the device goes back
                self._grant = None
                self._send(Message(Op.DONE))
            else:
                self._grant.set_result(message.value == 1.0)
        elif message.op is Op.YIELD:
            if self._held:  # else: a stale YIELD of a lease given back already
                self._yield = True
        elif message.op is Op.VERDICT:
            if not self._verdicts:
                raise GateClosed("a verdict nobody asked for")
            verdict = self._verdicts.popleft()  # its asker may have been cancelled meanwhile
            if not verdict.done():
                verdict.set_result(int(message.value))
        else:
            raise GateClosed(f"the agent may not send {message.op.name}")

    def _fail(self, error: GateClosed) -> None:
        self._error = error
        waiting: list[asyncio.Future[bool] | asyncio.Future[int]] = [*self._verdicts]
        if self._grant is not None:
            waiting.append(self._grant)
        self._verdicts.clear()
        for future in waiting:
            if not future.done():
                future.set_exception(error)

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def _send(self, message: Message) -> None:
        try:
            self._sock.send(encode(message))  # 10 bytes on a local socketpair: never blocks in practice
        except OSError as exc:
            error = GateClosed(str(exc))
            self._fail(error)
            raise error from None
