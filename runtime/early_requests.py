"""Requests that reach a worker before its activation ended (pipelined activation).

The gateway sends a request to the worker an instance is being activated in as soon as the
agent has picked that worker (``on_target`` of :meth:`runtime.agent.NodeAgent.launch`), so the
request's trip and connection overlap the activation instead of following it, and recording
the instance ready and waking the waiting requests leave the request's path. Such a
request names its instance in :data:`INSTANCE_HEADER`. The worker holds it until an assign
ends: it is served when the worker became that instance, and otherwise answered 503
:data:`NOT_STARTED` with :data:`NEVER_RAN_HEADER` naming the instance, which tells the gateway
it never ran (a header: no handler's error can say it), so the gateway routes it again and
delivery stays at most once. Once an assign failed the worker is about to be ended: it holds
nothing more, and answers every such request so at once. Held requests are bounded in number
(:data:`MAX_HELD`) and time (the request's deadline, at most :data:`MAX_HOLD_S`); one past
either bound is answered :data:`NOT_STARTED` too.

The requests an assign woke make up its :class:`Handover`: each holds a :class:`Share` of it
until its first output has left the worker (or it ended without one). An assign over the
agent's control line replies only once they are all released (at most :data:`HANDOVER_WAIT_S`),
having told the agent first that the instance serves (``runtime.control_line.KIND_SERVING``: a
worker that dies meanwhile is an instance lost, not a failed start). Sent earlier, the reply
and the agent's work on it (the instance's install and its ready record in Redis, in the
gateway's process in embedded mode: ~1.3 ms of CPU) ran on the cores during those requests'
first prefill, which took 1.5-3.4 ms longer than a warm one on a 2-core host. The instance's
record turns ready a moment after their first outputs. Over HTTP the reply goes after one
loop turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import TypeVar

T = TypeVar("T")

# The same values as scheduler.launcher's (the runtime does not import the scheduler).
INSTANCE_HEADER = "x-ember-instance-id"
NEVER_RAN_HEADER = "x-ember-never-ran"
NOT_STARTED = "not_started"
# Requests held at once by one worker: the scheduler sends at most MAX_EARLY, and this leaves
# room for ones whose clients hung up (held until the assign ends, their slots already freed).
MAX_HELD = 256
# The longest a request waits for its instance's activation (s): the gateway's default timeout.
MAX_HOLD_S = 300.0
# The longest an assign's reply waits for the first outputs of the requests it woke (s): a
# long prompt's first step may take seconds, and the agent records the instance ready only
# on the reply (requests routed to it meanwhile are served all the same).
HANDOVER_WAIT_S = 0.5


class Handover:
    """The requests one assign woke, until each has released its :class:`Share`."""

    def __init__(self, num_requests: int) -> None:
        if num_requests < 0:
            raise ValueError("num_requests must be >= 0")
        self.num_pending = num_requests
        self._done = asyncio.Event()
        if num_requests == 0:
            self._done.set()

    def share(self) -> Share:
        """One woken request's share (each of the ``num_requests`` takes or releases one)."""
        return Share(self)

    def release_one(self) -> None:
        """One woken request needs no waiting for (it ended, or its first output is out)."""
        assert self.num_pending > 0, "more shares released than requests woken"
        self.num_pending -= 1
        if self.num_pending == 0:
            self._done.set()

    async def wait(self, timeout_s: float = HANDOVER_WAIT_S) -> float:
        """Wait until every share is released, at most ``timeout_s``; returns the seconds waited."""
        t0 = time.perf_counter()
        if not self._done.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._done.wait()
        return time.perf_counter() - t0


class Share:
    """A woken request's part of its :class:`Handover`; :meth:`release` is idempotent."""

    __slots__ = ("_handover",)

    def __init__(self, handover: Handover | None) -> None:
        self._handover = handover

    def transfer(self) -> Share:
        """A new share with this one's part: this one releases nothing from now on."""
        handover, self._handover = self._handover, None
        return Share(handover)

    def release(self) -> None:
        handover, self._handover = self._handover, None
        if handover is not None:
            handover.release_one()


