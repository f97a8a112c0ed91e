"""The functions-per-namespace cap, enforced atomically by the state store (issue 10)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

import pytest

from scheduler.errors import FunctionQuotaExceeded, WarmQuotaExceeded
from scheduler.redis_server import EmbeddedRedis
from scheduler.state import ClusterState


def spec(function_id: str) -> dict[str, object]:
    namespace, _, name = function_id.rpartition("/")
    return {"metadata": {"name": name, "namespace": namespace or "default"}}


def test_a_full_namespace_refuses_new_functions_only(state: ClusterState) -> None:
    for function_id in ("a", "b", "team/a", "team/b", "team-x/a"):
        state.put_function(function_id, spec(function_id), max_in_namespace=2)
    with pytest.raises(FunctionQuotaExceeded, match="namespace 'default' holds 2 functions, its limit is 2"):
        state.put_function("c", spec("c"), max_in_namespace=2)
    with pytest.raises(FunctionQuotaExceeded, match="namespace 'team' holds 2"):
        state.put_function("team/c", spec("team/c"), max_in_namespace=2)
    with pytest.raises(FunctionQuotaExceeded, match="namespace 'team'"):
        state.check_room("team/c", 2)  # the early check agrees, and stores nothing
    state.check_room("team/a", 2)  # a redeploy always has room
    updated = {**spec("a"), "v": 2}
    state.put_function("a", updated, max_in_namespace=2)  # a redeploy does not count twice
    assert state.get_function("a") == updated
    state.put_function("team-x/b", spec("team-x/b"), max_in_namespace=2)  # "team-x" is not "team"
    assert sorted(state.list_functions()) == ["a", "b", "team-x/a", "team-x/b", "team/a", "team/b"]
    state.delete_function("b")  # room again
    state.put_function("c", spec("c"), max_in_namespace=2)
    assert FunctionQuotaExceeded.code == "function_quota_exceeded"


def deploy_concurrently(
    url: str, deploy: Callable[[ClusterState, int, threading.Barrier], None]
) -> list[bool]:
    """16 gateways, each on its own connection, run ``deploy(state, i, barrier)`` at once (it
    waits at the barrier between its early check and its store); which ones got their
    function stored (False: refused by a quota)."""
    barrier = threading.Barrier(16)
    outcomes: list[bool] = []

    def gateway(i: int) -> None:
        s = ClusterState.from_url(url)
        try:
            deploy(s, i, barrier)
            outcomes.append(True)
        except FunctionQuotaExceeded:
            outcomes.append(False)
        finally:
            s.close()

    threads = [threading.Thread(target=gateway, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return sorted(outcomes)


def test_concurrent_deploys_never_exceed_the_cap(redis_server: EmbeddedRedis) -> None:
    """16 gateways deploy 16 new functions into one namespace with room for 5 at once."""

    def deploy(s: ClusterState, i: int, barrier: threading.Barrier) -> None:
        s.check_room(f"team/f{i}", 5)  # every early check passes: the namespace is empty
        barrier.wait()
        s.put_function(f"team/f{i}", spec(f"team/f{i}"), max_in_namespace=5)

    assert deploy_concurrently(redis_server.url, deploy) == [False] * 11 + [True] * 5
    check = ClusterState.from_url(redis_server.url)
    try:
        assert len(check.list_functions()) == 5
    finally:
        check.close()


def test_concurrent_deploys_never_exceed_the_min_scale_sum(redis_server: EmbeddedRedis) -> None:
    """16 gateways deploy 16 functions of minScale 2 into one namespace whose sum may reach 10."""

    def deploy(s: ClusterState, i: int, barrier: threading.Barrier) -> None:
        document = {**spec(f"team/f{i}"), "spec": {"scaling": {"minScale": 2, "maxScale": 2}}}
        s.check_room(f"team/f{i}", 100, document, 10)  # every early check passes
        barrier.wait()
        s.put_function(f"team/f{i}", document, max_in_namespace=100, max_min_scale=10)  # 100: never the cap

    assert deploy_concurrently(redis_server.url, deploy) == [False] * 11 + [True] * 5
    assert issubclass(WarmQuotaExceeded, FunctionQuotaExceeded)  # a 409, like the function cap


def test_functions_stored_before_the_min_scale_index_count_too(state: ClusterState) -> None:
    """Records written by an older Ember (no minScale index entry) count with their minScale."""
    legacy = {
        "metadata": {"name": "old", "namespace": "team"},
        "spec": {"scaling": {"minScale": 3, "maxScale": 3}},
    }
    state.r.hset(
        "ember:functions", "team/old", json.dumps({"v": 1, "spec": legacy, "model": None, "updated": 0})
    )
    state.r.hset("ember:functions", "team/broken", "not json")  # unreadable: counts as 0
    document = {**spec("team/new"), "spec": {"scaling": {"minScale": 2, "maxScale": 2}}}
    with pytest.raises(WarmQuotaExceeded, match="keeps 3 instances up by minScale, its limit is 4"):
        state.put_function("team/new", document, max_min_scale=4)
    assert state.r.hget("ember:function_min_scale", "team/old") == "3"  # indexed once, from the record
    state.delete_function("team/old")
    state.put_function("team/new", document, max_min_scale=4)
