"""Placement and scaling decisions (pure Python: no Redis, no torch).

Affinity placement is Tangram Alg. 2 with Eq. 3: a model's expected start on a device is
``t_load = (S - S_resident) / B`` plus the device's queueing delay, where ``B`` is the
bandwidth from where the missing bytes come from (the node's host cache if the model is
there, else the model store on disk). The feasible device with the lowest expected start
wins, so a function returns to the device that still holds its tensors. Unlike Alg. 2,
which takes a chosen GPU out of the round, a device here can host several instances: a
placement instead charges the device its missing bytes and its load time, so later
placements in the same round see it fuller and busier.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace


@dataclass(frozen=True, slots=True)
class DeviceState:
    """What the scheduler knows of one device (reported by its pool and node agent)."""

    device_id: str  # "node/cpu", "node/cuda:0"
    free_bytes: int
    evictable_bytes: int  # inactive resident tensors the pool may evict
    resident_bytes: Mapping[str, int] = field(default_factory=dict)  # model id -> bytes resident
    host_cache_models: frozenset[str] = frozenset()
    host_cache_bandwidth: float = 10e9  # bytes/s from the node's host cache
    disk_bandwidth: float = 2e9  # bytes/s from the model store
    queue_seconds: float = 0.0  # expected wait before this device can start loading

    def __post_init__(self) -> None:
        if self.free_bytes < 0 or self.evictable_bytes < 0:
            raise ValueError("free_bytes and evictable_bytes must be >= 0")
        if self.host_cache_bandwidth <= 0 or self.disk_bandwidth <= 0:
            raise ValueError("bandwidths must be > 0")
        if self.queue_seconds < 0:
            raise ValueError("queue_seconds must be >= 0")


@dataclass(frozen=True, slots=True)
class ModelDemand:
    """A model to start: its weight bytes and the KV bytes its first requests need."""

    model_id: str
    weight_bytes: int
    kv_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Placement:
    model_id: str
    device_id: str | None  # None: no device can hold it now (the request waits or is rejected)
    expected_start_s: float  # math.inf when unplaced
    missing_bytes: int


def expected_start(model: ModelDemand, device: DeviceState) -> float | None:
    """Eq. 3 plus queueing, or None when the device cannot hold the model at all."""
    resident = min(device.resident_bytes.get(model.model_id, 0), model.weight_bytes)
    missing = model.weight_bytes - resident
    if missing + model.kv_bytes > device.free_bytes + device.evictable_bytes:
        return None
    bandwidth = (
        device.host_cache_bandwidth if model.model_id in device.host_cache_models else device.disk_bandwidth
    )
    return device.queue_seconds + missing / bandwidth


def place(models: Sequence[ModelDemand], devices: Sequence[DeviceState]) -> list[Placement]:
    """Alg. 2: each model, in order, goes to the feasible device with the lowest expected start."""
    state = {d.device_id: d for d in devices}
    out: list[Placement] = []
    for m in models:
        best: tuple[float, str] | None = None
        for d in state.values():
            t = expected_start(m, d)
            if t is not None and (best is None or (t, d.device_id) < best):
                best = (t, d.device_id)
        if best is None:
            out.append(Placement(m.model_id, None, math.inf, m.weight_bytes))
            continue
        t, device_id = best
        d = state[device_id]
        missing = m.weight_bytes - min(d.resident_bytes.get(m.model_id, 0), m.weight_bytes)
        take = missing + m.kv_bytes
        from_free = min(take, d.free_bytes)
        state[device_id] = replace(
            d,
            free_bytes=d.free_bytes - from_free,
            evictable_bytes=d.evictable_bytes - (take - from_free),
            resident_bytes={**d.resident_bytes, m.model_id: m.weight_bytes},
            queue_seconds=t,  # the next load on this device starts after this one
        )
        out.append(Placement(m.model_id, device_id, t, missing))
    return out


def desired_instances(in_flight: int, concurrency: int, min_scale: int, max_scale: int) -> int:
    """ceil(in-flight / concurrency), kept within [min_scale, max_scale]."""
    if concurrency < 1 or min_scale < 0 or max_scale < min_scale or in_flight < 0:
        raise ValueError("need concurrency >= 1, 0 <= min_scale <= max_scale, in_flight >= 0")
    return max(min_scale, min(max_scale, -(-in_flight // concurrency)))


def should_reject(expected_start_s: float, seconds_left: float) -> bool:
    """TIDAL-style early reject: the request cannot start before its deadline."""
    return expected_start_s > seconds_left
