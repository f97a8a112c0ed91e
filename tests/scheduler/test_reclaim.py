"""The router under memory pressure, against a real redis-server: what it stops to make room
for a cold start, and how often it tries a pool that refuses a start for room.

The launcher keeps one device's books as its pool would (capacity, the models resident, the
ones running instances pin) and publishes them as the device report placement reads: an
instance pins its model while it runs, a stopped one leaves it resident and evictable.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from scheduler.cold_start import LOST_BEFORE_FAILURE, ColdStarter
from scheduler.errors import Rejected, StartFailed, StateUnavailable
from scheduler.launcher import INSTANCE_LOST, NO_ROOM, OnTarget
from scheduler.records import ModelRef
from scheduler.router import Router, RouterConfig
from scheduler.state import ClusterState

DEVICE = "n/cpu"


class NoRoomError(RuntimeError):
    code = NO_ROOM


@dataclass(frozen=True)
class Started:
    url: str
    pid: int = 1
    bytes_loaded: int = 0
    bytes_reused: int = 0
    timings_ms: dict[str, float] = field(default_factory=dict)
    log_path: str = ""
    token: str = ""


class BookkeepingLauncher:
    """One device whose pool holds ``capacity`` bytes (see the module docstring); with
    ``refuse``, the pool refuses every start for room whatever its report says (free space
    cut into pieces). Launches of a model in ``held_launches`` wait for its event; with
    ``held_report``, the next report reads the books, sets ``report_read`` and waits for that
    event before publishing them (as the agent reads the pool's stats, then writes to Redis)."""

    def __init__(self, state: ClusterState, capacity: int, refuse: bool = False) -> None:
        self.state = state
        self.capacity = capacity
        self.refuse = refuse
        self.resident: dict[str, int] = {}  # model id -> bytes
        self.running: dict[str, str] = {}  # instance id -> model id
        self.kv: dict[str, int] = {}  # instance id -> bytes of the KV blocks it holds
        self.launches = 0
        self.reports = 0
        self.stopped: list[str] = []
        self.held_launches: dict[str, asyncio.Event] = {}  # model id -> released when set
        # Every launch's worker serves, then dies before its activation's reply (the agent's
        # InstanceLost), while set.
        self.dying = False
        self.held_report: asyncio.Event | None = None
        self.fail_report = False  # every report raises once it published the books
        self.report_read = asyncio.Event()

    def devices(self) -> list[str]:
        return [DEVICE]

    def free(self) -> int:
        return self.capacity - sum(self.resident.values()) - sum(self.kv.values())

    def _make_room(self, model_id: str, size: int) -> bool:
        if model_id in self.resident:
            return True
        pinned = set(self.running.values())
        for victim in [m for m in self.resident if m not in pinned]:
            if self.free() >= size:
                break
            del self.resident[victim]
        if self.free() < size:
            return False
        self.resident[model_id] = size
        return True

    async def launch(
        self,
        instance_id: str,
        spec: dict[str, Any],
        model: dict[str, Any],
        device_id: str,
        deadline: float,
        on_target: OnTarget | None = None,
    ) -> Started:
        if self.dying:
            self.launches += 1
            raise DiedServing(f"the worker of {instance_id} exited while it served")
        held = self.held_launches.get(model["id"])
        if held is not None:
            await held.wait()
        self.launches += 1
        if self.refuse or not self._make_room(model["id"], model["weight_bytes"]):
            raise NoRoomError(f"no room for {model['id']}")
        self.running[instance_id] = model["id"]
        return Started(f"http://127.0.0.1:9/{instance_id}")

    async def stop(self, instance_id: str, standby: bool = False) -> None:
        self.kv.pop(instance_id, None)
        if self.running.pop(instance_id, None) is not None:
            self.stopped.append(instance_id)

    async def retire(self, name: str) -> None:
        return None

    def alive(self, instance_id: str) -> bool:
        return instance_id in self.running

    def owns(self, instance_id: str) -> bool:
        return instance_id in self.running

    def record(self) -> dict[str, Any]:
        """The device report of the books now."""
        pinned = set(self.running.values())
        return {
            "capacity_bytes": self.capacity,
            "free_bytes": self.free(),
            "evictable_bytes": sum(n for m, n in self.resident.items() if m not in pinned),
            "kv_bytes": sum(self.kv.values()),
            "models": dict(self.resident),
            "load_bandwidth": 1e9,
        }

    async def report(self) -> dict[str, dict[str, Any]]:
        self.reports += 1
        record = self.record()
        held, self.held_report = self.held_report, None
        if held is not None:
            self.report_read.set()
            await held.wait()
        self.state.report_device(DEVICE, record)
        if self.fail_report:  # (as a node agent whose next device's report failed)
            raise StateUnavailable("the report of another device failed")
        return {DEVICE: record}

    def adopt(self, name: str, busy: bool = False, kv: int = 0) -> str:
        """A ready instance of ``name`` (idle, or serving one request when ``busy``) holding
        ``kv`` bytes of KV blocks."""
        model = self.state.function(name).model
        assert model is not None and self._make_room(model.model_id, model.weight_bytes)
        instance_id = self.state.scale_up(name, 100, DEVICE)
        assert instance_id is not None
        self.state.transition(
            instance_id, "starting", "ready", url="http://127.0.0.1:9", deadline=time.time() + 60
        )
        self.running[instance_id] = model.model_id
        self.kv[instance_id] = kv
        assert self.free() >= 0
        if busy:
            assert self.state.acquire_slot(name, 1) is not None
        return instance_id


def deploy(
    state: ClusterState,
    name: str,
    weight_bytes: int,
    min_scale: int = 0,
    concurrency: int = 1,
    max_scale: int = 1,
) -> None:
    scaling = {"concurrency": concurrency, "minScale": min_scale, "maxScale": max_scale, "keepAlive": "60s"}
    model = ModelRef(f"m-{name}", f"/models/{name}", weight_bytes)
    state.put_function(name, {"spec": {"scaling": scaling}}, model)


def ready_ids(state: ClusterState, name: str) -> list[str]:
    return [i.instance_id for i in state.instances(name) if i.state == "ready"]


def test_a_model_larger_than_every_pool_stops_no_idle_instance(state: ClusterState) -> None:
    deploy(state, "g", 30)
    deploy(state, "big", 150)
    launcher = BookkeepingLauncher(state, capacity=100)
    idle = launcher.adopt("g")

    async def scenario() -> None:
        router = Router(state, launcher, RouterConfig())
        await launcher.report()
        with pytest.raises(Rejected, match="larger than every pool"):
            await router.route("big", state.function("big"), time.time() + 5)
        await router.close()

    asyncio.run(scenario())
    assert launcher.stopped == [] and ready_ids(state, "g") == [idle]


def test_idle_instances_stay_while_busy_ones_hold_the_room_then_yield(state: ClusterState) -> None:
    deploy(state, "h", 50)
    deploy(state, "g", 30)
    deploy(state, "f", 60)
    launcher = BookkeepingLauncher(state, capacity=100)
    busy = launcher.adopt("h", busy=True)
    idle = launcher.adopt("g")

    async def scenario() -> None:
        router = Router(state, launcher, RouterConfig())
        await launcher.report()
        # 20 free + g's 30 cannot hold 60 while h serves: stopping g would gain nothing.
        with pytest.raises(Rejected, match="deadline"):
            await router.route("f", state.function("f"), time.time() + 0.5)
        assert launcher.stopped == [] and ready_ids(state, "g") == [idle]
        state.release(busy, 60.0)  # h goes idle: now stopping idle instances makes room
        route = await router.route("f", state.function("f"), time.time() + 5)
        assert route.cold and launcher.running[route.instance_id] == "m-f"
        await router.close()

    asyncio.run(scenario())
    assert launcher.stopped  # the longest idle first, until f fits


def test_an_idle_instance_whose_kv_blocks_make_the_room_is_stopped(state: ClusterState) -> None:
    deploy(state, "g", 20)
    deploy(state, "f", 60)
    launcher = BookkeepingLauncher(state, capacity=100)
    idle = launcher.adopt("g", kv=50)  # 30 free: g's weights alone (20) would not be enough

    async def scenario() -> None:
        router = Router(state, launcher, RouterConfig())
        await launcher.report()
        route = await router.route("f", state.function("f"), time.time() + 5)
        assert launcher.running[route.instance_id] == "m-f"
        await router.close()

    asyncio.run(scenario())
    assert launcher.stopped == [idle]


def test_a_start_leaves_its_report_to_the_next_placement(state: ClusterState) -> None:
    """A started instance's pins reach the device report through the next placement, not on
    the start's path (where reading the pool's stats competed with its first request): that
    placement sees the model pinned, and no start is refused for room."""
    deploy(state, "f", 60)
    deploy(state, "g", 50)
    launcher = BookkeepingLauncher(state, capacity=100)

    async def scenario() -> None:
        router = Router(state, launcher, RouterConfig())
        await launcher.report()
        reports = launcher.reports
        route = await router.route("f", state.function("f"), time.time() + 5)
        while router.starter.launching(route.instance_id):
            await asyncio.sleep(0.01)
        assert launcher.reports == reports  # the start published nothing
        state.release(route.instance_id, 60.0)  # f idles: stopping it makes room for g
        other = await router.route("g", state.function("g"), time.time() + 5)
        assert launcher.running[other.instance_id] == "m-g"
        await router.close()

    asyncio.run(scenario())
    # Had g's placement read the report from before f started (f resident, unpinned), the pool
    # would have refused g's first start for room.
    assert launcher.launches == 2 and launcher.reports > 1


def test_placement_reads_what_its_launcher_published_and_redis_for_a_device_it_left_out(
    state: ClusterState,
) -> None:
    """The reports this gateway's launcher published last are what Redis holds (it is their
    only publisher): a placement takes them without a round trip. A device the last report
    left out (its pool down) is read from Redis, and so is every device while a report runs."""
    launcher = BookkeepingLauncher(state, capacity=100)

    async def scenario() -> None:
        starter = Router(state, launcher, RouterConfig()).starter
        await starter.report()
        # (Nothing but this test writes behind the launcher's back: it shows where the read went.)
        state.report_device(DEVICE, {**launcher.record(), "free_bytes": 7})
        assert (await starter._reports())[DEVICE].free_bytes == 100
        launcher.held_report = held = asyncio.Event()
        reporting = asyncio.create_task(starter.report())
        await launcher.report_read.wait()
        assert (await starter._reports())[DEVICE].free_bytes == 7  # mid-report: Redis
        held.set()
        await reporting
        assert (await starter._reports())[DEVICE].free_bytes == 100
        launcher.fail_report = True  # a report that failed half way: what it published is not known
        with pytest.raises(StateUnavailable):
            await starter.report()
        state.report_device(DEVICE, {**launcher.record(), "free_bytes": 7})
        assert (await starter._reports())[DEVICE].free_bytes == 7
        launcher.fail_report = False
        await starter.report()
        assert (await starter._reports())[DEVICE].free_bytes == 100
        launcher.devices = lambda: [DEVICE, "n/gpu0"]  # type: ignore[method-assign]
        state.report_device("n/gpu0", {"free_bytes": 5})
        state.report_device(DEVICE, {**launcher.record(), "free_bytes": 7})
        reports = await starter._reports()  # one read of both
        assert reports[DEVICE].free_bytes == 7 and reports["n/gpu0"].free_bytes == 5

    asyncio.run(scenario())


@pytest.mark.parametrize("second_placement", [False, True])
def test_a_start_ending_during_a_report_stays_marked(state: ClusterState, second_placement: bool) -> None:
    """f started (its device marked); a placement's report reads the pool, then g's start ends
    before that report is published, so it lacks g's pins. The next placement must not trust
    it: k (60 of 100 bytes, with f and g pinning 30 each) has no room. ``second_placement``:
    another placement reports while the first is still publishing (its write must not be
    overtaken by the older one's)."""
    deploy(state, "f", 30)
    deploy(state, "g", 30)
    deploy(state, "k", 60)
    launcher = BookkeepingLauncher(state, capacity=100)

    async def scenario() -> None:
        starter = ColdStarter(state, launcher, 5.0, lambda name: None)
        await launcher.report()
        deadline = time.time() + 30
        f_id = state.scale_up("f", 1, DEVICE)
        assert f_id is not None
        await starter.start(f_id, "f", state.function("f"), DEVICE, deadline)
        launcher.held_launches["m-g"] = asyncio.Event()
        g_id = state.scale_up("g", 1, DEVICE)
        assert g_id is not None
        g_start = asyncio.create_task(starter.start(g_id, "g", state.function("g"), DEVICE, deadline))
        launcher.held_report = published = asyncio.Event()
        first = asyncio.create_task(starter.place(state.function("f")))
        await launcher.report_read.wait()  # its stats are read: g pins nothing yet
        launcher.held_launches["m-g"].set()
        await g_start
        second = asyncio.create_task(starter.place(state.function("f"))) if second_placement else None
        await asyncio.sleep(0.05)
        published.set()
        await first
        if second is not None:
            await second
        assert {"m-f", "m-g"} <= set(launcher.running.values())
        device, _ = await starter.place(state.function("k"))
        assert device is None  # f and g pin 60 of 100 bytes: k's 60 fit nowhere

    asyncio.run(scenario())


def test_a_pool_refusing_for_room_is_tried_with_growing_pauses(state: ClusterState) -> None:
    deploy(state, "f", 60)
    deploy(state, "m", 60, min_scale=1)
    launcher = BookkeepingLauncher(state, capacity=100, refuse=True)  # its report says 100 free

    async def requests() -> None:
        router = Router(state, launcher, RouterConfig())
        await launcher.report()
        with pytest.raises(Rejected, match="deadline"):
            await router.route("f", state.function("f"), time.time() + 2.0)
        await router.close()

    asyncio.run(requests())
    # Each try costs the node a worker process. Tries at 0, 0, 0.25, 0.75 and 1.75 s: five,
    # where a tight loop made one per refusal (hundreds).
    assert 3 <= launcher.launches <= 6, launcher.launches

    launcher.launches = 0

    async def min_scale() -> None:
        router = Router(state, launcher, RouterConfig())
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.0:
            await router.reconcile()
            await asyncio.sleep(0.05)
        await router.close()

    asyncio.run(min_scale())
    assert 3 <= launcher.launches <= 6, launcher.launches


class DiedServing(Exception):
    code = INSTANCE_LOST


def test_instances_dying_while_they_serve_start_others_until_a_few_in_a_row(state: ClusterState) -> None:
    deploy(state, "f", 60)
    launcher = BookkeepingLauncher(state, capacity=100)
    launcher.dying = True

    async def requests() -> None:
        router = Router(state, launcher, RouterConfig())
        await launcher.report()
        # Not the function's failure: the waiting request starts another, until a few in a row.
        with pytest.raises(StartFailed, match=f"{LOST_BEFORE_FAILURE} instances in a row died serving"):
            await router.route("f", state.function("f"), time.time() + 30.0)
        assert launcher.launches == LOST_BEFORE_FAILURE
        assert state.instances("f") == []  # each record forgotten
        # A start that succeeds clears the count: the next deaths start others again.
        launcher.dying = False
        route = await router.route("f", state.function("f"), time.time() + 30.0)
        assert route.instance_id in launcher.running
        assert router.starter.failure("f") is None
        await router.close()

    asyncio.run(requests())


class CountingLauncher(BookkeepingLauncher):
    """Reports the instances it runs (as the agent does) and remembers the most at once. Its
    launches take a while, and its report is refreshed only when the router asks (after a
    stop), as a real device report lags behind the starts."""

    most = 0

    async def launch(
        self,
        instance_id: str,
        spec: dict[str, Any],
        model: dict[str, Any],
        device_id: str,
        deadline: float,
        on_target: OnTarget | None = None,
    ) -> Started:
        await asyncio.sleep(0.05)
        started = await super().launch(instance_id, spec, model, device_id, deadline)
        self.most = max(self.most, len(self.running))
        return started

    async def report(self) -> dict[str, dict[str, Any]]:
        record = (await super().report())[DEVICE]
        record["instances"] = len(self.running)
        self.state.report_device(DEVICE, record)
        return {DEVICE: record}


def test_concurrent_cold_starts_keep_the_instances_per_device_limit(state: ClusterState) -> None:
    # Two functions asked at once on a device that may run one instance: the device report
    # says 0 instances to both placements (it lags behind the starts), yet only one starts;
    # the other waits for it to go idle and be stopped.
    deploy(state, "f", 10)
    deploy(state, "g", 10)
    launcher = CountingLauncher(state, capacity=100)

    async def scenario() -> None:
        router = Router(state, launcher, RouterConfig(instances_per_device=1))
        await launcher.report()
        first = asyncio.create_task(router.route("f", state.function("f"), time.time() + 10))
        second = asyncio.create_task(router.route("g", state.function("g"), time.time() + 10))
        done, _ = await asyncio.wait({first, second}, return_when=asyncio.FIRST_COMPLETED)
        winner = done.pop()
        name = "f" if winner is first else "g"
        await asyncio.sleep(0.3)
        assert launcher.most == 1, f"{launcher.most} instances on a device that may run one"
        await router.done(name, winner.result(), 60.0, 0.01, reusable=False)  # idle: it may be stopped
        route = await asyncio.wait_for(second if winner is first else first, 10)
        assert route.cold and len(launcher.running) == 1 and launcher.most == 1
        await router.close()

    asyncio.run(scenario())
