"""Extender latency: prioritize (and filter) over 100 nodes through the real HTTP service.

A real redis-server holds 100 device reports (``node-NNN/cpu``, each with a few of 20 models
partly resident); ``ember extender`` runs as its own process over it (uvicorn, decision log
on, written to a file) and is called as kube-scheduler calls it: one keep-alive HTTP
connection, ``ExtenderArgs`` with a ``v1.Pod`` carrying Ember's annotations and 100
``NodeNames`` (``nodeCacheCapable: true``). Latency is the client's round trip per request.

Two services are measured: the default one (device reports cached for 1 s, so a burst of
pods reads Redis about once a second) and one with the cache off
(``EMBER_EXTENDER_CACHE=0``: every call reads all 100 reports from Redis). Target: prioritize
p50 <= 5 ms with the default settings. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from gateway.spawn import ExtenderProcess
from scheduler import cluster_keys
from scheduler.redis_server import EmbeddedRedis
from scheduler.state import ClusterState

NODES = 100
MODELS = 20
MB = 1 << 20
TARGET_P50_MS = 5.0


def seed_reports(state: ClusterState, rng: random.Random) -> list[str]:
    """100 device reports with a few models resident each; the node names."""
    nodes = [f"node-{i:03d}" for i in range(NODES)]
    for node in nodes:
        resident = {f"model-{m:02d}": rng.randrange(1, 500) * MB for m in rng.sample(range(MODELS), 4)}
        state.report_device(
            cluster_keys.device_id(node),
            {
                "node": node,
                "device": "cpu",
                "capacity_bytes": 4 << 30,
                "free_bytes": rng.randrange(0, 2 << 30),
                "evictable_bytes": sum(resident.values()),
                "resident_bytes": sum(resident.values()),
                "load_bandwidth": rng.uniform(1e9, 4e9),
                "models": resident,
            },
        )
    return nodes


def pod(model: str) -> dict[str, Any]:
    """A function pod as Knative creates it from a rendered revision (the fields that matter)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "chat-00001-deployment-5d8f7c9b4-x2k8p",
            "generateName": "chat-00001-deployment-5d8f7c9b4-",
            "namespace": "ember-fn",
            "labels": {
                cluster_keys.LABEL_FUNCTION: "chat",
                cluster_keys.LABEL_NAMESPACE: "default",
                "serving.knative.dev/service": "chat",
                "serving.knative.dev/revision": "chat-00001",
                "serving.knative.dev/configuration": "chat",
                "app": "chat-00001",
            },
            "annotations": {
                cluster_keys.ANNOTATION_FUNCTION_ID: "chat",
                cluster_keys.ANNOTATION_MODEL: model,
                cluster_keys.ANNOTATION_WEIGHT_BYTES: str(270 * MB),
                "autoscaling.knative.dev/target": "6",
                "autoscaling.knative.dev/window": "10s",
                "serving.knative.dev/creator": "system:serviceaccount:ember:ember-gateway",
            },
        },
        "spec": {
            "schedulerName": "ember-scheduler",
            "containers": [
                {
                    "name": "worker",
                    "image": "ember:0.1.0",
                    "args": ["worker", "--function", "chat"],
                    "ports": [{"name": "http1", "containerPort": 8080}],
                    "readinessProbe": {"httpGet": {"path": "/readyz", "port": 8080}, "periodSeconds": 1},
                    "volumeMounts": [{"name": "ember-run", "mountPath": "/var/run/ember", "readOnly": True}],
                },
                {"name": "queue-proxy", "image": "gcr.io/knative-releases/queue:v1.23"},
            ],
            "volumes": [{"name": "ember-run", "hostPath": {"path": "/var/run/ember", "type": "Directory"}}],
        },
    }


def measure(url: str, verb: str, nodes: list[str], requests: int, rng: random.Random) -> list[float]:
    """Round-trip seconds of ``requests`` calls of ``verb`` (after 50 warm-up calls)."""
    bodies = [
        json.dumps({"Pod": pod(f"model-{rng.randrange(MODELS):02d}"), "NodeNames": nodes}).encode()
        for _ in range(64)
    ]
    headers = {"content-type": "application/json"}
    out = []
    with httpx.Client(base_url=url, timeout=10) as http:
        for i in range(50 + requests):
            t0 = time.perf_counter()
            response = http.post(f"/{verb}", content=bodies[i % len(bodies)], headers=headers)
            elapsed = time.perf_counter() - t0
            response.raise_for_status()
            if i >= 50:
                out.append(elapsed)
    return out


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": round(statistics.median(ordered) * 1e3, 3),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="300 requests")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    requests = 300 if args.quick else args.requests
    rng = random.Random(args.seed)
    t_bench = time.perf_counter()
    out: dict[str, Any] = {"bench": "extender", "nodes": NODES, "requests": requests}
    with tempfile.TemporaryDirectory(prefix="ember-bench-extender-") as tmp:
        root = Path(tmp)
        redis = EmbeddedRedis(root / "redis")
        redis.start()
        try:
            state = ClusterState.from_url(redis.url)
            nodes = seed_reports(state, rng)
            t0 = time.perf_counter()
            reads = 20
            for _ in range(reads):
                state.device_reports()
            out["redis_read_100_reports_ms"] = round((time.perf_counter() - t0) / reads * 1e3, 3)
            state.close()
            for label, env in (("cached", {}), ("uncached", {"EMBER_EXTENDER_CACHE": "0"})):
                extender = ExtenderProcess(redis.url, root / f"extender-{label}.log", env=env)
                try:
                    prioritize = measure(extender.url, "prioritize", nodes, requests, rng)
                    filtered = measure(extender.url, "filter", nodes, requests // 2, rng)
                    logged = len(extender.decisions())
                finally:
                    extender.stop()
                out[label] = {
                    "prioritize": summary(prioritize),
                    "filter": summary(filtered),
                    "decisions_logged": logged,
                }
        finally:
            redis.stop()
    p50 = out["cached"]["prioritize"]["p50_ms"]
    out["prioritize_p50_ms"] = p50
    out["prioritize_p99_ms"] = out["cached"]["prioritize"]["p99_ms"]
    out["target_p50_ms"] = TARGET_P50_MS
    out["pass"] = p50 <= TARGET_P50_MS
    out["loadavg_1m"] = round(os.getloadavg()[0], 2)
    out["wall_s"] = round(time.perf_counter() - t_bench, 1)
    print(json.dumps(out, separators=(",", ":")))


if __name__ == "__main__":
    main()
