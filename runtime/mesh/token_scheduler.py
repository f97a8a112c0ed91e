"""The device's token-level scheduler: one iteration at a time, least headroom first (§5.1).

Each co-located instance asks before every iteration (:meth:`TokenScheduler.want`, with the
deadline of its most urgent request: Eq. 1's ``ST + TTFT_SLO + TPOT_SLO * O``) and reports
when the iteration is done. The device runs one iteration at a time, on all of its cores, and
grants the waiting instance with the earliest deadline (the least headroom: the same order at
any ``now``). Ties go to the instance that asked first. Deadlines are the workers' word, and
tenant code runs in the workers: an instance passed over by ``max_passed_over`` grants in a row
goes next whatever the deadlines, so a worker that asks again at once with a deadline nobody
beats gets most of the device but cannot starve its neighbours.

A *lease* spares a lone instance the round trip: an instance granted while nobody else waits
may run further iterations without asking, until another instance wants the device; then
:meth:`want` reports that the holder must yield after its current iteration. Pure state: the
agent's :mod:`runtime.mesh.grant_server` drives it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Want:
    deadline: float
    order: int
    passed_over: int = 0  # grants to others since it asked


@dataclass(slots=True)
class TokenScheduler:
    """Grants of one device (see the module docstring); not thread-safe."""

    running: str | None = None  # the instance granted the device
    leased: bool = False  # the running instance may go on without asking
    waiting: dict[str, _Want] = field(default_factory=dict)
    num_grants: int = 0
    max_passed_over: int = 8
    _order: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        if self.max_passed_over < 1:
            raise ValueError(f"max_passed_over must be >= 1, got {self.max_passed_over}")

    def want(self, instance_id: str, deadline: float) -> bool:
        """``instance_id`` asks for its next iteration; returns whether the lease holder (if
        another instance) must now yield. Asking again replaces its deadline."""
        if instance_id == self.running:
            raise ValueError(f"{instance_id} asked while it holds the device")
        previous = self.waiting.get(instance_id)
        if previous is not None:
            previous.deadline = deadline
        else:
            self.waiting[instance_id] = _Want(deadline, next(self._order))
        if self.leased and self.running is not None:
            self.leased = False  # the holder finishes its iteration, then reports done
            return True
        return False

    def grant(self) -> str | None:
        """The instance to run next, when the device is free and somebody waits (else None).
        The grant is a lease when nobody else waits."""
        if self.running is not None or not self.waiting:
            return None
        w = self.waiting
        starved = [i for i in w if w[i].passed_over >= self.max_passed_over]
        if starved:
            instance_id = min(starved, key=lambda i: w[i].order)
        else:
            instance_id = min(w, key=lambda i: (w[i].deadline, w[i].order))
        del w[instance_id]
        for other in w.values():
            other.passed_over += 1
        self.running, self.leased = instance_id, not self.waiting
        self.num_grants += 1
        return instance_id

    def done(self, instance_id: str) -> None:
        """The running instance finished its iteration (or gave its lease back)."""
        if instance_id != self.running:
            raise ValueError(f"{instance_id} does not hold the device")
        self.running, self.leased = None, False

    def leave(self, instance_id: str) -> None:
        """The instance is gone (ended, crashed, disconnected): forget it, free the device."""
        self.waiting.pop(instance_id, None)
        if self.running == instance_id:
            self.running, self.leased = None, False
