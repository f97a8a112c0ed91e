"""The extender's two verbs over parsed JSON: decode, decide, log, encode.

:class:`Extender` is what an HTTP layer calls (:mod:`gateway.extender` serves it standalone or
mounted in the gateway): ``filter`` takes an ``ExtenderArgs`` document and returns an
``ExtenderFilterResult`` one, ``prioritize`` returns a ``HostPriorityList``. Each decision is
logged as one structured line (JSON) on the ``ember.extender`` logger: the verb, the pod, its
function and model, and per node the outcome (the reason a node failed, or its expected start
and score), plus how long the decision took.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from scheduler.extender.policies import PlacementConfig, Residency, Verdict, filter_nodes, prioritize
from scheduler.extender.residency import ResidencyCache
from scheduler.extender.wire import ExtenderArgs, WireLimits, encode_priorities

LOGGER = "ember.extender"
_NONE_READ = Residency({})  # what a pod that is not an Ember function is judged against (unread)


@dataclass(frozen=True, slots=True)
class ExtenderConfig:
    """The extender's settings: placement, request bounds, and the residency cache's life."""

    placement: PlacementConfig = field(default_factory=PlacementConfig)
    wire: WireLimits = field(default_factory=WireLimits)
    cache_s: float = 1.0  # how long a read of the device reports is reused

    def __post_init__(self) -> None:
        if not 0 <= self.cache_s <= 60:
            raise ValueError("cache_s must be in [0, 60] seconds")

    @classmethod
    def from_env(cls) -> ExtenderConfig:
        """``EMBER_EXTENDER_REPORT_TTL``, ``EMBER_EXTENDER_CACHE`` (seconds),
        ``EMBER_EXTENDER_EVICTION_WEIGHT``, ``EMBER_EXTENDER_TRUSTED_LOAD_BYTES`` and
        ``EMBER_EXTENDER_MAX_NODES`` (counts); unset ones
        keep their defaults, bad ones raise ValueError naming the variable."""
        placement: dict[str, Any] = {}
        wire: dict[str, Any] = {}
        top: dict[str, Any] = {}
        for env, target, key, kind in (
            ("EMBER_EXTENDER_REPORT_TTL", placement, "report_ttl_s", float),
            ("EMBER_EXTENDER_CACHE", top, "cache_s", float),
            ("EMBER_EXTENDER_EVICTION_WEIGHT", placement, "eviction_weight", float),
            ("EMBER_EXTENDER_TRUSTED_LOAD_BYTES", placement, "trusted_load_bytes", int),
            ("EMBER_EXTENDER_MAX_NODES", wire, "max_nodes", int),
        ):
            raw = os.environ.get(env)
            if raw is None:
                continue
            try:
                target[key] = kind(raw)
            except ValueError:
                raise ValueError(f"{env}={raw!r} is not a valid {kind.__name__}") from None
        try:
            return cls(PlacementConfig(**placement), WireLimits(**wire), **top)
        except ValueError as exc:
            raise ValueError(f"EMBER_EXTENDER_* settings: {exc}") from None


class Extender:
    """Filter and prioritize over the residency in ``cache``."""

    def __init__(
        self,
        cache: ResidencyCache,
        config: ExtenderConfig | None = None,
        clock: Callable[[], float] = time.time,
        log: logging.Logger | None = None,
    ) -> None:
        self.cache = cache
        self.config = config or ExtenderConfig()
        self._clock = clock  # wall clock: reports carry wall-clock "updated" times
        self.log = log or logging.getLogger(LOGGER)

    async def filter(self, document: Any) -> dict[str, Any]:
        """``ExtenderArgs`` -> ``ExtenderFilterResult`` (both as JSON documents)."""
        t0 = time.perf_counter()
        args = ExtenderArgs.decode(document, self.config.wire)
        residency = await self._residency(args)
        now = self._clock()
        result, verdicts = filter_nodes(args.demand, args.node_names, residency, now, self.config.placement)
        self._decided("filter", args, verdicts, None, t0)
        return result.encode(args)

    async def prioritize(self, document: Any) -> list[dict[str, Any]]:
        """``ExtenderArgs`` -> ``HostPriorityList`` (both as JSON documents)."""
        t0 = time.perf_counter()
        args = ExtenderArgs.decode(document, self.config.wire)
        residency = await self._residency(args)
        now = self._clock()
        priorities, verdicts = prioritize(args.demand, args.node_names, residency, now, self.config.placement)
        self._decided("prioritize", args, verdicts, [p.score for p in priorities], t0)
        return encode_priorities(priorities)

    async def _residency(self, args: ExtenderArgs) -> Residency:
        """The pools' residency; not read for a pod that is not an Ember function (no opinion)."""
        return await self.cache.get() if args.demand.model_id is not None else _NONE_READ

    def _decided(
        self, verb: str, args: ExtenderArgs, verdicts: list[Verdict], scores: list[int] | None, t0: float
    ) -> None:
        """One JSON line: the decision and, per node, why (skipped when INFO is off)."""
        if not self.log.isEnabledFor(logging.INFO):
            return
        nodes: dict[str, dict[str, Any]] = {}
        for i, v in enumerate(verdicts):
            entry: dict[str, Any] = (
                {"failed": v.reason}
                if v.reason is not None
                else {"start_s": round(v.expected_start_s or 0.0, 6)}
            )
            if scores is not None:
                entry["score"] = scores[i]
            nodes[v.node] = entry
        line: dict[str, Any] = {
            "event": f"extender.{verb}",
            "pod": args.demand.pod,
            "function": args.demand.function_id,
            "model": args.demand.model_id,
            "weight_bytes": args.demand.weight_bytes,
            "nodes": nodes,
        }
        if verb == "filter":
            line["passed"] = sum(1 for v in verdicts if v.reason is None)
        elif scores:
            line["best"] = verdicts[max(range(len(scores)), key=scores.__getitem__)].node
        line["ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        self.log.info("%s", json.dumps(line, separators=(",", ":")))
