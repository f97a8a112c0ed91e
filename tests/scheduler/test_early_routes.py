"""Early routes (pipelined activation) against a real redis-server: once the launcher names
the process an instance is being activated in, a waiting request takes a slot of the still
``starting`` instance and goes there at once; the slot is counted in Redis before the instance
is ready and carries over to ``ready``; a start that fails leaves nothing counted."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from scheduler.errors import Rejected, StartFailed
from scheduler.launcher import MAX_EARLY, OnTarget
from scheduler.records import FunctionRecord, Instance
from scheduler.router import Route, Router, RouterConfig
from scheduler.state import ClusterState
from tests.scheduler.test_reclaim import DEVICE, BookkeepingLauncher, Started, deploy


def test_a_starting_instance_gives_slots_up_to_its_concurrency(state: ClusterState) -> None:
    instance_id = state.scale_up("f", 1, DEVICE)
    assert instance_id is not None
    assert state.claim_starting(instance_id, 2) is True
    assert state.claim_starting(instance_id, 2) is True
    assert state.claim_starting(instance_id, 2) is False  # full
    # Ready keeps what was counted; an early route is then no longer given.
    state.transition(instance_id, "starting", "ready", url="http://127.0.0.1:9", deadline=time.time() + 30)
    (inst,) = state.instances("f")
    assert inst.state == "ready" and inst.in_flight == 2
    assert state.claim_starting(instance_id, 8) is None
    assert state.acquire_slot("f", 2) is None  # both slots are held
    assert state.release(instance_id, 30.0) == 1
    # A forgotten (failed) start gives nothing, and a late release does not bring it back.
    state.forget_from("f", instance_id, "ready")
    assert state.claim_starting(instance_id, 8) is None
    assert state.release(instance_id, 30.0) == -1
    assert state.instances("f") == []


class ActivatingLauncher(BookkeepingLauncher):
    """Names the process at once (``on_target``), then activates until ``finish`` is set; with
    ``fail``, the activation fails then."""

    def __init__(self, state: ClusterState, fail: bool = False, name_later: bool = False) -> None:
        super().__init__(state, capacity=1 << 30)
        self.fail = fail
        self.name = asyncio.Event()  # with name_later, the process is named once this is set
        if not name_later:
            self.name.set()
        self.finish = asyncio.Event()
        self.targets: list[str] = []  # every process named
        self.on_target: OnTarget | None = None
        self.launches_started = 0

    async def launch(
        self,
        instance_id: str,
        spec: dict[str, Any],
        model: dict[str, Any],
        device_id: str,
        deadline: float,
        on_target: OnTarget | None = None,
    ) -> Started:
        assert on_target is not None, "the cold starter always asks for the target"
        self.launches_started += 1
        url = f"http://127.0.0.1:9/{instance_id}"
        await self.name.wait()
        self.targets.append(url)
        self.on_target = on_target  # a test names another process, as the agent's fallback does
        on_target(url, f"token-{instance_id}")
        await self.finish.wait()
        if self.fail:
            raise RuntimeError("the activation failed")
        return await super().launch(instance_id, spec, model, device_id, deadline)


async def routed_while_starting(
    launcher: ActivatingLauncher, router: Router, record: FunctionRecord
) -> asyncio.Future[Route]:
    """A request of ``f`` being routed, once the launch it caused began."""
    waiting = asyncio.ensure_future(router.route("f", record, time.time() + 30))
    while not launcher.launches_started:
        await asyncio.sleep(0.01)
    return waiting


def test_a_waiting_request_goes_to_the_instance_being_activated(state: ClusterState) -> None:
    deploy(state, "f", 1 << 20)
    record: FunctionRecord = state.function("f")

    async def scenario() -> None:
        launcher = ActivatingLauncher(state)
        router = Router(state, launcher, RouterConfig(lease_s=5.0))
        try:
            first = await asyncio.wait_for(router.route("f", record, time.time() + 30), 10)
            # Routed before the activation ended: to its process, with its credential.
            assert first.early and first.cold and not launcher.finish.is_set()
            assert first.url == f"http://127.0.0.1:9/{first.instance_id}"
            assert first.token == f"token-{first.instance_id}"
            (inst,) = state.instances("f")
            assert inst.state == "starting" and inst.in_flight == 1
            # Concurrency 1: the next request waits for the slot, not for another early route.
            second = asyncio.ensure_future(router.route("f", record, time.time() + 30))
            await asyncio.sleep(0.2)
            assert not second.done()
            launcher.finish.set()
            while state.instances("f")[0].state != "ready":
                await asyncio.sleep(0.01)
            assert state.instances("f")[0].in_flight == 1  # the early request's slot carried over
            # The early request ends: its slot is not leased (a lease carries no instance header,
            # and its instance could still be activating) but freed for the next request.
            await router.done("f", first, 30.0, 0.01)
            assert router.leases.take("f") is None
            routed = await asyncio.wait_for(second, 10)
            assert routed.instance_id == first.instance_id and not routed.early
            await router.done("f", routed, 30.0, 0.01, reusable=False)
            assert state.instances("f")[0].in_flight == 0
        finally:
            await router.close()

    asyncio.run(scenario())


def test_a_failed_activation_leaves_no_slot_and_fails_the_waiting_requests(state: ClusterState) -> None:
    deploy(state, "f", 1 << 20)
    record: FunctionRecord = state.function("f")

    async def scenario() -> None:
        launcher = ActivatingLauncher(state, fail=True)
        router = Router(state, launcher, RouterConfig(lease_s=0.0))
        try:
            arrived = time.time()
            early = await asyncio.wait_for(router.route("f", record, time.time() + 30), 10)
            assert early.early
            waiting = asyncio.ensure_future(router.route("f", record, time.time() + 30))
            await asyncio.sleep(0.1)
            launcher.finish.set()
            with pytest.raises(StartFailed, match="the activation failed"):
                await asyncio.wait_for(waiting, 10)
            while state.instances("f"):  # forgotten in a thread, right after the failure is recorded
                await asyncio.sleep(0.01)
            # The worker told the early request it never ran: its slot is freed, nothing is
            # recreated, and no early route is left to take.
            await router.done("f", early, 30.0, 0.01, reusable=False)
            assert state.instances("f") == [] and router.starter.targets("f") == []
            # Routed again as the request it is (since it arrived): the start's failure fails it,
            # with the reason, and no other start is tried for it.
            with pytest.raises(StartFailed, match="the activation failed"):
                await router.route("f", record, time.time() + 30, since=arrived)
            assert launcher.launches == 0 and len(launcher.targets) == 1
        finally:
            await router.close()

    asyncio.run(scenario())


def test_no_more_requests_go_early_than_a_worker_holds(state: ClusterState) -> None:
    deploy(state, "f", 1 << 20, concurrency=1000)
    record: FunctionRecord = state.function("f")

    async def scenario() -> None:
        launcher = ActivatingLauncher(state)
        router = Router(state, launcher, RouterConfig(lease_s=0.0))
        try:
            routes = [
                asyncio.ensure_future(router.route("f", record, time.time() + 30))
                for _ in range(MAX_EARLY + 1)
            ]
            while sum(r.done() for r in routes) < MAX_EARLY:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            assert sum(r.done() for r in routes) == MAX_EARLY  # the last one waits for ready
            assert all(r.result().early for r in routes if r.done())
            assert state.instances("f")[0].in_flight == MAX_EARLY
            launcher.finish.set()
            last = await asyncio.wait_for(asyncio.gather(*routes), 10)
            assert not last[-1].early and state.instances("f")[0].in_flight == MAX_EARLY + 1
        finally:
            await router.close()

    asyncio.run(scenario())


def test_a_ready_slot_goes_before_an_instance_being_activated(state: ClusterState) -> None:
    deploy(state, "f", 1 << 20, max_scale=2)
    record: FunctionRecord = state.function("f")

    async def scenario() -> None:
        launcher = ActivatingLauncher(state, name_later=True)
        busy = launcher.adopt("f", busy=True)  # ready, its one slot taken
        router = Router(state, launcher, RouterConfig(lease_s=0.0))
        try:
            # Scaled out: a second instance is starting.
            waiting = await routed_while_starting(launcher, router, record)
            # The busy instance frees its slot as the new one's process is named: the waiting
            # request takes the ready slot, not the activation.
            state.release(busy, 60.0)
            launcher.name.set()
            routed = await asyncio.wait_for(waiting, 10)
            assert routed.instance_id == busy and not routed.early
            launcher.finish.set()
        finally:
            await router.close()

    asyncio.run(scenario())


def script_calls(state: ClusterState) -> int:
    """How many Lua scripts the server ran so far (every slot lookup and claim is one)."""
    stats = state.r.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))


def test_a_start_from_zero_reads_no_instance_record_on_its_path(state: ClusterState) -> None:
    """The slot lookup that misses counts the function's live instances in its script
    (ClusterState.acquire_or_count): the scale-up it leads to decides on that count instead of
    reading every instance record first (two round trips more on a cold start's path)."""
    deploy(state, "f", 1 << 20)
    record: FunctionRecord = state.function("f")

    async def scenario() -> None:
        launcher = ActivatingLauncher(state)
        router = Router(state, launcher, RouterConfig(lease_s=5.0, poll_s=30.0))
        reads: list[str] = []
        read_instances = state.instances

        def instances(function: str, retry: bool = True) -> list[Instance]:
            reads.append(function)  # (the real read, counted)
            return read_instances(function, retry)

        state.instances = instances  # type: ignore[method-assign]
        try:
            first = await asyncio.wait_for(router.route("f", record, time.time() + 30), 10)
            assert first.early and first.cold and launcher.launches_started == 1
            assert reads == []
            launcher.finish.set()
        finally:
            await router.close()

    asyncio.run(scenario())


def test_the_request_that_starts_an_instance_from_zero_holds_its_first_slot(state: ClusterState) -> None:
    """Scaled from zero, no instance could free a slot sooner: the new record counts the
    request's slot, and once the process is named the request goes there with no Redis round
    trip on its path. A request that gives up meanwhile frees that slot once the start is known."""
    deploy(state, "f", 1 << 20, concurrency=2)
    record: FunctionRecord = state.function("f")

    async def scenario() -> None:
        launcher = ActivatingLauncher(state, name_later=True)
        # (No polling turn meanwhile: only the process being named wakes the request.)
        router = Router(state, launcher, RouterConfig(lease_s=0.0, poll_s=30.0))
        try:
            waiting = await routed_while_starting(launcher, router, record)
            (inst,) = state.instances("f")
            assert inst.state == "starting" and inst.in_flight == 1  # counted with the record
            before = script_calls(state)
            launcher.name.set()
            routed = await asyncio.wait_for(waiting, 10)
            assert routed.early and routed.cold and routed.instance_id == inst.instance_id
            assert script_calls(state) == before
            assert state.instances("f")[0].in_flight == 1  # one slot: the request's
            launcher.finish.set()
            while state.instances("f")[0].state != "ready":
                await asyncio.sleep(0.01)
            await router.done("f", routed, 30.0, 0.01, reusable=False)
            assert state.instances("f")[0].in_flight == 0
        finally:
            await router.close()

    async def gave_up() -> None:
        state.forget_instance("f", state.instances("f")[0].instance_id)
        launcher = ActivatingLauncher(state, name_later=True)
        router = Router(state, launcher, RouterConfig(lease_s=0.0, poll_s=30.0))
        try:
            waiting = await routed_while_starting(launcher, router, record)
            waiting.cancel()  # its client hung up before the instance took it
            await asyncio.sleep(0.05)
            assert state.instances("f")[0].in_flight == 1  # not known yet to outlive the start
            launcher.name.set()
            launcher.finish.set()
            while (inst := state.instances("f")[0]).state != "ready" or inst.in_flight:
                await asyncio.sleep(0.01)
        finally:
            await router.close()

    asyncio.run(scenario())
    asyncio.run(gave_up())


def test_a_slot_given_up_while_its_instance_starts_goes_to_the_next_request(state: ClusterState) -> None:
    """The request that started an instance from zero hangs up while it starts: its slot, still
    counted in Redis, goes to the next request, which starts no second instance for it."""
    deploy(state, "f", 1 << 20, concurrency=1, max_scale=2)
    record: FunctionRecord = state.function("f")

    async def scenario() -> None:
        launcher = ActivatingLauncher(state, name_later=True)
        router = Router(state, launcher, RouterConfig(lease_s=0.0))
        try:
            first = await routed_while_starting(launcher, router, record)
            first.cancel()
            await asyncio.sleep(0.05)
            second = asyncio.ensure_future(router.route("f", record, time.time() + 30))
            await asyncio.sleep(0.3)
            assert launcher.launches_started == 1, "a second instance was started for one request"
            launcher.name.set()
            routed = await asyncio.wait_for(second, 10)
            assert routed.early and state.instances("f")[0].in_flight == 1  # one slot: the second's
            launcher.finish.set()
            await router.done("f", routed, 30.0, 0.01, reusable=False)
            while (inst := state.instances("f")[0]).state != "ready" or inst.in_flight:
                await asyncio.sleep(0.01)
        finally:
            await router.close()

    asyncio.run(scenario())


def test_a_claim_is_resolved_when_its_start_never_ran(state: ClusterState) -> None:
    """A start's task cancelled before it ran (the router closing) resolves the claim of the
    request that waits for it, which then goes on as if the start failed (here: to its
    deadline) instead of holding a slot nobody frees."""
    deploy(state, "f", 1 << 20, concurrency=1)
    record: FunctionRecord = state.function("f")

    async def scenario() -> None:
        launcher = ActivatingLauncher(state, name_later=True)
        router = Router(state, launcher, RouterConfig(lease_s=0.0, poll_s=0.05))
        spawn = router._spawn

        def cancelling_starts(coro: Any) -> asyncio.Task[Any]:
            task = spawn(coro)
            if coro.__qualname__ == "ColdStarter.start":
                task.cancel()  # before its first step, as close() cancels a fresh one
            return task

        router._spawn = cancelling_starts  # type: ignore[method-assign]
        try:
            with pytest.raises(Rejected):
                await router.route("f", record, time.time() + 0.5)
            assert router._claims["f"] == 0 and launcher.launches_started == 0
            await asyncio.sleep(0.05)
            assert all(task.done() for task in router._tasks)  # no slot-freeing task waits forever
        finally:
            await router.close()

    asyncio.run(scenario())


def test_a_failed_early_route_withdraws_only_the_process_it_went_to(state: ClusterState) -> None:
    deploy(state, "f", 1 << 20)
    record: FunctionRecord = state.function("f")

    async def scenario() -> None:
        launcher = ActivatingLauncher(state)
        router = Router(state, launcher, RouterConfig(lease_s=0.0))
        try:
            early = await asyncio.wait_for(router.route("f", record, time.time() + 30), 10)
            # The launch moved on to another process (the first one's activation failed): a
            # late failure of the request sent to the first one leaves the new target in place.
            assert launcher.on_target is not None
            launcher.on_target("http://w2", "token-2")
            assert not await router.instance_lost("f", early, 30.0)
            assert [t.url for t in router.starter.targets("f")] == ["http://w2"]
            again = await asyncio.wait_for(router.route("f", record, time.time() + 30), 10)
            assert again.early and again.url == "http://w2"
            # Its never-ran answer from the current process withdraws it: the others wait for
            # ready. A request that merely ended (a client that hung up) withdraws nothing.
            await router.done("f", again, 30.0, 0.01, reusable=False)
            assert [t.url for t in router.starter.targets("f")] == ["http://w2"]
            assert not await router.instance_lost("f", again)
            assert router.starter.targets("f") == []
            # So does one whose connection to it failed (the process is gone): its slot is freed.
            launcher.on_target("http://w3", "token-3")
            third = await asyncio.wait_for(router.route("f", record, time.time() + 30), 10)
            assert third.early and third.url == "http://w3" and state.instances("f")[0].in_flight == 1
            assert not await router.instance_lost("f", third, 30.0)  # not ready yet: not forgotten
            assert router.starter.targets("f") == [] and state.instances("f")[0].in_flight == 0
            launcher.finish.set()
        finally:
            await router.close()

    asyncio.run(scenario())
