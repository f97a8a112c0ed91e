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
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

# The same values as scheduler.launcher's (the runtime does not import the scheduler).
INSTANCE_HEADER = "x-ember-instance-id"
NEVER_RAN_HEADER = "x-ember-never-ran"
NOT_STARTED = "not_started"
# Requests held at once by one worker: the scheduler sends at most MAX_EARLY, and this leaves
# room for ones whose clients hung up (held until the assign ends, their slots already freed).
MAX_HELD = 256
# The longest a request waits for its instance's activation (s): the gateway's default timeout.
MAX_HOLD_S = 300.0


class EarlyRequests:
    """The requests one worker holds until its current assign ends."""

    def __init__(self, max_held: int = MAX_HELD, max_hold_s: float = MAX_HOLD_S) -> None:
        if max_held < 1 or max_hold_s <= 0:
            raise ValueError("max_held must be >= 1 and max_hold_s > 0")
        self.max_held = max_held
        self.max_hold_s = max_hold_s
        self.num_held = 0
        self.refusing = False  # an assign failed: nothing is held any more
        self._ended = asyncio.Event()

    def refuse(self) -> None:
        """An assign failed: this worker holds nothing from now on (the agent ends it). The
        requests it holds are woken by the :meth:`ended` that follows."""
        self.refusing = True

    def ended(self) -> None:
        """An assign (or a standby's preparation) ended, either way: wake every held request."""
        self._ended.set()
        self._ended = asyncio.Event()

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
        """Wait for the next assign to end; False (at once) when :data:`MAX_HELD` requests are
        held already or an assign failed, or when ``deadline`` (the request's
        ``x-ember-deadline``, epoch seconds) or :data:`MAX_HOLD_S` passes first."""
        if self.refusing or self.num_held >= self.max_held:
            return False
        timeout_s = self._timeout_s(deadline)
        if not timeout_s > 0:
            return False
        self.num_held += 1
        try:  # (not wait_for: its extra task would cost the woken request two more loop turns)
            async with asyncio.timeout(timeout_s):
                await self._ended.wait()
        except TimeoutError:
            return False
        finally:
            self.num_held -= 1
        return True
