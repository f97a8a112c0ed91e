"""A multi-node cluster simulated on one machine, placed by the real scheduler extender.

No kube-apiserver or container runtime here, so the pieces Kubernetes would run are played by
processes, each of them real:

* a **node** is a directory (its ``/var/run/ember``) with its own pool daemon (``gpu_pool``'s
  :class:`PoolProcess`, a small CPU arena) on ``cpu.sock`` in it, in the node's own network
  namespace (``unshare --net``) where the kernel permits it (:func:`netns_available`);
* a **node reporter** per node publishes the pool's stats as the node's device report
  (``<node>/cpu`` in Redis, :func:`device_report`) every ``report_interval_s``, and at once
  after a start or a stop; when the pool is gone it publishes nothing, so the report ages;
* one real **Redis** (``redis-server``) holds the reports;
* the **extender** is ``ember extender`` in its own process (real HTTP);
* :class:`KubeScheduler` plays kube-scheduler's extender calls: for a real ``v1.Pod`` document
  carrying what a rendered revision carries (:func:`pod_manifest`), ``filter`` then
  ``prioritize`` over every node (``nodeCacheCapable: true``), and binds to the top score
  (random among ties) — or, as the baseline, to a random node that passed the filter
  (kube-scheduler's default spreading, which knows nothing of residency);
* a **function pod starting** on a node is a :class:`gpu_pool.client.PoolClient` session on
  that node's pool acquiring the function's model manifest (what the worker does at start);
  the bytes the pool loaded for it are the start's cost. Scaling to zero releases and closes it.

Models are registered through the normal registry (:func:`runtime.registry.register`).
A node's network namespace has only its own loopback: its pool is reached through the socket
directory alone (a path-named Unix socket crosses network namespaces, as the hostPath mount
does between a node's pods), which is all a pool and its workers share on a real node. The
reporters, Redis (a Unix socket) and the extender (TCP on the host's loopback) stay in the
harness's namespace: on a cluster they talk over the cluster network instead.
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from gateway.spawn import ExtenderProcess
from gpu_pool.client import PoolClient
from gpu_pool.manifest import Manifest
from gpu_pool.spawn import PoolProcess
from scheduler import cluster_keys
from scheduler.redis_server import EmbeddedRedis
from scheduler.state import ClusterState

log = logging.getLogger("ember.bench.cluster_sim")


@dataclass(frozen=True)
class SimFunction:
    """A deployed function: its qualified id, its registered model and the model's manifest."""

    name: str
    namespace: str
    model_id: str
    manifest: Manifest = field(repr=False)

    @property
    def function_id(self) -> str:
        return self.name if self.namespace == "default" else f"{self.namespace}/{self.name}"

    @property
    def weight_bytes(self) -> int:
        return int(self.manifest.nbytes)


def device_report(node: str, stats: Mapping[str, Any]) -> dict[str, Any]:
    """The device record ``ember node`` publishes for a CPU pool from its ``stats``."""
    from runtime.device_report import device_record

    return device_record(node, "cpu", dict(stats), {})


