"""The extender's decisions (pure Python: no Redis, no HTTP, no torch).

**Filter.** A node passes unless its pool is down or cannot fit the pod's model:

* down: no report for the node's device (``<node>/cpu``, :func:`scheduler.cluster_keys.device_id`),
  a report older than ``report_ttl_s`` (its pool or reporter stopped publishing) or dated ahead
  by more than it (it would never grow stale), or a malformed one. Preempting pods cannot
  bring a pool back, so these go to ``FailedAndUnresolvableNodes``;
* cannot fit: the bytes of the model not resident there exceed the pool's free plus evictable
  bytes (Eq. 3's feasibility, :func:`scheduler.policies.expected_start`). Preempting pods that
  pin tensors would make those tensors evictable, so these go to ``FailedNodes``.

**Prioritize.** Each node's expected start is Tangram's Eq. 3 plus queueing:
``t = queue_seconds + (weight_bytes - resident_bytes) / load_bandwidth``, where
``load_bandwidth`` is what the node's pool measured and ``queue_seconds`` is what its reporter
publishes (0 when absent). A pool's measurement counts once it has loaded
``trusted_load_bytes`` (256 MiB); until then ``default_bandwidth`` stands in: a pool that has
loaded a few small models has measured its per-load overhead, not its bandwidth, and the
node that happened to load most would look fastest and draw every cold model.

To Eq. 3 the extender adds the price of what the start would evict. Eq. 3 alone sees only this
pod's missing bytes, so a cold model would go to the fastest node, full or not, evicting other
models' tensors there while other nodes have room, and a node cycling more models than its
arena holds would keep winning with each one's partial residency. So
``t += eviction_weight * max(0, missing - free_bytes) / load_bandwidth``, with a default weight
of 2: an evicted byte is reloaded by its owner's next start, which on a full node evicts in
turn (weight 1 prices only the first reload and still prefers cycling a full node to moving a
model once to a node with room; 0 gives Eq. 3 as is).

**Scores.** They are relative to the best node of this request, over the spread of the
feasible ones but never a spread narrower than the model's cold load (all its bytes at the
fastest of those nodes' bandwidths)::

    t_cold = weight_bytes / max(bandwidth of the feasible nodes)
    span   = max(t_worst - t_best, t_cold)
    score  = round(10 * (1 - (t - t_best) / span))      # 10 for the best node

So the best feasible node always scores 10 (``MaxExtenderPriority``). With equal queueing and
bandwidth and nothing to evict, a node loses 10 x the fraction of the model it lacks beyond
what the best node lacks: when the best node holds all of it, a node scores 10 x the fraction
it holds, whatever the model's size. A node whose queue (or eviction) makes it slower than a
cold load elsewhere sinks to 0. Infeasible or down nodes score 0. The score is non-increasing
in ``t``, so with equal queueing a node holding all of a model's bytes never scores below one
holding fewer. How much the score weighs against kube-scheduler's own plugins (spreading,
resources) is the profile's extender ``weight``.

A pod without ``ember.dev/model`` is not an Ember function: every node passes, every node 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from scheduler import cluster_keys
from scheduler.extender.wire import MAX_EXTENDER_PRIORITY, FilterResult, HostPriority, PodDemand
from scheduler.policies import DeviceState, ModelDemand, expected_start


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    """How the extender judges nodes (seconds, bytes/s)."""

    report_ttl_s: float = 10.0  # a pool report older than this means the pool is down
    default_bandwidth: float = 2e9  # a pool's load bandwidth until it has measured one
    device: str = "cpu"  # which of a node's devices a function pod uses
    eviction_weight: float = 2.0  # the price of evicting a byte, in loads of a byte (0: pure Eq. 3)
    trusted_load_bytes: int = 256 << 20  # bytes a pool must have loaded for its bandwidth to count

    def __post_init__(self) -> None:
        if not 0 < self.report_ttl_s <= 86400:
            raise ValueError("report_ttl_s must be in (0, 86400] seconds")
        if not (math.isfinite(self.default_bandwidth) and self.default_bandwidth > 0):
            raise ValueError("default_bandwidth must be a positive number of bytes/s")
        if not 0 <= self.eviction_weight <= 100:
            raise ValueError("eviction_weight must be in [0, 100]")
        if self.trusted_load_bytes < 0:
            raise ValueError("trusted_load_bytes must be >= 0")
        if not self.device or "/" in self.device:
            raise ValueError("device must be a non-empty name without '/'")


@dataclass(frozen=True, slots=True)
class PoolView:
    """One device's pool as its last report shows it (see :mod:`scheduler.extender.residency`)."""

    device_id: str
    free_bytes: int
    evictable_bytes: int
    resident_bytes: Mapping[str, int]  # model id -> bytes resident
    load_bandwidth: float  # bytes/s measured; 0: not measured yet
    queue_seconds: float  # expected wait before a load can start there
    updated: float  # wall-clock time of the report
    bytes_loaded: int = 0  # what the pool has loaded since it started (load_bandwidth's sample)

    def __post_init__(self) -> None:
        if self.free_bytes < 0 or self.evictable_bytes < 0 or self.bytes_loaded < 0:
            raise ValueError("free_bytes, evictable_bytes and bytes_loaded must be >= 0")
        if any(b < 0 for b in self.resident_bytes.values()):
            raise ValueError("resident bytes must be >= 0")
        if not (math.isfinite(self.load_bandwidth) and self.load_bandwidth >= 0):
            raise ValueError("load_bandwidth must be a finite number >= 0")
        if not (math.isfinite(self.queue_seconds) and self.queue_seconds >= 0):
            raise ValueError("queue_seconds must be a finite number >= 0")
        if not math.isfinite(self.updated):
            raise ValueError("updated must be a finite time")


