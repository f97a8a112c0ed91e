"""Slot leases of the router against a real redis-server: a finished request's slot serves
the next request of the function without a Redis round trip, and goes back to Redis after
``lease_s``, at once when the request failed, or when the instance or function goes away."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from scheduler.launcher import OnTarget, StartedInstance
from scheduler.records import FunctionRecord
from scheduler.router import Route, Router, RouterConfig
from scheduler.state import ClusterState

DEVICE = "n/cpu"
RECORD = FunctionRecord.create(
    "f", {"spec": {"scaling": {"concurrency": 1, "minScale": 0, "maxScale": 1, "keepAlive": "30s"}}}
)


class RoutingOnlyLauncher:
    """A gateway that routes to instances already running and starts none (every route in
    these tests finds a ready instance or a lease, so nothing is ever launched)."""

    def devices(self) -> list[str]:
        return [DEVICE]

    async def launch(
        self,
        instance_id: str,
        spec: dict[str, Any],
        model: dict[str, Any],
        device_id: str,
        deadline: float,
        on_target: OnTarget | None = None,
    ) -> StartedInstance:
        raise RuntimeError("this gateway starts no instances")

    async def stop(self, instance_id: str, standby: bool = False) -> None:
        return None

    async def retire(self, name: str) -> None:
        return None

    def alive(self, instance_id: str) -> bool:
        return True

    def owns(self, instance_id: str) -> bool:
        return False

    async def report(self) -> dict[str, dict[str, Any]]:
        return {}


def ready_instance(state: ClusterState, name: str = "f") -> str:
    instance_id = state.scale_up(name, 1, DEVICE)
    assert instance_id is not None
    state.transition(instance_id, "starting", "ready", url="http://127.0.0.1:9", deadline=time.time() + 30)
    return instance_id


def in_flight(state: ClusterState, name: str = "f") -> int:
    return sum(i.in_flight for i in state.instances(name))


def router(state: ClusterState, lease_s: float) -> Router:
    return Router(state, RoutingOnlyLauncher(), RouterConfig(lease_s=lease_s))


def test_a_leased_slot_serves_the_next_request_then_goes_back(state: ClusterState) -> None:
    instance_id = ready_instance(state)

    async def scenario() -> None:
        r = router(state, lease_s=0.2)
        first = await r.route("f", RECORD, time.time() + 10)
        assert first.instance_id == instance_id and in_flight(state) == 1
        await r.done("f", first, 30.0, 0.01)
        assert in_flight(state) == 1  # still held: leased to this gateway
        second = await r.route("f", RECORD, time.time() + 10)
        assert second == Route(instance_id, first.url, False, 0.0) and in_flight(state) == 1
        await r.done("f", second, 30.0, 0.01)
        await asyncio.sleep(0.5)  # past lease_s: the slot is back in Redis, keep-alive restarted
        assert in_flight(state) == 0
        (inst,) = state.instances("f")
        assert inst.deadline > time.time() + 25
        await r.close()

    asyncio.run(scenario())


def test_failed_requests_release_at_once_and_leases_off_means_no_lease(state: ClusterState) -> None:
    ready_instance(state)

    async def scenario() -> None:
        r = router(state, lease_s=5.0)
        route = await r.route("f", RECORD, time.time() + 10)
        await r.done("f", route, 30.0, 0.01, reusable=False)
        assert in_flight(state) == 0
        off = router(state, lease_s=0.0)
        route = await off.route("f", RECORD, time.time() + 10)
        await off.done("f", route, 30.0, 0.01)
        assert in_flight(state) == 0
        await r.close()
        await off.close()

    asyncio.run(scenario())


def test_a_waiting_request_takes_the_lease_without_waiting_for_it_to_expire(state: ClusterState) -> None:
    ready_instance(state)

    async def scenario() -> None:
        r = router(state, lease_s=5.0)  # far longer than the test may take
        busy = await r.route("f", RECORD, time.time() + 10)  # concurrency 1: the only slot

        async def later() -> None:
            await asyncio.sleep(0.1)
            await r.done("f", busy, 30.0, 0.01)

        t0 = time.monotonic()
        finisher = asyncio.create_task(later())
        waited = await r.route("f", RECORD, time.time() + 10)
        await finisher
        assert waited.instance_id == busy.instance_id and time.monotonic() - t0 < 1.0
        assert in_flight(state) == 1
        await r.done("f", waited, 30.0, 0.01)
        await r.close()  # shutdown frees held slots
        assert in_flight(state) == 0

    asyncio.run(scenario())


def test_retire_and_dead_instances_drop_their_leases(state: ClusterState) -> None:
    instance_id = ready_instance(state)

    async def scenario() -> None:
        r = router(state, lease_s=5.0)
        route = await r.route("f", RECORD, time.time() + 10)
        await r.done("f", route, 30.0, 0.01)
        assert in_flight(state) == 1
        await r.drop_leases("f", "another-instance")  # someone else's instance: kept
        assert in_flight(state) == 1
        await r.drop_leases("f", instance_id)
        assert in_flight(state) == 0
        route = await r.route("f", RECORD, time.time() + 10)
        await r.done("f", route, 30.0, 0.01)
        await r.retire("f")  # a redeploy or delete: leases go first, then the instance drains
        (inst,) = state.instances("f")
        assert inst.state in ("draining", "gone") and inst.in_flight == 0
        await r.close()

    asyncio.run(scenario())


def test_lease_config_is_validated() -> None:
    for bad in ({"lease_s": -1.0}, {"lease_s": 60.0}, {"max_leases": -1}):
        with pytest.raises(ValueError, match="lease_s"):
            RouterConfig(**bad)


def test_slot_policy_and_instances_per_device_come_from_the_environment() -> None:
    assert RouterConfig.from_env({}) == RouterConfig()
    config = RouterConfig.from_env({"EMBER_SLOT_POLICY": "pack", "EMBER_INSTANCES_PER_DEVICE": "1"})
    assert config.pack and config.instances_per_device == 1
    with pytest.raises(ValueError, match="spread or pack"):
        RouterConfig.from_env({"EMBER_SLOT_POLICY": "fill"})
    with pytest.raises(ValueError, match="integer"):
        RouterConfig.from_env({"EMBER_INSTANCES_PER_DEVICE": "one"})
    with pytest.raises(ValueError, match=r"\[0, 1024\]"):
        RouterConfig.from_env({"EMBER_INSTANCES_PER_DEVICE": "-1"})


class DeadInstanceLauncher(RoutingOnlyLauncher):
    """Runs the instances in ``dead`` (their processes gone) and nothing else."""

    def __init__(self, dead: set[str]) -> None:
        self.dead = dead
        self.stopped: list[str] = []

    async def stop(self, instance_id: str, standby: bool = False) -> None:
        self.stopped.append(instance_id)

    def alive(self, instance_id: str) -> bool:
        return instance_id not in self.dead

    def owns(self, instance_id: str) -> bool:
        return instance_id in self.dead


def test_instance_lost_forgets_a_dead_instance_and_frees_a_live_ones_slot(state: ClusterState) -> None:
    dead, live = ready_instance(state), ready_instance(state, "g")

    async def scenario() -> None:
        launcher = DeadInstanceLauncher({dead})
        r = Router(state, launcher, RouterConfig(lease_s=5.0))
        route = await r.route("f", RECORD, time.time() + 10)
        await r.done("f", route, 30.0, 0.01)  # leased: dropped with the instance
        assert await r.instance_lost("f", route, 30.0)
        assert state.instances("f") == [] and launcher.stopped == [dead]
        other = await r.route("g", RECORD, time.time() + 10)
        assert not await r.instance_lost("g", other, 30.0)  # alive (or not ours): the slot is freed
        assert in_flight(state, "g") == 0 and [i.instance_id for i in state.instances("g")] == [live]
        await r.close()

    asyncio.run(scenario())


class StopRecordingLauncher(RoutingOnlyLauncher):
    """Records every stop and whether it asked for a standby."""

    def __init__(self) -> None:
        self.stops: list[tuple[str, bool]] = []

    async def stop(self, instance_id: str, standby: bool = False) -> None:
        self.stops.append((instance_id, standby))


def test_an_idled_out_instance_is_stopped_with_a_standby_and_a_retired_one_without(
    state: ClusterState,
) -> None:
    idle = ready_instance(state)

    async def scenario() -> None:
        launcher = StopRecordingLauncher()
        r = Router(state, launcher, RouterConfig(lease_s=0.0))
        await r.expire_idle("f", RECORD, [DEVICE], time.time() + 60)  # past its 30 s keep-alive
        for _ in range(100):
            if launcher.stops:
                break
            await asyncio.sleep(0.01)
        assert launcher.stops == [(idle, True)]
        retired = ready_instance(state)
        await r.retire("f")  # a redeploy or delete: the next start must not reuse its preparation
        for _ in range(100):
            if len(launcher.stops) == 2:
                break
            await asyncio.sleep(0.01)
        assert launcher.stops == [(idle, True), (retired, False)]
        await r.close()

    asyncio.run(scenario())