def pod_manifest(fn: SimFunction, serial: int) -> dict[str, Any]:
    """The ``v1.Pod`` Knative creates for ``fn``'s revision, as kube-scheduler sends it."""
    revision = f"{fn.name}-00001"
    suffix = f"{serial:05x}"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{revision}-deployment-7c9d8b6f5-{suffix}",
            "generateName": f"{revision}-deployment-7c9d8b6f5-",
            "namespace": "ember-fn",
            "uid": f"00000000-0000-4000-8000-{serial:012d}",
            "labels": {
                cluster_keys.LABEL_FUNCTION: fn.name,
                cluster_keys.LABEL_NAMESPACE: fn.namespace,
                "app": revision,
                "serving.knative.dev/service": fn.name,
                "serving.knative.dev/configuration": fn.name,
                "serving.knative.dev/revision": revision,
                "pod-template-hash": "7c9d8b6f5",
            },
            "annotations": {
                cluster_keys.ANNOTATION_FUNCTION_ID: fn.function_id,
                cluster_keys.ANNOTATION_MODEL: fn.model_id,
                cluster_keys.ANNOTATION_WEIGHT_BYTES: str(fn.weight_bytes),
                "autoscaling.knative.dev/class": "kpa.autoscaling.knative.dev",
                "autoscaling.knative.dev/metric": "concurrency",
                "autoscaling.knative.dev/min-scale": "0",
                "autoscaling.knative.dev/window": "10s",
            },
            "ownerReferences": [
                {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": f"{revision}-deployment-7c9d8b6f5"}
            ],
        },
        "spec": {
            "schedulerName": "ember-scheduler",
            "containers": [
                {
                    "name": "worker",
                    "image": "ember:0.1.0",
                    "args": ["worker", "--function", fn.function_id],
                    "ports": [{"name": "http1", "containerPort": 8080}],
                    "env": [{"name": cluster_keys.POOL_DIR_ENV, "value": cluster_keys.DEFAULT_POOL_DIR}],
                    "readinessProbe": {"httpGet": {"path": "/readyz", "port": 8080}, "periodSeconds": 1},
                    "volumeMounts": [
                        {"name": "ember-run", "mountPath": cluster_keys.DEFAULT_POOL_DIR, "readOnly": True}
                    ],
                },
                {"name": "queue-proxy", "image": "gcr.io/knative-releases/knative.dev/serving/cmd/queue"},
            ],
            "volumes": [
                {
                    "name": "ember-run",
                    "hostPath": {"path": cluster_keys.DEFAULT_POOL_DIR, "type": "Directory"},
                }
            ],
        },
        "status": {"phase": "Pending"},
    }


def netns_available() -> bool:
    """Whether this process may create network namespaces (``unshare --net``)."""
    try:
        probe = subprocess.run(["unshare", "--net", "true"], check=False, capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


class SimNode:
    """A node: its pool directory and the pool daemon in it (in its own network namespace
    when ``netns``)."""

    def __init__(
        self, name: str, root: Path, arena: str | int, store_roots: Sequence[Path], netns: bool = False
    ) -> None:
        self.name = name
        self.netns = netns
        self.pool_dir = root / name / "var-run-ember"
        self.pool_dir.mkdir(parents=True)
        self.pool = PoolProcess(
            str(self.pool_dir / cluster_keys.CPU_SOCKET),
            arena,
            env={"EMBER_POOL_PREFAULT": "false"},
            log_path=str(root / name / "pool.log"),
            store_roots=store_roots,
            launcher=("unshare", "--net", "--") if netns else (),
        )

    def net_namespace(self) -> str:
        """The pool daemon's network namespace (``net:[inode]``)."""
        return os.readlink(f"/proc/{self.pool.proc.pid}/ns/net")

    @property
    def socket_path(self) -> str:
        return self.pool.socket_path

    def kill(self) -> None:
        """The pool daemon dies (SIGKILL: no goodbye)."""
        self.pool.proc.kill()
        self.pool.proc.wait()


class NodeReporter:
    """Publishes a node's pool stats as its device report, periodically and on demand."""

    def __init__(self, node: SimNode, state: ClusterState, interval_s: float) -> None:
        self.node = node
        self.state = state
        self.interval_s = interval_s
        self.failures = 0  # reads of a pool that did not answer
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"reporter-{node.name}", daemon=True)

    def start(self) -> None:
        self.publish()
        self._thread.start()

    def publish(self) -> bool:
        """Read the pool's stats and publish them; False (nothing published) if it is down."""
        with self._lock:
            try:
                with PoolClient(self.node.socket_path, timeout=5.0) as client:
                    stats = client.stats()
            except (ConnectionError, OSError) as exc:
                self.failures += 1
                log.info("pool of %s does not answer: %s", self.node.name, exc)
                return False
            self.state.report_device(
                cluster_keys.device_id(self.node.name), device_report(self.node.name, stats)
            )
            return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.publish()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)


@dataclass(frozen=True)
class Binding:
    """Where kube-scheduler bound a pod, and what the extender said."""

    node: str | None  # None: no node passed the filter (the pod stays Pending)
    passed: tuple[str, ...]
    failed: Mapping[str, str]  # FailedNodes and FailedAndUnresolvableNodes together
    scores: Mapping[str, int]  # empty for the spreading baseline


