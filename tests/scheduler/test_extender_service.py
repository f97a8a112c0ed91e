"""The extender's verbs over real device reports in Redis: caching, staleness, the decision log."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import pytest

from scheduler import cluster_keys
from scheduler.errors import StateUnavailable
from scheduler.extender.policies import Residency
from scheduler.extender.residency import ResidencyCache, residency_of
from scheduler.extender.service import LOGGER, Extender, ExtenderConfig
from scheduler.records import DeviceReport
from scheduler.state import ClusterState

MB = 1 << 20


def report(free: int, models: dict[str, int], bandwidth: float = 1e9, **extra: Any) -> dict[str, Any]:
    return {"free_bytes": free, "evictable_bytes": 0, "models": models, "load_bandwidth": bandwidth, **extra}


def args(nodes: list[str], model: str = "m", weight: int = 100 * MB) -> dict[str, Any]:
    annotations = {
        cluster_keys.ANNOTATION_MODEL: model,
        cluster_keys.ANNOTATION_WEIGHT_BYTES: str(weight),
        cluster_keys.ANNOTATION_FUNCTION_ID: "chat",
    }
    pod = {"metadata": {"name": "chat-1", "namespace": "ember-fn", "annotations": annotations}}
    return {"Pod": pod, "NodeNames": nodes}


def test_reports_become_pool_views_and_malformed_ones_are_set_aside(state: ClusterState) -> None:
    state.report_device("a/cpu", report(10 * MB, {"m": 5 * MB}, queue_seconds=0.5))
    state.report_device("b/cpu", report(10 * MB, {}, queue_seconds="soon"))
    state.report_device("c/cpu", report(-1, {}))
    r = residency_of(state.device_reports())
    a = r.pools["a/cpu"]
    assert (a.free_bytes, a.resident_bytes, a.queue_seconds) == (10 * MB, {"m": 5 * MB}, 0.5)
    assert abs(a.updated - time.time()) < 5
    assert set(r.malformed) == {"b/cpu", "c/cpu"} and set(r.pools) == {"a/cpu"}
    assert r.malformed["b/cpu"] == "queue_seconds must be a number"
    assert "free_bytes" in r.malformed["c/cpu"]


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ("not json", "not a JSON document"),
        ('{"v": 1, "free_bytes": 1e999}', "free_bytes"),
        ('{"v": 1, "free_bytes": 5, "load_bandwidth": NaN}', "load_bandwidth"),
        ('{"v": 99}', "encoding version"),
        ('{"v": 1, "free_bytes": 5, "models": {"m": -7}, "updated": 0}', "resident bytes"),
    ],
)
def test_a_malformed_report_sets_aside_only_its_own_device(state: ClusterState, raw: str, why: str) -> None:
    """Regression: one such report raised out of the whole read (every placement failed)."""
    state.report_device("good/cpu", report(1 << 30, {}))
    state.r.set(f"{state.p}device:bad/cpu", raw)
    if why != "resident bytes":  # the record itself is malformed: left out of device_reports()
        assert set(state.device_reports()) == {"good/cpu"}  # what the embedded cold start reads
    extender = Extender(ResidencyCache(state.device_reports_or_errors, ttl_s=0.0))
    out = asyncio.run(extender.filter(args(["good", "bad"])))
    assert out["NodeNames"] == ["good"] and why in out["FailedAndUnresolvableNodes"]["bad"]


def test_a_failed_read_fails_the_burst_behind_it_without_reading_again() -> None:
    """Regression: with Redis away each call queued behind the cache's lock made a read of
    its own, one after another: a backlog long after kube-scheduler stopped waiting."""
    now = [0.0]
    calls = []
    gate = threading.Event()

    def read() -> Mapping[str, DeviceReport]:
        calls.append(1)
        gate.wait(5)
        raise StateUnavailable("Redis is unreachable")

    cache = ResidencyCache(read, ttl_s=0.0, clock=lambda: now[0])

    async def burst() -> list[BaseException | Residency]:
        tasks = [asyncio.create_task(cache.get()) for _ in range(20)]
        await asyncio.sleep(0.05)
        gate.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    outcomes = asyncio.run(burst())
    assert len(calls) == 1 and all(isinstance(o, StateUnavailable) for o in outcomes)
    now[0] = 0.6  # the failure is answered for 0.5 s at least, then read again
    with pytest.raises(StateUnavailable):
        asyncio.run(cache.get())
    assert len(calls) == 2


def test_the_cache_reads_once_per_ttl_and_once_per_burst() -> None:
    now = [0.0]
    calls = []
    gate = threading.Event()

    def read() -> Mapping[str, DeviceReport]:
        calls.append(1)
        gate.wait(5)
        return {}

    cache = ResidencyCache(read, ttl_s=1.0, clock=lambda: now[0])

    async def burst() -> None:
        tasks = [asyncio.create_task(cache.get()) for _ in range(20)]
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(*tasks)

    asyncio.run(burst())
    assert len(calls) == 1 and cache.reads == 1
    now[0] = 0.9
    asyncio.run(cache.get())
    assert len(calls) == 1
    now[0] = 1.0
    asyncio.run(cache.get())
    assert len(calls) == 2
    uncached = ResidencyCache(read, ttl_s=0.0, clock=lambda: now[0])
    asyncio.run(uncached.get())
    asyncio.run(uncached.get())
    assert uncached.reads == 2
    with pytest.raises(ValueError):
        ResidencyCache(read, ttl_s=-1)


def test_filter_and_prioritize_over_redis_log_one_line_each(
    state: ClusterState, caplog: pytest.LogCaptureFixture
) -> None:
    state.report_device("warm/cpu", report(0, {"m": 100 * MB}))
    state.report_device("cold/cpu", report(1 << 30, {}))
    state.report_device("full/cpu", report(MB, {}))
    extender = Extender(ResidencyCache(state.device_reports, ttl_s=0.0))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        filtered = asyncio.run(extender.filter(args(["warm", "cold", "full", "gone"])))
        scored = asyncio.run(extender.prioritize(args(filtered["NodeNames"])))
    assert filtered["NodeNames"] == ["warm", "cold"]
    assert set(filtered["FailedNodes"]) == {"full"} and set(filtered["FailedAndUnresolvableNodes"]) == {
        "gone"
    }
    assert scored == [{"Host": "warm", "Score": 10}, {"Host": "cold", "Score": 0}]
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == LOGGER]
    assert [line["event"] for line in lines] == ["extender.filter", "extender.prioritize"]
    f, p = lines
    assert f["pod"] == "ember-fn/chat-1" and f["model"] == "m" and f["function"] == "chat"
    assert f["passed"] == 2 and "cannot fit" in f["nodes"]["full"]["failed"]
    # 100 MiB at the default 2 GB/s: the pool's 1 GB/s was measured over no loads worth trusting
    assert p["best"] == "warm" and p["nodes"]["cold"] == {"start_s": pytest.approx(0.052429), "score": 0}


def test_a_pool_that_stops_reporting_is_filtered_out_after_the_ttl(state: ClusterState) -> None:
    state.report_device("a/cpu", report(1 << 30, {}))
    state.report_device("b/cpu", report(1 << 30, {}))
    config = ExtenderConfig.from_env()
    extender = Extender(ResidencyCache(state.device_reports, ttl_s=0.0), config)
    assert asyncio.run(extender.filter(args(["a", "b"])))["NodeNames"] == ["a", "b"]
    old = time.time() - config.placement.report_ttl_s - 1  # a's last report, its pool gone since
    state.r.set(f"{state.p}device:a/cpu", json.dumps(DeviceReport.encode(report(1 << 30, {}), updated=old)))
    out = asyncio.run(extender.filter(args(["a", "b"])))
    assert out["NodeNames"] == ["b"] and "pool down" in out["FailedAndUnresolvableNodes"]["a"]


def test_a_pod_that_is_no_function_reads_nothing(state: ClusterState) -> None:
    cache = ResidencyCache(state.device_reports, ttl_s=0.0)
    extender = Extender(cache)
    document = args(["a"])
    del document["Pod"]["metadata"]["annotations"][cluster_keys.ANNOTATION_MODEL]
    assert asyncio.run(extender.filter(document))["NodeNames"] == ["a"]
    assert asyncio.run(extender.prioritize(document)) == [{"Host": "a", "Score": 0}]
    assert cache.reads == 0


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_EXTENDER_REPORT_TTL", "3")
    monkeypatch.setenv("EMBER_EXTENDER_CACHE", "0.25")
    monkeypatch.setenv("EMBER_EXTENDER_MAX_NODES", "100")
    c = ExtenderConfig.from_env()
    assert (c.placement.report_ttl_s, c.cache_s, c.wire.max_nodes) == (3.0, 0.25, 100)
    for env, bad in (
        ("EMBER_EXTENDER_CACHE", "soon"),
        ("EMBER_EXTENDER_CACHE", "99"),
        ("EMBER_EXTENDER_MAX_NODES", "0"),
    ):
        monkeypatch.setenv(env, bad)
        with pytest.raises(ValueError, match="EMBER_EXTENDER"):
            ExtenderConfig.from_env()
        monkeypatch.delenv(env)