@dataclass(frozen=True, slots=True)
class Residency:
    """Every device's pool view at one read; ``malformed``: devices whose report is unusable."""

    pools: Mapping[str, PoolView]
    malformed: Mapping[str, str] = field(default_factory=dict)  # device id -> why


class Verdict(NamedTuple):
    """One node judged for one pod: its expected start (None when it cannot host the pod now)."""

    node: str
    expected_start_s: float | None
    reason: str | None  # why not (None when feasible)
    unresolvable: bool  # the pool is down: preemption cannot help
    bandwidth: float = 0.0  # bytes/s the missing bytes would load at (feasible nodes)


def judge(demand: PodDemand, node: str, residency: Residency, now: float, config: PlacementConfig) -> Verdict:
    """Whether ``node`` can host ``demand``'s model and how soon it could start it (Eq. 3)."""
    return _judge(_model(demand), node, residency, now, config)


def _model(demand: PodDemand) -> ModelDemand | None:
    return ModelDemand(demand.model_id, demand.weight_bytes) if demand.model_id is not None else None


def _judge(
    model: ModelDemand | None,
    node: str,
    residency: Residency,
    now: float,
    config: PlacementConfig,
) -> Verdict:
    if model is None:
        return Verdict(node, 0.0, None, False)
    device = cluster_keys.device_id(node, config.device)
    if device in residency.malformed:
        return Verdict(
            node, None, f"pool report of {device} is malformed: {residency.malformed[device]}", True
        )
    pool = residency.pools.get(device)
    if pool is None:
        return Verdict(node, None, f"no pool report for {device} (pool down or not started)", True)
    age = now - pool.updated
    if age > config.report_ttl_s:
        reason = f"pool report of {device} is {age:.1f} s old (limit {config.report_ttl_s:g} s): pool down"
        return Verdict(node, None, reason, True)
    if age < -config.report_ttl_s:
        # Dated ahead by more than the TTL (a node clock far off, or a forged "updated"): such
        # a report would never grow stale, so a pool that stopped would keep passing forever.
        reason = f"pool report of {device} is dated {-age:.1f} s ahead (limit {config.report_ttl_s:g} s)"
        return Verdict(node, None, reason, True)
    measured = pool.load_bandwidth > 0 and pool.bytes_loaded >= config.trusted_load_bytes
    bandwidth = pool.load_bandwidth if measured else config.default_bandwidth
    state = DeviceState(
        device,
        pool.free_bytes,
        pool.evictable_bytes,
        pool.resident_bytes,
        disk_bandwidth=bandwidth,
        queue_seconds=pool.queue_seconds,
    )
    t = expected_start(model, state)
    if t is None:
        resident = min(pool.resident_bytes.get(model.model_id, 0), model.weight_bytes)
        reason = (
            f"pool on {device} cannot fit model {model.model_id}: {model.weight_bytes - resident} bytes "
            f"missing, {pool.free_bytes} free + {pool.evictable_bytes} evictable"
        )
        return Verdict(node, None, reason, False)
    missing = model.weight_bytes - min(pool.resident_bytes.get(model.model_id, 0), model.weight_bytes)
    evicted = max(0, missing - pool.free_bytes)  # other models' tensors this start would evict
    return Verdict(node, t + config.eviction_weight * evicted / bandwidth, None, False, bandwidth)


def filter_nodes(
    demand: PodDemand, nodes: Sequence[str], residency: Residency, now: float, config: PlacementConfig
) -> tuple[FilterResult, list[Verdict]]:
    """The filter's result for ``nodes`` (order kept), and the verdicts it came from."""
    model = _model(demand)
    verdicts = [_judge(model, n, residency, now, config) for n in nodes]
    passed = tuple(v.node for v in verdicts if v.reason is None)
    failed = {v.node: v.reason for v in verdicts if v.reason is not None and not v.unresolvable}
    unresolvable = {v.node: v.reason for v in verdicts if v.reason is not None and v.unresolvable}
    return FilterResult(passed, failed, unresolvable), verdicts


def scores(times: Sequence[float | None], cold_s: float) -> list[int]:
    """Expected starts (None: infeasible) mapped onto 0..10 given the model's cold load time
    ``cold_s``, see the module's docstring."""
    feasible = [t for t in times if t is not None]
    if not feasible:
        return [0] * len(times)
    best, worst = min(feasible), max(feasible)
    span = max(worst - best, cold_s)
    out = []
    for t in times:
        if t is None:
            out.append(0)
        elif span <= 0:  # a weightless model and every feasible node alike
            out.append(MAX_EXTENDER_PRIORITY)
        else:
            x = MAX_EXTENDER_PRIORITY * (1.0 - (t - best) / span)
            out.append(min(MAX_EXTENDER_PRIORITY, max(0, math.floor(x + 0.5))))
    return out


def prioritize(
    demand: PodDemand, nodes: Sequence[str], residency: Residency, now: float, config: PlacementConfig
) -> tuple[list[HostPriority], list[Verdict]]:
    """A score in 0..10 for each of ``nodes`` (order kept), and the verdicts behind them."""
    model = _model(demand)
    verdicts = [_judge(model, n, residency, now, config) for n in nodes]
    if demand.model_id is None:
        return [HostPriority(n, 0) for n in nodes], verdicts
    fastest = max((v.bandwidth for v in verdicts if v.expected_start_s is not None), default=0.0)
    cold_s = demand.weight_bytes / fastest if fastest > 0 else 0.0
    mapped = scores([v.expected_start_s for v in verdicts], cold_s)
    return [HostPriority(v.node, s) for v, s in zip(verdicts, mapped, strict=True)], verdicts