class KubeScheduler:
    """kube-scheduler's extender calls: filter, then prioritize (or a random pick), then bind."""

    def __init__(self, extender_url: str, nodes: Sequence[str], rng: random.Random, policy: str) -> None:
        if policy not in ("extender", "spread"):
            raise ValueError("policy is 'extender' or 'spread'")
        self.nodes = list(nodes)
        self.rng = rng
        self.policy = policy
        self.http = httpx.Client(base_url=extender_url, timeout=10)

    def schedule(self, pod: Mapping[str, Any]) -> Binding:
        filtered = self._call("filter", {"Pod": pod, "NodeNames": self.nodes})
        if filtered.get("Error"):
            raise RuntimeError(f"extender filter failed: {filtered['Error']}")
        passed = tuple(filtered["NodeNames"] or ())
        failed = {**(filtered.get("FailedNodes") or {}), **(filtered.get("FailedAndUnresolvableNodes") or {})}
        if not passed:
            return Binding(None, passed, failed, {})
        if self.policy == "spread":
            return Binding(self.rng.choice(passed), passed, failed, {})
        priorities = self._call("prioritize", {"Pod": pod, "NodeNames": list(passed)})
        scores = {p["Host"]: int(p["Score"]) for p in priorities}
        top = max(scores.values())
        return Binding(self.rng.choice([n for n in passed if scores[n] == top]), passed, failed, scores)

    def _call(self, verb: str, args: Mapping[str, Any]) -> Any:
        response = self.http.post(f"/{verb}", content=json.dumps(args).encode())
        response.raise_for_status()
        return response.json()

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> KubeScheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Instance:
    """A function pod running on a node: its pool session holds the model's tensors pinned."""

    function: SimFunction
    node: str
    pod: str
    client: PoolClient = field(repr=False)
    bytes_loaded: int
    bytes_reused: int


class Cluster:
    """Redis, ``nodes`` nodes with their pools and reporters, and the extender; :meth:`close`."""

    def __init__(
        self,
        root: Path,
        store_roots: Sequence[Path],
        nodes: int = 3,
        arena: str | int = "1MiB",
        report_interval_s: float = 0.2,
        report_ttl_s: float = 1.0,
        netns: bool | None = None,
    ) -> None:
        """``netns``: each node's pool in its own network namespace (None: where permitted)."""
        self.root = root
        self.netns = netns_available() if netns is None else netns
        self.redis: EmbeddedRedis | None = None
        self.state: ClusterState | None = None
        self.nodes: dict[str, SimNode] = {}
        self.reporters: dict[str, NodeReporter] = {}
        self.extender: ExtenderProcess | None = None
        try:
            self.redis = EmbeddedRedis(root / "redis")
            self.redis.start()
            self.state = ClusterState.from_url(self.redis.url)
            for i in range(nodes):
                name = f"node-{i}"
                self.nodes[name] = SimNode(name, root, arena, store_roots, self.netns)
                self.reporters[name] = NodeReporter(self.nodes[name], self.state, report_interval_s)
                self.reporters[name].start()
            # The reporters publish after every start and stop, so the extender reads Redis on
            # every call (no cache) and sees each placement's effect on the next.
            env = {"EMBER_EXTENDER_REPORT_TTL": str(report_ttl_s), "EMBER_EXTENDER_CACHE": "0"}
            self.extender = ExtenderProcess(self.redis.url, root / "extender.log", env=env)
        except BaseException:
            self.close()
            raise
        self._serial = 0

    @property
    def url(self) -> str:
        assert self.extender is not None
        return self.extender.url

    def scheduler(self, rng: random.Random, policy: str = "extender") -> KubeScheduler:
        return KubeScheduler(self.url, list(self.nodes), rng, policy)

    def start(self, fn: SimFunction, scheduler: KubeScheduler) -> tuple[Instance | None, Binding]:
        """Schedule a pod of ``fn`` and start it where it is bound. None: it stays Pending (no
        node passed the filter, ``binding.node`` is None) or failed to attach to its node's
        pool (which died since its last report)."""
        self._serial += 1
        pod = pod_manifest(fn, self._serial)
        binding = scheduler.schedule(pod)
        if binding.node is None:
            return None, binding
        try:
            client = PoolClient(self.nodes[binding.node].socket_path)
        except ConnectionError as exc:  # its pool died after its last report: the pod fails
            log.info("pod %s cannot attach on %s: %s", pod["metadata"]["name"], binding.node, exc)
            return None, binding
        try:
            client.acquire(fn.manifest)
        except BaseException:
            client.close()
            raise
        report = client.last_acquire
        assert report is not None
        self.reporters[binding.node].publish()
        name = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
        return Instance(fn, binding.node, name, client, report.bytes_loaded, report.bytes_reused), binding

    def stop(self, instance: Instance) -> None:
        """Scale to zero: release the tensors (they stay resident) and end the session."""
        try:
            instance.client.release()
        except (ConnectionError, OSError):
            pass  # its pool died: nothing is held any more
        finally:
            instance.client.close()
        self.reporters[instance.node].publish()

    def close(self) -> None:
        for reporter in self.reporters.values():
            reporter.stop()
        if self.extender is not None:
            self.extender.stop()
        for node in self.nodes.values():
            node.pool.stop()
        if self.state is not None:
            self.state.close()
        if self.redis is not None:
            self.redis.stop()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def zipf_trace(functions: int, requests: int, s: float, rng: random.Random) -> list[int]:
    """``requests`` function indices drawn from a Zipf(``s``) popularity over a random ranking."""
    ranking = list(range(functions))
    rng.shuffle(ranking)
    weights = [1.0 / (rank + 1) ** s for rank in range(functions)]
    return [ranking[i] for i in rng.choices(range(functions), weights=weights, k=requests)]