def release_at_first_output(streams: list[AsyncIterator[T]], share: Share) -> list[AsyncIterator[T]]:
    """``streams`` (one request's choices) releasing ``share`` once the first output of any
    was taken (its consumer asks for the next: a stream's chunk of it is sent), or when they
    end without one."""

    async def releasing(stream: AsyncIterator[T]) -> AsyncIterator[T]:
        try:
            async for out in stream:
                yield out
                share.release()
        finally:
            share.release()
            aclose = getattr(stream, "aclose", None)  # an engine stream ends its sequence on close
            if aclose is not None:
                await aclose()

    return [releasing(stream) for stream in streams]


class _Round:
    """The requests waiting for one assign to end, and the handover its end made of them."""

    __slots__ = ("ended", "handover", "num_waiting")

    def __init__(self) -> None:
        self.ended = asyncio.Event()
        self.num_waiting = 0
        self.handover: Handover | None = None


class EarlyRequests:
    """The requests one worker holds until its current assign ends."""

    def __init__(self, max_held: int = MAX_HELD, max_hold_s: float = MAX_HOLD_S) -> None:
        if max_held < 1 or max_hold_s <= 0:
            raise ValueError("max_held must be >= 1 and max_hold_s > 0")
        self.max_held = max_held
        self.max_hold_s = max_hold_s
        self.num_held = 0
        self.refusing = False  # an assign failed: nothing is held any more
        self._round = _Round()

    def refuse(self) -> None:
        """An assign failed: this worker holds nothing from now on (the agent ends it). The
        requests it holds are woken by the :meth:`ended` that follows."""
        self.refusing = True

    def ended(self) -> Handover:
        """An assign (or a standby's preparation) ended, either way: wake every held request.
        Returns their :class:`Handover` (each woken request gets a share: :meth:`hold_share`)."""
        woken, self._round = self._round, _Round()
        woken.handover = Handover(woken.num_waiting)
        woken.ended.set()
        return woken.handover

    def can_hold(self, deadline: str | None) -> bool:
        """Whether :meth:`hold` would hold a request with ``deadline`` now."""
        return not self.refusing and self.num_held < self.max_held and self._timeout_s(deadline) > 0

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """A request read and prepared ahead of its hold (``runtime.worker``) counts as held
        meanwhile: :data:`MAX_HELD` bounds that work too."""
        self.num_held += 1
        try:
            yield
        finally:
            self.num_held -= 1

    def _timeout_s(self, deadline: str | None) -> float:
        timeout_s = self.max_hold_s
        if deadline is not None:
            with contextlib.suppress(ValueError):  # not a number: the longest hold
                timeout_s = min(timeout_s, float(deadline) - time.time())
        return timeout_s if timeout_s > 0 else 0.0  # (NaN too)

    async def hold(self, deadline: str | None) -> bool:
        """:meth:`hold_share`, its share released at once: whether the next assign ended first."""
        share = await self.hold_share(deadline)
        if share is None:
            return False
        share.release()
        return True

    async def hold_share(self, deadline: str | None) -> Share | None:
        """Wait for the next assign to end, and return this request's share of its handover
        (the caller releases it); None (at once) when :data:`MAX_HELD` requests are held
        already or an assign failed, or when ``deadline`` (the request's ``x-ember-deadline``,
        epoch seconds) or :data:`MAX_HOLD_S` passes first."""
        if self.refusing or self.num_held >= self.max_held:
            return None
        timeout_s = self._timeout_s(deadline)
        if not timeout_s > 0:
            return None
        waiting = self._round
        self.num_held += 1
        waiting.num_waiting += 1
        woken = False
        try:  # (not wait_for: its extra task would cost the woken request two more loop turns)
            async with asyncio.timeout(timeout_s):
                await waiting.ended.wait()
            woken = True
        except TimeoutError:
            return None
        finally:
            self.num_held -= 1
            # Counted in the handover, but gone (timed out or cancelled as the assign ended).
            if not woken and waiting.handover is not None:
                waiting.handover.release_one()
            elif not woken:
                waiting.num_waiting -= 1
        assert waiting.handover is not None  # set before the event
        return waiting.handover.share()
