"""The invoker's function records fed by the router's reconcile, against a real redis-server:
a request after idle finds its record without reading Redis, and this gateway's own deploys
and deletes still take effect at once (a read from before them never brings them back)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.metrics import Metrics
from gateway.proxy import Invoker, ProxyConfig
from scheduler.errors import FunctionNotFound, StateUnavailable
from scheduler.records import FunctionRecord
from scheduler.router import Router
from scheduler.state import ClusterState
from tests.scheduler.test_leases import RoutingOnlyLauncher


def document(concurrency: int) -> dict[str, Any]:
    return {"spec": {"scaling": {"concurrency": concurrency, "minScale": 0, "keepAlive": "30s"}}}


def concurrency(record: FunctionRecord) -> int:
    return record.scaling.concurrency


@contextlib.asynccontextmanager
async def gateway(
    state: ClusterState, ttl_s: float, reads: Any = None, fed: bool = False
) -> AsyncIterator[tuple[Router, Invoker]]:
    """A router and an invoker over ``state`` (the invoker reads records through ``reads``
    when given); ``fed``: the router's reconcile hands the invoker its reads."""
    router = Router(state, RoutingOnlyLauncher())
    invoker = Invoker(reads or state, router, Metrics(), ProxyConfig(record_ttl_s=ttl_s))
    if fed:
        router.on_records(invoker.records_read)
    try:
        yield router, invoker
    finally:
        await invoker.close()
        await router.close()


def changed_behind_its_back(state: ClusterState, name: str, value: int) -> None:
    """Another gateway's deploy: stored in Redis, this gateway's invoker is not told."""
    state.put_function(name, document(value))


def test_reconcile_feeds_the_invokers_records(state: ClusterState) -> None:
    state.put_function("f", document(2))

    async def scenario() -> None:
        async with gateway(state, 2.0, fed=True) as (router, invoker):
            await router.reconcile()
            changed_behind_its_back(state, "f", 3)
            # The reconcile's read serves it (no Redis read: the change is not seen yet) ...
            assert concurrency(await invoker.record("f")) == 2
            await asyncio.sleep(2.1)  # ... for record_ttl_s after that read began
            assert concurrency(await invoker.record("f")) == 3
            changed_behind_its_back(state, "f", 4)
            await router.reconcile()  # a newer read replaces what the invoker fetched itself
            assert concurrency(await invoker.record("f")) == 4
            # Deleted by another gateway: gone from the next read, dropped from the cache.
            state.delete_function("f")
            await router.reconcile()
            with pytest.raises(FunctionNotFound):
                await invoker.record("f")

    asyncio.run(scenario())


def test_a_read_from_before_this_gateways_deploy_or_delete_does_not_bring_the_old_record_back(
    state: ClusterState,
) -> None:
    state.put_function("f", document(2))

    async def scenario() -> None:
        async with gateway(state, 30.0) as (_, invoker):
            before = time.monotonic()
            old = state.functions()
            # This gateway deploys (stored, then forgotten) while that read is under way.
            state.put_function("f", document(5))
            invoker.forget("f")
            invoker.records_read(old, before)
            assert concurrency(await invoker.record("f")) == 5
            # A read that began after the deploy is taken.
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
            # Nor does a read from before this gateway's delete bring the function back.
            before = time.monotonic()
            old = state.functions()
            state.delete_function("f")
            invoker.forget("f")
            invoker.records_read(old, before)
            with pytest.raises(FunctionNotFound):
                await invoker.record("f")

    asyncio.run(scenario())


class BlippingState:
    """The real state, but Redis does not answer the record read's one attempt on the event
    loop (as when it restarts), and the read's retry in a thread is held once it has read."""

    def __init__(self, inner: ClusterState) -> None:
        self.inner = inner
        self.blip = True
        self.read = threading.Event()
        self.go_on = threading.Event()

    def function(self, name: str, retry: bool = True) -> FunctionRecord:
        if not self.blip:
            return self.inner.function(name, retry)
        if not retry:
            raise StateUnavailable("Redis did not answer")
        record = self.inner.function(name, retry)
        self.read.set()
        assert self.go_on.wait(10)
        return record

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)


def test_a_fetch_from_before_this_gateways_deploy_is_not_kept(state: ClusterState) -> None:
    state.put_function("f", document(2))

    async def scenario() -> None:
        blipping = BlippingState(state)
        async with gateway(state, 30.0, blipping) as (_, invoker):
            fetching = asyncio.create_task(invoker.record("f"))  # read in a thread, held
            await asyncio.to_thread(blipping.read.wait, 10)
            await asyncio.to_thread(state.put_function, "f", document(5))  # this gateway deploys
            invoker.forget("f")
            blipping.go_on.set()
            assert concurrency(await fetching) == 2  # it began before the deploy
            blipping.blip = False
            assert concurrency(await invoker.record("f")) == 5  # ... and was not kept
            # Nor does a fetch replace a reconcile read that began after it.
            blipping.blip, blipping.go_on = True, threading.Event()
            blipping.read.clear()
            changed_behind_its_back(state, "f", 6)
            invoker.forget("f")
            fetching = asyncio.create_task(invoker.record("f"))
            await asyncio.to_thread(blipping.read.wait, 10)
            changed_behind_its_back(state, "f", 7)
            invoker.records_read(state.functions(), time.monotonic())
            blipping.go_on.set()
            assert concurrency(await fetching) == 6
            blipping.blip = False
            assert concurrency(await invoker.record("f")) == 7

    asyncio.run(scenario())