@dataclass
class ReplayResult:
    """What serving a trace cost: bytes the pools loaded for starts, and the starts."""

    policy: str
    requests: int
    starts: int = 0
    starts_loading_nothing: int = 0
    bytes_loaded: int = 0
    bytes_reused: int = 0
    pending: int = 0  # pods no node could take (every pool full of pinned tensors)
    failed_starts: int = 0  # pods bound to a node whose pool had died
    per_node_starts: dict[str, int] = field(default_factory=dict)

    def encode(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "starts": self.starts,
            "starts_loading_nothing": self.starts_loading_nothing,
            "bytes_loaded": self.bytes_loaded,
            "bytes_reused": self.bytes_reused,
            "pending": self.pending,
            "failed_starts": self.failed_starts,
            "per_node_starts": dict(sorted(self.per_node_starts.items())),
        }


def replay(
    cluster: Cluster,
    functions: Sequence[SimFunction],
    trace: Sequence[int],
    policy: str,
    keep_alive: int,
    seed: int,
) -> ReplayResult:
    """Serve ``trace`` (one request per tick): a function without a live instance scales from
    zero (a pod is scheduled and started); one idle for more than ``keep_alive`` ticks scales
    to zero (released)."""
    result = ReplayResult(policy, len(trace))
    live: dict[int, Instance] = {}
    last: dict[int, int] = {}
    with cluster.scheduler(random.Random(seed), policy) as scheduler:
        for tick, f in enumerate(trace):
            for g in [g for g, _ in live.items() if tick - last[g] > keep_alive]:
                cluster.stop(live.pop(g))
            last[f] = tick
            if f in live:
                continue
            instance, binding = cluster.start(functions[f], scheduler)
            if instance is None:
                result.pending += binding.node is None
                result.failed_starts += binding.node is not None
                continue
            live[f] = instance
            result.starts += 1
            result.bytes_loaded += instance.bytes_loaded
            result.bytes_reused += instance.bytes_reused
            result.starts_loading_nothing += instance.bytes_loaded == 0
            result.per_node_starts[instance.node] = result.per_node_starts.get(instance.node, 0) + 1
        for instance in live.values():
            cluster.stop(instance)
    return result
