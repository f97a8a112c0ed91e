"""Cluster state against a real redis-server: atomic scaling, routing, keep-alive, restarts."""

from __future__ import annotations

import threading
import time

import pytest

from scheduler.errors import FunctionNotFound, StateConflict
from scheduler.redis_server import EmbeddedRedis
from scheduler.state import ClusterState, LiveCount, Slot


@pytest.fixture
def server(redis_server: EmbeddedRedis) -> EmbeddedRedis:
    return redis_server


def test_functions_crud_and_survive_a_restart(server: EmbeddedRedis, state: ClusterState) -> None:
    state.put_function("f", {"metadata": {"name": "f"}})
    assert state.get_function("f") == {"metadata": {"name": "f"}}
    assert list(state.list_functions()) == ["f"]
    server.restart()
    assert state.get_function("f") == {"metadata": {"name": "f"}}  # append-only file, retried connection
    state.delete_function("f")
    with pytest.raises(FunctionNotFound):
        state.get_function("f")
    with pytest.raises(FunctionNotFound):
        state.delete_function("f")


def test_concurrent_scale_up_never_double_starts(server: EmbeddedRedis) -> None:
    started: list[str | None] = []
    barrier = threading.Barrier(16)

    def gateway() -> None:
        s = ClusterState.from_url(server.url)  # each gateway its own connection
        barrier.wait()
        started.append(s.scale_up("f", desired=3, device="n/cpu"))
        s.close()

    threads = [threading.Thread(target=gateway) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len([s for s in started if s]) == 3
    check = ClusterState.from_url(server.url)
    assert len(check.instances("f")) == 3
    check.close()


def test_slots_spread_by_default_and_pack_when_asked(state: ClusterState) -> None:
    """Spread: the least busy ready instance. Pack (LLM-Mesh's bin-packing): the busiest one
    that still has a free slot, so its batch grows and the others can idle out."""
    a = state.scale_up("f", 2, "n/cpu", now=0.0)
    b = state.scale_up("f", 2, "n/cpu", now=0.0)
    assert a and b
    state.transition(a, "starting", "ready", url="http://a", deadline=10.0)
    state.transition(b, "starting", "ready", url="http://b", deadline=10.0)
    first = state.acquire_slot("f", 3, pack=True)
    assert first is not None
    busy = first.instance_id
    idle = b if busy == a else a
    assert state.acquire_slot("f", 3, pack=True).instance_id == busy  # type: ignore[union-attr]
    assert state.acquire_slot("f", 3).instance_id == idle  # type: ignore[union-attr]  # spread
    assert state.acquire_slot("f", 3, pack=True).instance_id == busy  # type: ignore[union-attr]
    assert state.acquire_slot("f", 3, pack=True).instance_id == idle  # type: ignore[union-attr]  # busy is full


def test_a_routing_miss_counts_the_live_instances_a_scale_up_decides_on(state: ClusterState) -> None:
    """On a miss the routing script answers what the router's scale-up would read next (the
    records, two round trips more on a cold start's path): ready and starting instances and
    their requests in flight; draining ones and pruned records do not count."""
    assert state.acquire_or_count("f", 1) == LiveCount(0, 0, 0)  # scale from zero
    ids = [state.scale_up("f", 5, "n/cpu", now=0.0) for _ in range(4)]
    assert all(ids)
    first, second, draining, starting = (str(i) for i in ids)
    for i in (first, second, draining):
        state.transition(i, "starting", "ready", url=f"http://{i}", deadline=10.0)
    assert state.claim_starting(starting, 2) is True  # a request held for its activation
    assert isinstance(state.acquire_or_count("f", 1), Slot)  # each ready one takes one: full
    assert isinstance(state.acquire_or_count("f", 1), Slot)
    assert isinstance(state.acquire_or_count("f", 1), Slot)
    state.release(draining, 10.0)
    state.transition(draining, "ready", "draining")
    miss = state.acquire_or_count("f", 1)
    assert miss == LiveCount(num_ready=2, num_starting=1, in_flight=3)
    live = [i for i in state.instances("f") if i.state in ("starting", "ready")]
    assert miss.in_flight == sum(i.in_flight for i in live)
    assert miss.num_ready + miss.num_starting == len(live)
    assert state.acquire_slot("f", 1) is None  # the same miss, as before


@pytest.mark.parametrize("pack", [False, True])
def test_routing_skips_a_record_that_expired_before_its_id_is_pruned(state: ClusterState, pack: bool) -> None:
    """A pod's record expires (a TTL) and its id stays in the function's set until someone
    prunes it: routing passes over it, wherever it comes in the set's order."""
    ids = [str(state.scale_up("f", 9, "n/cpu", now=0.0)) for _ in range(6)]
    for i in ids[::2]:
        state.transition(i, "starting", "ready", url=f"http://{i}", deadline=10.0)
    for i in ids[1::2]:
        state.r.delete(f"{state.p}instance:{i}")  # expired
    routed = [state.acquire_or_count("f", 1, pack=pack) for _ in range(4)]
    assert sorted(r.instance_id for r in routed[:3] if isinstance(r, Slot)) == sorted(ids[::2])
    assert routed[3] == LiveCount(num_ready=3, num_starting=0, in_flight=3)


def test_routing_keepalive_and_scale_to_zero(state: ClusterState) -> None:
    a = state.scale_up("f", 2, "n/cpu", now=0.0)
    b = state.scale_up("f", 2, "n/cpu", now=0.0)
    assert a and b and state.scale_up("f", 2, "n/cpu") is None
    assert state.acquire("f", concurrency=1) is None  # nothing ready yet
    with pytest.raises(ValueError, match="deadline"):
        state.transition(a, "starting", "ready", url="http://a")
    state.transition(a, "starting", "ready", url="http://a", deadline=10.0)
    assert state.expire("f", min_scale=0, now=5.0) == []  # ready but not idle past its keep-alive yet
    with pytest.raises(StateConflict):
        state.transition(a, "starting", "ready", deadline=10.0)
    state.transition(b, "starting", "ready", url="http://b", deadline=10.0)
    first, second = state.acquire("f", 1), state.acquire("f", 1)
    assert {first, second} == {(a, "http://a"), (b, "http://b")}
    assert state.acquire("f", 1) is None  # both at their concurrency
    assert state.release(a, keep_alive_s=10, now=100.0) == 0
    assert state.release(b, keep_alive_s=10, now=105.0) == 0
    assert state.expire("f", min_scale=0, now=109.0) == []
    drained = state.expire("f", min_scale=1, now=200.0)  # both idle past deadline; one must stay
    assert len(drained) == 1 and drained[0] in {a, b}
    assert sorted(i.state for i in state.instances("f")) == ["draining", "ready"]
    assert state.acquire("f", 1) is not None  # the survivor still serves
    state.release(next(x for x in (a, b) if x not in drained), keep_alive_s=10, now=250.0)
    last = state.expire("f", min_scale=0, now=300.0)
    assert sorted(drained + last) == sorted([a, b])  # scale to zero
    for i in (a, b):
        state.transition(i, "draining", "gone")
        state.forget_instance("f", i)
    assert state.instances("f") == []
    assert state.release(a, keep_alive_s=10) == -1  # a late release does not resurrect it
    assert state.instances("f") == [] and not state.r.exists(f"{state.p}instance:{a}")


def test_device_reports(state: ClusterState) -> None:
    state.report_device("n/cpu", {"capacity_bytes": 10, "models": {"m": {"resident_bytes": 4}}})
    assert state.devices()["n/cpu"]["models"]["m"]["resident_bytes"] == 4


def read_calls(state: ClusterState) -> dict[str, int]:
    """How often the server ran SCAN, GET and MGET so far."""
    stats = state.r.info("commandstats")
    return {c: int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("scan", "get", "mget")}


def test_device_reports_of_many_devices_take_two_round_trips(state: ClusterState) -> None:
    """The scheduler extender reads every report per placement: one SCAN page, one MGET."""
    for i in range(250):
        state.report_device(f"node-{i:03d}/cpu", {"free_bytes": i, "models": {"m": i}})

    before = read_calls(state)
    reports = state.device_reports()
    after = read_calls(state)
    assert list(reports) == [f"node-{i:03d}/cpu" for i in range(250)]
    assert [r.free_bytes for r in reports.values()] == list(range(250))
    assert {c: after[c] - before[c] for c in after} == {"scan": 1, "get": 0, "mget": 1}


def test_expire_drains_only_the_callers_devices(state: ClusterState) -> None:
    a = state.scale_up("f", 2, "node-a/cpu", now=0.0)
    b = state.scale_up("f", 2, "node-b/cpu", now=0.0)
    assert a and b
    for i in (a, b):
        state.transition(i, "starting", "ready", url=f"http://{i}", deadline=1.0)
    assert state.expire("f", min_scale=0, now=5.0, devices=["node-a/cpu"]) == [a]  # b is node-b's to stop
    assert {i.instance_id: i.state for i in state.instances("f")} == {a: "draining", b: "ready"}
    assert state.expire("f", min_scale=0, now=5.0) == [b]  # no device filter: any device


def test_forget_from_drops_the_record_whether_or_not_it_is_still_in_that_state(state: ClusterState) -> None:
    a = state.scale_up("f", 2, "n/cpu")
    b = state.scale_up("f", 2, "n/cpu")
    assert a and b
    state.transition(b, "starting", "ready", url="http://b", deadline=10.0)
    state.forget_from("f", a, "starting")  # the usual case: a failed start
    state.forget_from("f", b, "starting")  # lost a race (b is ready): forgotten all the same
    assert state.instances("f") == [] and not state.r.exists(f"{state.p}instance:{b}")


def test_an_expiring_record_goes_unless_refreshed_and_readers_tolerate_it(state: ClusterState) -> None:
    """Issue 11: a Knative pod's record expires unless its heartbeat renews it; a record that
    expired between SMEMBERS and HGETALL is skipped, and its id leaves the function's set."""
    kept = state.add_instance("f", "n/cpu", ttl_s=0.3)
    lost = state.add_instance("f", "n/cpu", ttl_s=0.3)
    plain = state.add_instance("f", "n/cpu")  # an instance Ember's router runs: no TTL
    assert 0 < state.r.pttl(f"{state.p}instance:{kept}") <= 300
    assert state.r.pttl(f"{state.p}instance:{plain}") == -1
    fields = dict(state.r.hgetall(f"{state.p}instance:{kept}"))
    for _ in range(4):  # 0.6 s: past the TTL, renewed every 0.15 s
        time.sleep(0.15)
        assert state.refresh_instance("f", kept, 0.3, fields)
    assert [i.instance_id for i in state.instances("f")] == [kept, plain]
    assert state.r.smembers(f"{state.p}fn:f:instances") == {kept, plain}  # the expired id pruned
    state.transition(kept, "starting", "ready", url="http://kept", deadline=1.0)  # keeps the TTL
    assert state.r.pttl(f"{state.p}instance:{kept}") > 0
    assert lost not in state.r.smembers(f"{state.p}fn:f:instances")
    # A record that expired while its pod could not reach Redis: the next refresh writes it again.
    state.r.delete(f"{state.p}instance:{kept}")
    state.r.srem(f"{state.p}fn:f:instances", kept)
    assert not state.refresh_instance("f", kept, 0.3, fields)
    assert [(i.instance_id, i.state) for i in state.instances("f")] == [
        (kept, "starting"),
        (plain, "starting"),
    ]
    assert 0 < state.r.pttl(f"{state.p}instance:{kept}") <= 300
    with pytest.raises(ValueError, match="TTL"):
        state.add_instance("f", "n/cpu", ttl_s=0.0)


def test_many_instances_come_back_in_order_and_expired_ones_are_pruned(state: ClusterState) -> None:
    """The records come in one pipeline (the router reads them on its event loop)."""
    ids = [state.add_instance("f", "n/cpu") for _ in range(40)]
    gone = state.add_instance("f", "n/cpu", ttl_s=0.05)  # a pod killed outright: its record expires
    time.sleep(0.2)
    listed = state.instances("f", retry=False)
    assert [i.instance_id for i in listed] == ids and all(i.state == "starting" for i in listed)
    assert gone not in state.r.smembers(f"{state.p}fn:f:instances")  # pruned on the way


def test_device_reports_of_named_devices_take_one_round_trip(state: ClusterState) -> None:
    """A cold start places on its own node's devices: one MGET of their keys, no SCAN."""
    for i in range(20):
        state.report_device(f"node-{i:03d}/cpu", {"free_bytes": i, "models": {"m": i}})

    before = read_calls(state)
    reports = state.device_reports(device_ids=["node-007/cpu", "node-003/cpu", "gone/cpu"])
    after = read_calls(state)
    assert {d: r.free_bytes for d, r in reports.items()} == {"node-003/cpu": 3, "node-007/cpu": 7}
    assert list(reports) == ["node-003/cpu", "node-007/cpu"]  # sorted; never reported: absent
    assert {c: after[c] - before[c] for c in after} == {"scan": 0, "get": 0, "mget": 1}
