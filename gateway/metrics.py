"""Prometheus metrics of one gateway (a private registry per app: no global state).

Request counters and TTFT / end-to-end histograms are observed by the invocation path;
cold starts and the bytes they loaded vs reused are observed when an instance becomes
ready; pool gauges (resident, loaded, reused bytes per device) are read from the cluster
state at scrape time, so they are what the pools last reported.

Series are labelled with the function's qualified id (``scheduler.names``: ``ns/name``, the
plain name in ``default``). A tenant's scrape (:meth:`Metrics.render` with its namespace)
holds only its own functions' series, labelled with their plain names, and no pool gauges
(device residency is cluster-wide).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from scheduler import names

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _PoolCollector(Collector):
    def __init__(self, devices: Callable[[], dict[str, dict[str, Any]]]) -> None:
        self.devices = devices

    def collect(self) -> Iterator[Metric]:
        fields = {
            "resident_bytes": "bytes of tensors resident in the pool",
            "pinned_bytes": "bytes of tensors in use by instances",
            "free_bytes": "free bytes of the pool's arena",
            "bytes_loaded": "bytes the pool has loaded from the model store (since it started)",
            "bytes_reused": "bytes the pool served from resident tensors (since it started)",
        }
        families = {
            k: GaugeMetricFamily(f"ember_pool_{k}", doc, labels=["device"]) for k, doc in fields.items()
        }
        try:
            devices = self.devices()
        except Exception:  # a scrape must not fail because Redis is briefly away
            devices = {}
        for device_id, report in devices.items():
            for key, family in families.items():
                family.add_metric([device_id], float(report.get(key, 0)))
        yield from families.values()


class Metrics:
    """The gateway's metrics (see module docstring)."""

    def __init__(self, devices: Callable[[], dict[str, dict[str, Any]]] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        labels = ["function", "route", "status"]
        self.requests = Counter(
            "ember_requests", "invocations by function, route, status", labels, registry=r
        )
        self.errors = Counter(
            "ember_request_errors", "failed invocations by error type", ["function", "type"], registry=r
        )
        self.ttft = Histogram(
            "ember_ttft_seconds", "time to first token (first byte for JSON responses)", ["function"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.latency = Histogram(
            "ember_request_seconds",
            "end-to-end invocation time",
            ["function"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.route = Histogram(
            "ember_route_seconds", "gateway + scheduler decision time of warm requests", ["function"],
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.05), registry=r,
        )  # fmt: skip
        self.cold_starts = Counter("ember_cold_starts", "instances started", ["function"], registry=r)
        self.start_seconds = Histogram(
            "ember_instance_start_seconds", "instance start (worker handover to ready)", ["function"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.start_loaded = Counter(
            "ember_cold_start_bytes_loaded", "bytes loaded from the store by instance starts", ["function"],
            registry=r,
        )  # fmt: skip
        self.start_reused = Counter(
            "ember_cold_start_bytes_reused", "bytes reused from the pool by instance starts", ["function"],
            registry=r,
        )  # fmt: skip
        if devices is not None:
            r.register(_PoolCollector(devices))

    def instance_started(self, function: str, bytes_loaded: int, bytes_reused: int, seconds: float) -> None:
        self.cold_starts.labels(function).inc()
        self.start_loaded.labels(function).inc(bytes_loaded)
        self.start_reused.labels(function).inc(bytes_reused)
        self.start_seconds.labels(function).observe(seconds)

    def render(self, namespace: str | None = None) -> bytes:
        """The exposition text: every series, or (``namespace`` given) that namespace's only."""
        if namespace is None:
            return generate_latest(self.registry)
        view = CollectorRegistry(auto_describe=False)
        view.register(_NamespaceView(self.registry, namespace))
        return generate_latest(view)


class _NamespaceView(Collector):
    """The series of one namespace's functions, relabelled with their plain names."""

    def __init__(self, registry: CollectorRegistry, namespace: str) -> None:
        self.registry = registry
        self.namespace = namespace

    def describe(self) -> list[Metric]:
        return []  # registered on a throwaway registry: no name clashes to check

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            view = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            for sample in metric.samples:
                function = sample.labels.get("function")
                if function is None:
                    continue  # not per function (pool gauges): cluster-wide, admin only
                namespace, name = names.split(function)
                if namespace == self.namespace:
                    view.samples.append(sample._replace(labels={**sample.labels, "function": name}))
            if view.samples:
                yield view
