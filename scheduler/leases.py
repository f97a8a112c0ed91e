"""Slot leases: free slots of instances that this gateway still holds in Redis.

When a request finishes, its slot stays held for ``lease_s`` and the next request of the
same function on this gateway takes it without a Redis round trip. A lease goes back to
Redis (through the router's ``release``, which restarts the instance's keep-alive clock)
when it times out, or at once when it is dropped: its instance died, its function was
redeployed or deleted, or the gateway stops. While held it counts as in flight for other
gateways. :class:`Leases` is the bookkeeping; :class:`scheduler.router.Router` decides
when to lease, take and drop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scheduler.errors import SchedulerError

if TYPE_CHECKING:  # the router imports this module
    from scheduler.router import Route

# (route, keep-alive s): free the slot in Redis and restart the instance's keep-alive clock
Release = Callable[["Route", float], Coroutine[Any, Any, None]]
Spawn = Callable[[Coroutine[Any, Any, None]], object]  # run a coroutine as a tracked background task


@dataclass(eq=False, slots=True)
class _Lease:
    """One held free slot: its route, the keep-alive to restart on release, its expiry timer."""

    route: Route
    keep_alive_s: float
    timer: asyncio.TimerHandle | None = None


class Leases:
    """The leased slots of one router, per function (newest last)."""

    def __init__(self, lease_s: float, max_leases: int, release: Release, spawn: Spawn) -> None:
        self.lease_s = lease_s  # seconds a finished request's slot is held (0: leases off)
        self.max_leases = max_leases  # per function
        self._release = release
        self._spawn = spawn
        self._held: dict[str, list[_Lease]] = {}

    def lease(self, name: str, route: Route, keep_alive_s: float) -> bool:
        """Hold ``route``'s slot for the next request of ``name``; False when leases are off
        or ``name`` already holds ``max_leases`` (the caller then releases the slot)."""
        held = self._held.setdefault(name, [])
        if self.lease_s <= 0 or len(held) >= self.max_leases:
            return False
        lease = _Lease(route, keep_alive_s)
        lease.timer = asyncio.get_running_loop().call_later(self.lease_s, self._expire, name, lease)
        held.append(lease)
        return True

    def take(self, name: str) -> Route | None:
        """The newest leased slot of ``name`` (as a warm route), or None."""
        held = self._held.get(name)
        if not held:
            return None
        lease = held.pop()
        if lease.timer is not None:
            lease.timer.cancel()
        return lease.route._replace(cold=False, waited_s=0.0, early=False)

    def _expire(self, name: str, lease: _Lease) -> None:
        held = self._held.get(name, [])
        if lease in held:
            held.remove(lease)
            self._spawn(self._release(lease.route, lease.keep_alive_s))

    async def drop(self, name: str, instance_id: str | None = None) -> None:
        """Release the leased slots of ``name`` (of one instance only, when given) now."""
        held = self._held.get(name, [])
        dropped = [lease for lease in held if instance_id in (None, lease.route.instance_id)]
        self._held[name] = [lease for lease in held if lease not in dropped]
        for lease in dropped:
            if lease.timer is not None:
                lease.timer.cancel()
            with contextlib.suppress(SchedulerError):
                await self._release(lease.route, lease.keep_alive_s)

    async def drop_all(self) -> None:
        """Release every leased slot (the gateway stops)."""
        for name in list(self._held):
            await self.drop(name)
