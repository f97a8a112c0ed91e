"""Shadow validation: may a new request join an instance without breaking anyone's SLO? (§5.3)

The device's future is simulated token by token as :mod:`runtime.mesh.token_scheduler` would
run it: at each cycle the instance whose most urgent request has the least headroom runs one
iteration; an instance with a request waiting for its prefill runs that prefill (the engine
prefers prefills), otherwise it decodes its whole batch. Every iteration is overestimated by
10 % (runtime fluctuations, growing sequences). The request is admitted only if, in the
simulation, none of LLM-Mesh's three cases occurs:

1. its own prefill finishes after its TTFT deadline;
2. a request already on the device gets a token after its deadline because of it (requests
   that were already late before the new one arrived are not held against it);
3. with it, one decode iteration of every instance of the device together takes longer than
   the tightest TPOT SLO on the device (the device could no longer give each of its
   decoding requests a token per TPOT).

The simulation ends when the new request has produced ``horizon_tokens`` tokens (its prefill
and first decodes: R5-P, R5-D1, R5-D2 in the paper's Figure 6) or after ``max_cycles``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import Enum

from runtime.mesh.slo import RequestClock
from runtime.mesh.time_table import TimeTable

OVERESTIMATE = 1.10


@dataclass(slots=True)
class ShadowRequest:
    """A request as the simulation sees it."""

    clock: RequestClock
    remaining: int  # tokens it is still expected to produce (>= 1 while it runs)

    @property
    def length(self) -> int:
        return self.clock.input_len + self.clock.tokens_out


@dataclass(slots=True)
class ShadowInstance:
    """An instance of a device: its time table and its unfinished requests."""

    instance_id: str
    table: TimeTable
    requests: list[ShadowRequest] = field(default_factory=list)
    slowdown: float = 1.0  # measured iteration time / the table's, lately (the engine's calibration)

    def urgency(self) -> float:
        """The deadline of its most urgent request (inf when idle)."""
        return min((r.clock.deadline() for r in self.requests), default=float("inf"))

    def decode_s(self) -> float:
        decoding = [r for r in self.requests if r.clock.prefilled]
        if not decoding:
            return 0.0
        avg = sum(r.length for r in decoding) / len(decoding)
        return self.table.decode(len(decoding), avg) * self.slowdown


class Case(Enum):
    """Why a shadow validation failed (the paper's cases 1-3)."""

    OWN_TTFT = "own_ttft"  # 1: the new request's first token would be late
    NEIGHBOUR_LATE = "neighbour_late"  # 2: a request already on the device would be late
    DEVICE_TPOT = "device_tpot"  # 3: one decode round of the device exceeds the TPOT SLO


@dataclass(frozen=True, slots=True)
class Verdict:
    admit: bool
    case: Case | None = None
    first_token_s: float | None = None  # when the simulation gave the new request its first token
    late_instance: str | None = None  # case 2: whose request would be late


def _copy(instances: Sequence[ShadowInstance]) -> list[ShadowInstance]:
    return [
        replace(i, requests=[ShadowRequest(replace(r.clock), r.remaining) for r in i.requests])
        for i in instances
    ]


def _iteration(inst: ShadowInstance) -> tuple[float, list[ShadowRequest]]:
    """Seconds of ``inst``'s next iteration and the requests that get a token from it."""
    waiting = [r for r in inst.requests if not r.clock.prefilled]
    if waiting:
        first = waiting[0]
        return inst.table.prefill(first.clock.input_len) * inst.slowdown * OVERESTIMATE, [first]
    decoding = list(inst.requests)
    return inst.decode_s() * OVERESTIMATE, decoding


def validate(
    instances: Sequence[ShadowInstance],
    target_id: str,
    new: ShadowRequest,
    now: float,
    horizon_tokens: int = 3,
    max_cycles: int = 128,
) -> Verdict:
    """Whether ``new`` may join instance ``target_id`` of the device whose instances are
    ``instances`` at time ``now`` (see the module docstring). ``instances`` is not modified."""
    if horizon_tokens < 1 or max_cycles < 1:
        raise ValueError("horizon_tokens and max_cycles must be >= 1")
    sim = _copy(instances)
    target = next((i for i in sim if i.instance_id == target_id), None)
    if target is None:
        raise ValueError(f"no instance {target_id!r} on this device")
    mine = ShadowRequest(replace(new.clock), max(new.remaining, 1))
    target.requests.append(mine)

    tpots = [r.clock.slo.tpot_s for i in sim for r in i.requests]
    round_s = sum(
        i.table.decode(len(i.requests), sum(r.length + 1 for r in i.requests) / len(i.requests)) * i.slowdown
        for i in sim
        if i.requests
    )
    if round_s * OVERESTIMATE > min(tpots):
        return Verdict(False, Case.DEVICE_TPOT)

    already_late = {id(r) for i in sim for r in i.requests if r is not mine and r.clock.deadline() < now}
    clock, first_token = now, None
    for _ in range(max_cycles):
        busy = [i for i in sim if i.requests]
        if not busy or mine.clock.tokens_out >= horizon_tokens:
            break
        inst = min(busy, key=ShadowInstance.urgency)
        seconds, served = _iteration(inst)
        clock += seconds
        for r in served:
            if clock > r.clock.deadline():
                if r is mine:  # its later tokens late: the device cannot keep its TPOT
                    return Verdict(False, Case.OWN_TTFT if not r.clock.prefilled else Case.DEVICE_TPOT)
                if id(r) not in already_late:
                    return Verdict(False, Case.NEIGHBOUR_LATE, late_instance=inst.instance_id)
            r.clock.tokens_out += 1
            r.remaining -= 1
            if r is mine and first_token is None:
                first_token = clock
        inst.requests = [r for r in inst.requests if r.remaining > 0]
    for inst in sim:  # due before the simulation ended and still not served: late as well
        for r in inst.requests:
            if r is not mine and id(r) not in already_late and r.clock.deadline() < clock:
                return Verdict(False, Case.NEIGHBOUR_LATE, late_instance=inst.instance_id)
    return Verdict(True, first_token_s=first_token)
