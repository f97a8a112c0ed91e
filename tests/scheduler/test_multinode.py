"""The multi-node simulation (bench.cluster_sim): 3 nodes, each its own pool daemon, socket
directory and (where permitted) network namespace, one Redis, ``ember extender`` over HTTP, and
a harness playing kube-scheduler with real ``v1.Pod`` documents. No cluster runs here:
Kubernetes' part is the harness."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.cluster_sim import Cluster, SimFunction
from bench.multinode import tiny_functions

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def functions(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[SimFunction], Path]:
    """Three functions, each with its own tiny model registered through the registry."""
    return tiny_functions(tmp_path_factory.mktemp("models"), 3)


@pytest.fixture
def cluster(functions: tuple[list[SimFunction], Path], tmp_path: Path) -> Iterator[Cluster]:
    with Cluster(tmp_path, (functions[1],), nodes=3, arena="1536KiB", report_ttl_s=1.0) as c:
        yield c


def decisions_for(cluster: Cluster, pod: str) -> dict[str, dict[str, Any]]:
    """The extender's logged decisions about ``pod``, by event."""
    assert cluster.extender is not None
    return {d["event"]: d for d in cluster.extender.decisions() if d["pod"] == pod}


def test_a_function_goes_back_to_the_node_holding_its_tensors(
    cluster: Cluster, functions: tuple[list[SimFunction], Path]
) -> None:
    homes: dict[str, str] = {}
    with cluster.scheduler(random.Random(7)) as scheduler:
        for fn in functions[0]:
            instance, binding = cluster.start(fn, scheduler)
            assert instance is not None and binding.passed == ("node-0", "node-1", "node-2")
            assert instance.bytes_loaded == fn.weight_bytes  # cold: nobody holds it
            cluster.stop(instance)  # scales to zero: the tensors stay in that node's pool
            homes[fn.name] = instance.node
        for _ in range(2):
            for fn in functions[0]:
                instance, binding = cluster.start(fn, scheduler)
                assert instance is not None
                assert instance.node == homes[fn.name], binding
                assert instance.bytes_loaded == 0 and instance.bytes_reused == fn.weight_bytes
                assert binding.scores[instance.node] == 10
                assert all(s < 10 for n, s in binding.scores.items() if n != instance.node)
                logged = decisions_for(cluster, instance.pod)
                assert set(logged) == {"extender.filter", "extender.prioritize"}
                assert logged["extender.prioritize"]["best"] == instance.node
                assert logged["extender.prioritize"]["model"] == fn.model_id
                assert logged["extender.filter"]["function"] == fn.function_id
                cluster.stop(instance)


def test_a_node_whose_pool_died_is_filtered_out(
    cluster: Cluster, functions: tuple[list[SimFunction], Path]
) -> None:
    fn = functions[0][0]
    with cluster.scheduler(random.Random(3)) as scheduler:
        instance, _ = cluster.start(fn, scheduler)
        assert instance is not None
        cluster.stop(instance)
        home = instance.node
        cluster.nodes[home].kill()
        time.sleep(1.5)  # its last report ages past the TTL (1 s): the pool is down
        instance, binding = cluster.start(fn, scheduler)
        assert instance is not None and instance.node != home
        assert home not in binding.passed and "pool down" in binding.failed[home]
        assert instance.bytes_loaded == fn.weight_bytes  # its tensors died with the pool
        logged = decisions_for(cluster, instance.pod)
        assert "pool down" in logged["extender.filter"]["nodes"][home]["failed"]
        assert cluster.reporters[home].failures > 0
        cluster.stop(instance)


def test_each_node_pool_runs_in_its_own_network_namespace(cluster: Cluster) -> None:
    """The pools share nothing with each other or the harness but their socket directories."""
    if not cluster.netns:
        pytest.skip("unshare --net is refused here: the nodes share the host's network")
    namespaces = {node.net_namespace() for node in cluster.nodes.values()}
    assert len(namespaces) == 3 and os.readlink("/proc/self/ns/net") not in namespaces
