"""KV memory of co-located instances: watermark scaling and a reservation station (§6).

An instance's KV need (Eq. 2) assumes every request ends at the average output length seen
so far, and never less than ``L_min`` tokens in all: ``M_require = C * max(sum(I_r +
max(O_r, avg_out)), L_min)`` bytes, ``C`` bytes per token. Scaling is eager up and lazy down
(§6.2): below ``M_require`` the instance grows to ``M_recommend = M_require * (1 + w)``; it
shrinks only once ``M_recommend * (1 + w)`` is below what it holds.

Several instances scale at once, each operation taking time (§6.3). The
:class:`ReservationStation` keeps an *optimistic* budget (a shrink counts as done when it is
issued, so a grow may be admitted against it) and a *pessimistic* account of what is held (an
instance counts at the larger of its old and new size until its operation completes). A grow
that the pessimistic account cannot hold yet waits in the station and is issued when a shrink
completes; one that even the optimistic budget cannot hold is refused at once (§6.4: the
caller may then ask for ``M_require`` instead of ``M_recommend``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum


@dataclass(frozen=True, slots=True)
class Watermark:
    """KV scaling of one instance: ``bytes_per_token`` (C), the watermark ``w`` (a fraction)
    and ``min_tokens`` (L_min)."""

    bytes_per_token: int
    w: float = 0.2
    min_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.bytes_per_token < 1 or self.min_tokens < 0 or not 0 <= self.w <= 10:
            raise ValueError("bytes_per_token >= 1, min_tokens >= 0 and w in [0, 10] required")

    def require(self, requests: Iterable[tuple[int, int]], avg_out: float) -> int:
        """Eq. 2 in bytes, for requests given as (input tokens, tokens produced so far)."""
        tokens = sum(i + max(o, avg_out) for i, o in requests)
        return math.ceil(self.bytes_per_token * max(tokens, self.min_tokens))

    def recommend(self, require: int) -> int:
        return math.ceil(require * (1 + self.w))

    def target(self, current: int, require: int) -> int | None:
        """The size to scale to (None: stay): up to ``recommend`` when ``current`` is short of
        ``require``; down to it only when even ``recommend * (1 + w)`` is below ``current``."""
        recommend = self.recommend(require)
        if current < require or recommend * (1 + self.w) < current:
            return recommend
        return None


class Outcome(Enum):
    ISSUED = "issued"  # the caller performs the operation now and reports completion
    QUEUED = "queued"  # it waits in the station; :meth:`ReservationStation.complete` issues it
    REFUSED = "refused"  # the budget cannot hold it


@dataclass(slots=True)
class _Op:
    instance_id: str
    old: int
    new: int


@dataclass(slots=True)
class ReservationStation:
    """Scaling operations of one device's instances (see the module docstring)."""

    capacity: int  # bytes the device has for KV
    sizes: dict[str, int] = field(default_factory=dict)  # instance -> KV bytes it holds (settled)
    _running: dict[str, _Op] = field(default_factory=dict)
    _waiting: list[_Op] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.capacity < 0:
            raise ValueError("capacity must be >= 0")

    def budget(self) -> int:
        """Optimistic: every issued or waiting operation counted at its new size."""
        sizes = dict(self.sizes)
        for op in [*self._running.values(), *self._waiting]:
            sizes[op.instance_id] = op.new
        return sum(sizes.values())

    def held(self) -> int:
        """Pessimistic: instances being resized counted at the larger of both sizes."""
        sizes = dict(self.sizes)
        for op in self._running.values():
            sizes[op.instance_id] = max(op.old, op.new)
        return sum(sizes.values())

    def can_resize(self, instance_id: str, new: int) -> bool:
        """Whether :meth:`resize` would not refuse (a shadow check, §6.4)."""
        current = self._pending_size(instance_id)
        return self.budget() - current + new <= self.capacity

    def resize(self, instance_id: str, new: int) -> Outcome:
        """Ask to scale ``instance_id``'s KV to ``new`` bytes (one operation per instance at a
        time: a second waits behind the first)."""
        if new < 0:
            raise ValueError("a KV size is >= 0 bytes")
        if not self.can_resize(instance_id, new):
            return Outcome.REFUSED
        op = _Op(instance_id, self._pending_size(instance_id), new)
        if instance_id in self._running or any(w.instance_id == instance_id for w in self._waiting):
            self._waiting.append(op)
            return Outcome.QUEUED
        if self._fits_now(op):
            self._running[instance_id] = op
            return Outcome.ISSUED
        self._waiting.append(op)
        return Outcome.QUEUED

    def complete(self, instance_id: str) -> list[str]:
        """``instance_id``'s running operation finished; returns the instances whose waiting
        operations are issued now (the caller performs them)."""
        op = self._running.pop(instance_id)
        self.sizes[instance_id] = op.new
        issued: list[str] = []
        blocked: set[str] = set()  # an instance's operations run in the order they were asked
        for waiting in list(self._waiting):
            if waiting.instance_id in blocked or waiting.instance_id in self._running:
                blocked.add(waiting.instance_id)
                continue
            if not self._fits_now(waiting):
                blocked.add(waiting.instance_id)
                continue
            self._waiting.remove(waiting)
            waiting.old = self.sizes.get(waiting.instance_id, 0)
            self._running[waiting.instance_id] = waiting
            issued.append(waiting.instance_id)
        return issued

    def remove(self, instance_id: str) -> None:
        """The instance ended: its KV is gone (its running operation, if any, is dropped)."""
        self._running.pop(instance_id, None)
        self._waiting = [w for w in self._waiting if w.instance_id != instance_id]
        self.sizes.pop(instance_id, None)

    def _pending_size(self, instance_id: str) -> int:
        for op in reversed(self._waiting):
            if op.instance_id == instance_id:
                return op.new
        running = self._running.get(instance_id)
        return running.new if running is not None else self.sizes.get(instance_id, 0)

    def _fits_now(self, op: _Op) -> bool:
        """A shrink always runs; a grow only when the pessimistic account holds it (the
        instance is not being resized: it counts there at its settled size)."""
        settled = self.sizes.get(op.instance_id, 0)
        if op.new <= settled:
            return True
        return self.held() - settled + op.new <= self.capacity
