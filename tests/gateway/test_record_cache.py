"""The invoker's function records fed by the router's reconcile, against a real redis-server:
a request after idle finds its record without reading Redis, and this gateway's own deploys
and deletes still take effect at once (a read from before them never brings them back)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from gateway.metrics import Metrics
from gateway.proxy import Invoker, ProxyConfig
from scheduler.errors import FunctionNotFound
from scheduler.records import FunctionRecord
from scheduler.router import Router
from scheduler.state import ClusterState
from tests.scheduler.test_leases import RoutingOnlyLauncher


def document(concurrency: int) -> dict[str, Any]:
    return {"spec": {"scaling": {"concurrency": concurrency, "minScale": 0, "keepAlive": "30s"}}}


def concurrency(record: FunctionRecord) -> int:
    return record.scaling.concurrency


def changed_behind_its_back(state: ClusterState, name: str, value: int) -> None:
    """Another gateway's deploy: stored in Redis, this gateway's invoker is not told."""
    state.put_function(name, document(value))


def test_reconcile_feeds_the_invokers_records(state: ClusterState) -> None:
    state.put_function("f", document(2))

    async def scenario() -> None:
        router = Router(state, RoutingOnlyLauncher())
        invoker = Invoker(state, router, Metrics(), ProxyConfig(record_ttl_s=0.5))
        router.on_records(invoker.records_read)
        try:
            await router.reconcile()
            changed_behind_its_back(state, "f", 3)
            # The reconcile's read serves it (no Redis read: the change is not seen yet) ...
            assert concurrency(await invoker.record("f")) == 2
            await asyncio.sleep(0.6)  # ... for record_ttl_s after that read began
            assert concurrency(await invoker.record("f")) == 3
            changed_behind_its_back(state, "f", 4)
            await router.reconcile()  # a newer read replaces what the invoker fetched itself
            assert concurrency(await invoker.record("f")) == 4
            # Deleted by another gateway: gone from the next read, dropped from the cache.
            state.delete_function("f")
            await router.reconcile()
            with pytest.raises(FunctionNotFound):
                await invoker.record("f")
        finally:
            await router.close()
            await invoker.close()

    asyncio.run(scenario())


def test_a_read_from_before_this_gateways_deploy_does_not_bring_the_old_record_back(
    state: ClusterState,
) -> None:
    state.put_function("f", document(2))

    async def scenario() -> None:
        router = Router(state, RoutingOnlyLauncher())
        invoker = Invoker(state, router, Metrics(), ProxyConfig(record_ttl_s=30.0))
        try:
            before = time.monotonic()
            old = state.functions()
            # This gateway deploys (stored, then forgotten) while that read is under way.
            state.put_function("f", document(5))
            invoker.forget("f")
            invoker.records_read(old, before)
            assert concurrency(await invoker.record("f")) == 5
            # A read that began after the deploy is taken (and ends what forget() remembers).
            invoker.records_read(state.functions(), time.monotonic())
            changed_behind_its_back(state, "f", 6)
            assert concurrency(await invoker.record("f")) == 5  # served from that read, no Redis
            invoker.forget("f")
            middle = time.monotonic()
            read_in_the_middle = state.functions()  # begun after the forget: it could be taken
            changed_behind_its_back(state, "f", 7)
            assert concurrency(await invoker.record("f")) == 7
            # ... but not over a record fetched after that read began.
            invoker.records_read(read_in_the_middle, middle)
            assert concurrency(read_in_the_middle["f"]) == 6
            assert concurrency(await invoker.record("f")) == 7
        finally:
            await invoker.close()
            await router.close()

    asyncio.run(scenario())
